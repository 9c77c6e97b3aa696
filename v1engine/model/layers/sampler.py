"""The sampler and the per-step metadata it reads. Sampling a batch: penalties, temperature,
top-k / top-p / min-p, then a draw.

Order per row (HF's and vLLM's): logprobs from the raw logits (vLLM's default "raw logprobs":
before penalties, temperature and truncation, so they describe the model, not the sampler), then
repetition / frequency / presence penalties, then greedy rows take the argmax; random rows divide
by their temperature, keep the top-k tokens (ties with the k-th are kept, as HF does), then the
smallest set whose probability reaches top_p, then tokens with prob >= min_p * max prob, and draw
with the exponential race: argmax(probs / q), q ~ Exp(1) i.i.d., picks token i with probability
probs[i]. The race needs no cumulative sum over the vocabulary and no host sync; a seeded row
draws its q from its own generator, so its tokens depend only on its seed and logits, never on
which other requests share the batch. Everything stays on the device: the caller moves
`sampled_token_ids` to the host once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# Temperatures below this are greedy: dividing by them would overflow the logits.
GREEDY_TEMPERATURE = 1e-5


# Per-step sampling parameters of a batch, as device tensors the `Sampler` reads.
#
# One row per request, in batch order. Each optional tensor is None when the feature is off for
# every row, and the host-side flags (`all_greedy`, `all_random`, `no_penalties`) are known without
# reading device memory, so the sampler skips whole stages without a host sync. "Off" values inside
# a tensor leave their row untouched: top_k <= 0 or >= vocab, top_p >= 1, min_p 0, penalties 0
# (presence/frequency) and 1 (repetition). Values are validated by `SamplingParams`, not here.
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

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

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
        generators: dict[int, torch.Generator] | None = None,
        max_num_logprobs: int | None = None,
    ) -> SamplingMetadata:
        """Builds the tensors from per-request Python values (a list left None is off for all
        rows); the flags come from the lists, so building needs no device reads."""
        num_reqs = len(temperature)
        per_request = dict(
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
        )
        for name, values in per_request.items():
            if values is not None and len(values) != num_reqs:
                raise ValueError(f"{name} has {len(values)} entries for {num_reqs} requests")
        greedy = [t < GREEDY_TEMPERATURE for t in temperature]
        penalty_lists = (presence_penalty, frequency_penalty, repetition_penalty)
        token_lists = (prompt_token_ids, output_token_ids)
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
        )


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


# -- the sampler -------------------------------------------------------------------------------
@dataclass
class LogprobsTensors:
    # [num_reqs, 1 + k] int64: column 0 is the sampled token, then the k most likely tokens.
    token_ids: torch.Tensor
    # [num_reqs, 1 + k] fp32: log_softmax of the raw logits at those tokens.
    logprobs: torch.Tensor
    # [num_reqs] int64: 1 + the number of tokens strictly more likely than the sampled one.
    sampled_token_ranks: torch.Tensor


@dataclass
class SamplerOutput:
    # [num_reqs] int64
    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [num_reqs, vocab_size]; the caller's tensor is never modified."""
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        sampled = sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Penalized copy of logits [num_reqs, vocab_size].

    Repetition (HF/vLLM): a token in the prompt or the output so far has a positive logit divided
    by the penalty and a negative one multiplied by it. Frequency subtracts penalty * count and
    presence subtracts penalty once, both over output tokens only (OpenAI's definition).
    """
    counts = metadata.output_token_counts  # [num_reqs, vocab_size] int32
    in_output = counts > 0
    seen = in_output
    if metadata.prompt_token_mask is not None:
        seen = seen | metadata.prompt_token_mask
    repetition = metadata.repetition_penalties[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - metadata.frequency_penalties[:, None] * counts
    return logits - metadata.presence_penalties[:, None] * in_output


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """[num_reqs] int64 token ids from (penalized) logits [num_reqs, vocab_size]."""
    greedy = None if metadata.all_random else logits.argmax(dim=-1)
    if metadata.all_greedy:
        return greedy
    is_greedy = metadata.temperature < GREEDY_TEMPERATURE
    # Greedy rows divide by 1: their random draw is discarded below anyway.
    temperature = torch.where(is_greedy, 1.0, metadata.temperature)
    logits = logits / temperature[:, None]
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    probs = torch.softmax(logits, dim=-1)
    sampled = (probs / _exponential(probs, metadata.generators)).argmax(dim=-1)
    if greedy is None:
        return sampled
    return torch.where(is_greedy, greedy, sampled)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Logits [num_reqs, vocab_size] with tokens outside each row's top-k / top-p set at -inf.

    top_k: [num_reqs] int64, <= 0 or >= vocab_size is off; top_p: [num_reqs] fp32, >= 1 is off.
    One descending sort serves both, so no per-row k needs reading on the host.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k >= vocab_size), vocab_size, top_k)
        kth_largest = sorted_logits.gather(1, (k - 1)[:, None])  # [num_reqs, 1]
        keep &= sorted_logits >= kth_largest
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        # Mass of the strictly more likely tokens: the most likely token is always kept, and
        # rounding in the sum cannot drop tail tokens of a row whose top_p is off.
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keeps tokens with prob >= min_p * the row's max prob, i.e. logit >= max + log(min_p);
    min_p 0 gives log 0 = -inf and keeps every token. min_p: [num_reqs] fp32."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _exponential(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """q ~ Exp(1) shaped like probs: one batched draw, then seeded rows redrawn alone."""
    q = torch.empty_like(probs).exponential_()
    # A loop over seeded rows only: each needs its own generator, and drawing a row by itself
    # makes its q independent of the batch around it.
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # q == 0 would turn a masked token's 0 / 0 into nan, which argmax would pick.
    return q.clamp_(min=torch.finfo(q.dtype).tiny)


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, sampled: torch.Tensor
) -> LogprobsTensors:
    """logprobs: [num_reqs, vocab_size] log_softmax; sampled: [num_reqs] int64."""
    sampled_logprobs = logprobs.gather(1, sampled[:, None])  # [num_reqs, 1]
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
    num_top = min(num_logprobs, logprobs.shape[-1])
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
        sampled_token_ranks=ranks,
    )
