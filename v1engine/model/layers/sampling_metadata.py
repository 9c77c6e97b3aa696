"""The per-step sampling parameters of a batch, as the device tensors the `Sampler` reads, and how
they are built from per-request Python values.

One row per request, in batch order. Each optional tensor is None when the feature is off for
every row, and the host-side flags (`all_greedy`, `all_random`, `no_penalties`) are known without
reading device memory, so the sampler skips whole stages without a host sync. "Off" values inside
a tensor leave their row untouched: top_k <= 0 or >= vocab, top_p >= 1, min_p 0, penalties 0
(presence/frequency) and 1 (repetition). Values are validated by `SamplingParams`, not here.

The logit-bias stage covers OpenAI's `logit_bias` and every token mask (`allowed_token_ids`, bad
words, EOS held off by `min_tokens`) as one additive tensor with -inf at masked tokens, built only
for the rows that use any of them: a batch without them pays nothing, and a batch with a few
pays for those rows only. Structured outputs' grammar bitmask is likewise only for its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Temperatures below this are greedy: dividing by them would overflow the logits.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    # [num_reqs] fp32; < GREEDY_TEMPERATURE means greedy (argmax).
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    # [num_reqs] int64 or None.
    top_k: torch.Tensor | None = None
    # [num_reqs] fp32 or None.
    top_p: torch.Tensor | None = None
    # [num_reqs] fp32 or None: keep tokens with prob >= min_p * the row's largest prob.
    min_p: torch.Tensor | None = None
    # Row index -> generator (on the logits' device) of a seeded request; other rows share one
    # batched draw from the default generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # None: no logprobs. k >= 0: the sampled token's logprob plus the k most likely tokens'.
    max_num_logprobs: int | None = None
    no_penalties: bool = True
    # [num_reqs] fp32 each; read only when no_penalties is False.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # [num_reqs, vocab_size] int32: how often each token occurs in the request's output so far.
    output_token_counts: torch.Tensor | None = None
    # [num_reqs, vocab_size] bool: tokens of the prompt (repetition penalty covers them too).
    prompt_token_mask: torch.Tensor | None = None
    # [num_biased_rows] int64: the rows that use logit_bias or a token mask, or None: no row.
    logit_bias_rows: torch.Tensor | None = None
    # [num_biased_rows, vocab_size] fp32 added to those rows' logits: the logit_bias values,
    # -inf at tokens outside allowed_token_ids and at banned tokens.
    logit_bias: torch.Tensor | None = None
    # [num_structured_rows] int64: the rows a grammar constrains, or None: no row.
    grammar_bitmask_rows: torch.Tensor | None = None
    # [num_structured_rows, ceil(vocab_size / 32)] int32: bit t % 32 of word t // 32 set iff
    # the row may sample token t (xgrammar's packing).
    grammar_bitmask: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    @property
    def argmax_only(self) -> bool:
        """Whether every row samples the argmax of its raw logits and reads nothing else of them."""
        return (
            self.all_greedy
            and self.no_penalties
            and self.max_num_logprobs is None
            and self.logit_bias is None
            and self.grammar_bitmask is None
        )

    @classmethod
    def from_lists(
        cls,
        temperature: list[float],
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        top_k: list[int] | None = None,
        top_p: list[float] | None = None,
        min_p: list[float] | None = None,
        presence_penalty: list[float] | None = None,
        frequency_penalty: list[float] | None = None,
        repetition_penalty: list[float] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        output_token_ids: list[list[int]] | None = None,
        logit_bias: list[dict[int, float] | None] | None = None,
        allowed_token_ids: list[list[int] | None] | None = None,
        banned_token_ids: list[list[int]] | None = None,
        generators: dict[int, torch.Generator] | None = None,
        max_num_logprobs: int | None = None,
        grammar_bitmask: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """Builds the tensors from per-request Python values (a list left None is off for all
        rows; `banned_token_ids` are the tokens each row must not sample this step); the flags
        come from the lists, so building needs no device reads. `grammar_bitmask` is (rows, their
        packed bitmask on any device)."""
        # Every list argument has one entry per request (read before any local is bound).
        _check_num_rows(
            len(temperature), {k: v for k, v in locals().items() if isinstance(v, list)}
        )
        num_reqs = len(temperature)
        penalty_lists = (presence_penalty, frequency_penalty, repetition_penalty)
        token_lists = (prompt_token_ids, output_token_ids)
        masks = (logit_bias, allowed_token_ids, banned_token_ids)
        greedy = [t < GREEDY_TEMPERATURE for t in temperature]
        penalties = _penalty_fields(num_reqs, vocab_size, device, *penalty_lists, *token_lists)
        return cls(
            temperature=_tensor(temperature, torch.float32, device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=_tensor_if(top_k, lambda k: 0 < k < vocab_size, torch.int64, device),
            top_p=_tensor_if(top_p, lambda p: p < 1.0, torch.float32, device),
            min_p=_tensor_if(min_p, lambda p: p > 0.0, torch.float32, device),
            generators=dict(generators or {}),
            max_num_logprobs=max_num_logprobs,
            **penalties,
            **_logit_bias_fields(num_reqs, vocab_size, device, *masks),
            **_grammar_bitmask_fields(grammar_bitmask, device),
        )


def _grammar_bitmask_fields(
    grammar_bitmask: tuple[list[int], torch.Tensor] | None, device: torch.device | str
) -> dict:
    if grammar_bitmask is None or not grammar_bitmask[0]:
        return {}
    rows, bitmask = grammar_bitmask
    return {
        "grammar_bitmask_rows": _tensor(rows, torch.int64, device),
        "grammar_bitmask": bitmask.to(device=device, dtype=torch.int32, non_blocking=True),
    }


def _check_num_rows(num_reqs: int, per_request: dict[str, list]) -> None:
    for name, values in per_request.items():
        if len(values) != num_reqs:
            raise ValueError(f"{name} has {len(values)} entries for {num_reqs} requests")


def _tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _tensor_if(values, is_on, dtype: torch.dtype, device: torch.device | str):
    """The values as a tensor if any row turns the feature on, else None (skipped)."""
    if values is None or not any(is_on(v) for v in values):
        return None
    return _tensor(values, dtype, device)


def _penalty_fields(
    num_reqs: int,
    vocab_size: int,
    device: torch.device | str,
    presence: list[float] | None,
    frequency: list[float] | None,
    repetition: list[float] | None,
    prompt_token_ids: list[list[int]] | None,
    output_token_ids: list[list[int]] | None,
) -> dict:
    on = any(p != 0.0 for p in presence or []) or any(f != 0.0 for f in frequency or [])
    on = on or any(r != 1.0 for r in repetition or [])
    if not on:
        return {"no_penalties": True}
    prompt_mask = None
    if prompt_token_ids is not None:
        prompt_mask = _token_counts(prompt_token_ids, vocab_size, device) > 0
    return {
        "no_penalties": False,
        "presence_penalties": _tensor(presence or [0.0] * num_reqs, torch.float32, device),
        "frequency_penalties": _tensor(frequency or [0.0] * num_reqs, torch.float32, device),
        "repetition_penalties": _tensor(repetition or [1.0] * num_reqs, torch.float32, device),
        "output_token_counts": _token_counts(
            output_token_ids or [[]] * num_reqs, vocab_size, device
        ),
        "prompt_token_mask": prompt_mask,
    }


def _token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[num_reqs, vocab_size] int32 occurrence counts of ragged token-id lists."""
    width = max(1, max(map(len, token_ids), default=0))
    # Pad with vocab_size: those land in an extra column that is dropped.
    padded = [ids + [vocab_size] * (width - len(ids)) for ids in token_ids]
    index = torch.tensor(padded, dtype=torch.int64, device=device)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.int32))
    return counts[:, :vocab_size]


def _logit_bias_fields(
    num_reqs: int,
    vocab_size: int,
    device: torch.device | str,
    logit_bias: list[dict[int, float] | None] | None,
    allowed_token_ids: list[list[int] | None] | None,
    banned_token_ids: list[list[int]] | None,
) -> dict:
    """`logit_bias_rows` and `logit_bias` for the rows that use any of the three, or nothing.

    Built on the device from sparse (row, token) lists, so only index lists cross to the device:
    allowed tokens are cleared out of a -inf row, biases are added, banned tokens set to -inf.
    """
    bias = logit_bias or [None] * num_reqs
    allowed = allowed_token_ids or [None] * num_reqs
    banned = banned_token_ids or [[]] * num_reqs
    rows = [r for r in range(num_reqs) if bias[r] or allowed[r] is not None or banned[r]]
    if not rows:
        return {}
    values = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    restricted = [i for i, r in enumerate(rows) if allowed[r] is not None]
    if restricted:
        values[_tensor(restricted, torch.int64, device)] = float("-inf")
        values[_sparse_index([(i, allowed[rows[i]]) for i in restricted], device)] = 0.0
    biased = [(i, bias[r]) for i, r in enumerate(rows) if bias[r]]
    if biased:
        index = _sparse_index([(i, list(b)) for i, b in biased], device)
        added = _tensor([v for _, b in biased for v in b.values()], torch.float32, device)
        values.index_put_(index, added, accumulate=True)
    values[_sparse_index([(i, banned[r]) for i, r in enumerate(rows)], device)] = float("-inf")
    return {"logit_bias_rows": _tensor(rows, torch.int64, device), "logit_bias": values}


def _sparse_index(
    row_tokens: list[tuple[int, list[int]]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, token ids) addressing each row's listed tokens."""
    row_index = [row for row, tokens in row_tokens for _ in tokens]
    token_index = [t for _, tokens in row_tokens for t in tokens]
    return _tensor(row_index, torch.int64, device), _tensor(token_index, torch.int64, device)
