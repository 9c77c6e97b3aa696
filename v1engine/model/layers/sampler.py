"""The sampler: logit bias and token masks, penalties, temperature, top-k / top-p / min-p, then
a draw. What it reads per step is `SamplingMetadata` (sampling_metadata.py).

Order per row (HF's and vLLM's): logprobs from the raw logits (vLLM's default "raw_logprobs":
before bias, masks, penalties, temperature and truncation, so they describe the model, not the
sampler), then a structured-output grammar's bitmask (-inf at every token it does not allow, so no
later stage can bring one back), then `logit_bias` and the token masks (`allowed_token_ids`, bad
words, EOS and stop tokens before `min_tokens`) as one additive tensor with -inf at masked tokens,
then repetition / frequency / presence penalties, then greedy rows take the argmax; random rows
divide by their temperature, keep the top-k tokens (ties with the k-th are kept, as HF does), then
the smallest set whose probability reaches top_p, then tokens with prob >= min_p * max prob, and
draw with the exponential race: argmax(probs / q), q ~ Exp(1) i.i.d., picks token i with
probability probs[i]. The race needs no cumulative sum over the vocabulary and no host sync; a
seeded row draws its q from its own generator, so its tokens depend only on its seed and logits,
never on which other requests share the batch. Everything stays on the device: the caller moves
`sampled_token_ids` to the host once.

`logprobs_mode` (vLLM's) changes what the logprobs hold: "raw_logits" the raw logits themselves;
"processed_logprobs" / "processed_logits" those of the logits the draw used (-inf at every token
the grammar, the masks or the truncation ruled out; a greedy row's are its penalized logits, as
in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from v1engine.model.layers.sampling_metadata import GREEDY_TEMPERATURE, SamplingMetadata


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
    """`logprobs_mode`: what the logprobs hold (config.LOGPROBS_MODES)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        self.processed = logprobs_mode.startswith("processed")
        self.as_logits = logprobs_mode.endswith("logits")

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [num_reqs, vocab_size]; the caller's tensor is never modified."""
        logits = logits.float()
        wants_logprobs = metadata.max_num_logprobs is not None
        raw_logprobs = None
        if wants_logprobs and not self.processed:
            raw_logprobs = logits if self.as_logits else torch.log_softmax(logits, dim=-1)
        if metadata.grammar_bitmask is not None:
            logits = apply_grammar_bitmask(
                logits, metadata.grammar_bitmask_rows, metadata.grammar_bitmask
            )
        if metadata.logit_bias is not None:
            # Out of place: `logits` may still be the caller's tensor.
            logits = logits.index_add(0, metadata.logit_bias_rows, metadata.logit_bias)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        sampled, processed = sample(logits, metadata)
        if not wants_logprobs:
            return SamplerOutput(sampled_token_ids=sampled, logprobs=None)
        values = raw_logprobs
        if values is None:
            values = processed if self.as_logits else torch.log_softmax(processed, dim=-1)
        logprobs = gather_logprobs(values, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def apply_grammar_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """A copy of logits [num_reqs, vocab_size] with -inf in `rows` ([num_rows] int64) at every
    token whose bit is clear in `bitmask` ([num_rows, ceil(vocab_size / 32)] int32: token t is
    bit t % 32 of word t // 32). Bits past vocab_size are ignored."""
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # Arithmetic right shift of a negative word sign-extends, but `& 1` reads only bit `shift`.
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    masked = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


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


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_reqs] int64 token ids from (penalized) logits [num_reqs, vocab_size], and the
    logits the draw used (greedy rows: the ones given)."""
    greedy = None if metadata.all_random else logits.argmax(dim=-1)
    if metadata.all_greedy:
        return greedy, logits
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
        return sampled, logits
    return torch.where(is_greedy, greedy, sampled), logits


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
