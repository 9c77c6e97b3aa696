"""Greedy tokens from a float32 LM head for half its memory traffic, and exactly the argmax.

On CPU a decode step of a few requests streams every weight once, so its time is the bytes it
reads; a small model's LM head is a large share of them (SmolLM2-135M: 113 of 538 MB in float32).
When every row of a step takes the plain argmax of its logits (greedy, without logprobs, bias,
token masks, penalties or grammar: `SamplingMetadata.argmax_only`), a bfloat16 copy of the head
screens the vocabulary and the float32 weights decide among the few rows it cannot rule out:

1. approximate logits a = bf16(h) bf16(W)^T: our gemv or bfloat16 gemm, float32 sums, the result
   rounded to bf16;
2. each |a_r - z_r| <= B_r, z being the float32 logits, with u = 2^-8 (bfloat16's unit
   roundoff, rounding to nearest), B_r = P |h| + u |a_r| and
   P = (2u + u^2 + 2 K 2^-24 (1 + 2u)) max_r |W_r|: the two rounded factors put each product
   within (2u + u^2) of |W_ri h_i|, Cauchy-Schwarz bounds the sum of those by the norms, the
   float32 sums of K products (a's and z's) add K 2^-24 of it each, and rounding a to bfloat16
   adds u |a_r| (the bfloat16 gemm, AVX512-BF16, also reads denormals as zero: at most K 2^-126
   more, inside the slack unless every logit is itself near float32's smallest normal);
3. the argmax t of z has a_t + B_t >= z_t >= z_m >= a_m - B_m, m being a's argmax, so
   a_t + u |a_t| >= max(a) - u |max(a)| - 2 P |h|. The left side grows with a_t: the rows above
   one threshold hold t, and the float32 logits of those rows pick it (the first on a tie, as
   argmax does). Those logits come from our float32 gemv: at one row the same bits as the full
   head's; at more rows the full head runs the packed gemm, whose sums may differ in the last
   bit, so there a near-tie at float32's own rounding may go either way, as between two kernels.

One threshold per row of the step keeps the screen to a few passes over the approximate logits,
on this thread (a parallel region's barrier costs a time slice on cores that another process
wants).

On SmolLM2's own greedy text the candidates were 8 rows at the median, 58 at the 90th percentile
and 407 at most of 49,152 (331 tokens); the screen gives up, and the caller computes every logit,
past `MAX_CANDIDATES`. At one row on the 2-core AMD EPYC (medians of 200 calls) the screen took
1.09 ms where the float32 head and its argmax took 2.16, and 1.11 against 6.04 with one busy
process per core.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.linear import ParallelLMHead, kernels_apply, linear
from v1engine.model.parallel_state import get_tp_world_size

_UNIT_ROUNDOFF_BF16 = 2.0**-8
_UNIT_ROUNDOFF_FP32 = 2.0**-24
# Past this many candidate rows the gathered float32 rows cost more than the screen saves.
MAX_CANDIDATES = 4096
# The screen's passes over the approximate logits run on one thread, in numpy: at a few rows they
# cost microseconds, at dozens they would cost more than the float32 head (measured up to 5).
MAX_ROWS = 5
# The norms and the bound's own float32 arithmetic are off by far less than this share of it.
_SLACK = 1.001


class GreedyScreen:
    def __init__(self, weight: torch.Tensor) -> None:
        """weight: the LM head's float32 rows [vocab_size, hidden_size] (not copied)."""
        self.weight = weight
        self.weight_bf16 = torch.empty_like(weight, dtype=torch.bfloat16)
        self.products_bound = 0.0
        self.refresh()

    def refresh(self) -> None:
        """Derives the bfloat16 copy and the bound from `weight` again (after it was loaded
        again in place)."""
        self.weight_bf16.copy_(self.weight)
        u, hidden_size = _UNIT_ROUNDOFF_BF16, self.weight.shape[1]
        products = 2 * u + u * u + 2 * hidden_size * _UNIT_ROUNDOFF_FP32 * (1 + 2 * u)
        # P in B_r = P |h| + u |a_r|.
        self.products_bound = _SLACK * products * self.weight.norm(dim=1).max().item()

    @classmethod
    def for_model(cls, model: nn.Module) -> GreedyScreen | None:
        """The screen for `model.lm_head`, or None where it would not save memory traffic: on
        GPU, in bfloat16, without our CPU kernels, or with the vocabulary split over ranks; or
        where the head adds a bias."""
        head = getattr(model, "lm_head", None)
        if not isinstance(head, ParallelLMHead) or get_tp_world_size() != 1:
            return None
        if getattr(head, "bias", None) is not None:  # Phi-2's: the screen reads no bias
            return None
        weight = head.weight[: head.num_embeddings]
        if weight.dtype != torch.float32 or not cpu_kernels.cpu_inputs(weight):
            return None
        return cls(weight) if kernels_apply(weight, None) else None

    @property
    def nbytes(self) -> int:
        return self.weight_bf16.numel() * self.weight_bf16.element_size()

    @staticmethod
    def applies(num_rows: int) -> bool:
        """Whether a step of `num_rows` sampling rows reads the head as a stream (decode steps
        of up to MAX_ROWS requests)."""
        return 0 < num_rows <= MAX_ROWS

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_rows] int64: each row's argmax of hidden [num_rows, hidden_size] @ weight^T, or
        None where the screen cannot decide cheaply: more than MAX_CANDIDATES rows stay in
        doubt, or the logits are not finite."""
        approx = _bf16_as_float32(
            linear(hidden.to(torch.bfloat16), self.weight_bf16)  # our gemv or bfloat16 gemm
        )  # [num_rows, vocab_size]
        high = approx.max(axis=1, keepdims=True).astype(np.float64)
        hidden_norms = torch.linalg.vector_norm(hidden, dim=1, keepdim=True).double().numpy()
        u = _SLACK * _UNIT_ROUNDOFF_BF16
        # x + u |x| >= target, solved for x.
        target = high - u * np.abs(high) - 2 * self.products_bound * hidden_norms
        floors = np.where(target >= 0, target / (1 + u), target / (1 - u))
        if not np.isfinite(floors).all():  # NaN or inf: the sampler's argmax has its own rule
            return None
        in_doubt = approx >= floors  # [num_rows, vocab_size]
        candidates = np.flatnonzero(in_doubt.any(axis=0))  # ascending
        if len(candidates) > MAX_CANDIDATES:
            return None
        rows = torch.from_numpy(candidates)
        logits = cpu_kernels.gemv(hidden, self.weight[rows])  # [num_rows, num_candidates]
        logits.masked_fill_(torch.from_numpy(~in_doubt[:, candidates]), float("-inf"))
        return rows[logits.argmax(dim=1)]


def _bf16_as_float32(t: torch.Tensor) -> np.ndarray:
    """A bfloat16 tensor's values as a float32 array: the same bits, shifted into the top half.
    In numpy, because its passes run on this thread: each of torch's on a vocabulary-sized
    tensor is a parallel region, and with one busy process per core each cost 0.5 ms (1.5 ms for
    `nonzero`) against a few microseconds on a quiet machine."""
    bits = t.view(torch.int16).numpy().astype(np.int32)
    return (bits << 16).view(np.float32)
