"""Greedy tokens from a float32 LM head for half its memory traffic, and exactly the argmax.

On CPU a decode step of a few requests streams every weight once, so its time is the bytes it
reads; a small model's LM head is a large share of them (SmolLM2-135M: 113 of 538 MB in float32).
When every row of a step takes the plain argmax of its logits (greedy, without logprobs, bias,
token masks, penalties or grammar: `SamplingMetadata.argmax_only`), a bfloat16 copy of the head
screens the vocabulary and the float32 weights decide among the few rows it cannot rule out:

1. approximate logits a = bf16(h) bf16(W)^T: our gemv, float32 sums, the result rounded to bf16;
2. each |a_r - z_r| <= B_r, z being the float32 logits, with u = 2^-8 (bfloat16's unit
   roundoff, rounding to nearest) and B_r = (2u + u^2 + 2 K 2^-24 (1 + 2u)) |W_r| |h| + u |a_r|:
   the two rounded factors put each product within (2u + u^2) of |W_ri h_i|, Cauchy-Schwarz
   bounds the sum of those by the norms, the float32 sums of K products (a's and z's) add
   K 2^-24 of it each, and rounding a to bfloat16 adds u |a_r|;
3. the argmax t of z has a_t + B_t >= z_t >= z_m >= a_m - B_m for every m, so the rows with
   a_r + B_r >= max(a) - max(B) hold t, and the float32 logits of those rows pick it (the first
   on a tie, as argmax does).

On SmolLM2's own greedy text the candidates were 2 rows at the median, 15 at the 90th percentile
and 100 at most of 49,152 (331 tokens); the screen gives up, and the caller computes every logit,
past `MAX_CANDIDATES`. At one row on the 2-core AMD EPYC the head took 0.93 ms instead of 2.16.
"""

from __future__ import annotations

import torch
from torch import nn

from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.linear import ParallelLMHead
from v1engine.model.parallel_state import get_tp_world_size

_UNIT_ROUNDOFF_BF16 = 2.0**-8
_UNIT_ROUNDOFF_FP32 = 2.0**-24
# Past this many candidate rows the gathered float32 rows cost more than the screen saves.
MAX_CANDIDATES = 4096
# The norms and the bound's own float32 arithmetic are off by far less than this share of it.
_SLACK = 1.001


class GreedyScreen:
    def __init__(self, weight: torch.Tensor) -> None:
        """weight: the LM head's float32 rows [vocab_size, hidden_size] (not copied)."""
        self.weight = weight
        self.weight_bf16 = weight.to(torch.bfloat16)
        u, hidden_size = _UNIT_ROUNDOFF_BF16, weight.shape[1]
        products = 2 * u + u * u + 2 * hidden_size * _UNIT_ROUNDOFF_FP32 * (1 + 2 * u)
        # [vocab_size]: B_r's first term, before the factor |h|.
        self.row_bounds = _SLACK * products * weight.norm(dim=1)

    @classmethod
    def for_model(cls, model: nn.Module) -> GreedyScreen | None:
        """The screen for `model.lm_head`, or None where it would not save memory traffic: on
        GPU, in bfloat16, without our CPU kernels, or with the vocabulary split over ranks."""
        head = getattr(model, "lm_head", None)
        if not isinstance(head, ParallelLMHead) or get_tp_world_size() != 1:
            return None
        weight = head.weight[: head.num_embeddings]
        if weight.dtype != torch.float32 or not cpu_kernels.cpu_inputs(weight):
            return None
        if not cpu_kernels.available() or not weight.is_contiguous():
            return None
        return cls(weight)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight_bf16, self.row_bounds))

    @staticmethod
    def applies(num_rows: int) -> bool:
        """Whether a step of `num_rows` sampling rows reads the head as a stream (our gemv)."""
        return 0 < num_rows <= cpu_kernels.max_gemv_tokens(torch.bfloat16)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_rows] int64: each row's argmax of hidden [num_rows, hidden_size] @ weight^T, or
        None where the screen cannot decide cheaply: more than MAX_CANDIDATES rows stay in
        doubt, or none does in a row (NaN)."""
        hidden = hidden.float().contiguous()
        approx = cpu_kernels.gemv(hidden.to(torch.bfloat16), self.weight_bf16).float()
        hidden_norms = torch.linalg.vector_norm(hidden, dim=1, keepdim=True)
        bounds = hidden_norms * self.row_bounds + _SLACK * _UNIT_ROUNDOFF_BF16 * approx.abs()
        floor = approx.amax(dim=1, keepdim=True) - bounds.amax(dim=1, keepdim=True)
        in_doubt = approx + bounds >= floor  # [num_rows, vocab_size]
        if not in_doubt.any(dim=1).all():  # NaN: the sampler's argmax has its own rule
            return None
        candidates = in_doubt.any(dim=0).nonzero().flatten()  # ascending
        if len(candidates) > MAX_CANDIDATES:
            return None
        logits = cpu_kernels.gemv(hidden, self.weight[candidates])  # [num_rows, num_candidates]
        logits.masked_fill_(~in_doubt[:, candidates], float("-inf"))
        return candidates[logits.argmax(dim=1)]
