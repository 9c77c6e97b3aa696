"""The one matmul every linear layer and the LM head call: y = x W^T + b.

On CPU, torch's `F.linear` goes to MKL's sgemm, which on the AMD EPYC (AVX-512) we benchmark on ran
1.5-3x slower than oneDNN's JIT kernels at 64 tokens and more, and about even at 1 token
(`scripts/bench_gemm.py` measures both). So on CPU, float32 and bfloat16 inputs go through
oneDNN's linear (`mkldnn._linear_pointwise`, the op torch's own CPU compiler emits for linear
layers), with plain weights, so tensor-parallel shards and tied embeddings need no repacking.
Anywhere else, or if this torch lacks the op, `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from v1engine.logger import init_logger

logger = init_logger(__name__)

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in_features], weight [out_features, in_features] -> [..., out_features]."""
    if x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and _onednn_linear_works():
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@functools.cache
def _onednn_linear_works() -> bool:
    """Whether this torch build has oneDNN's linear and it agrees with `F.linear` on a probe."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=generator)
    weight = torch.randn(5, 8, generator=generator)
    bias = torch.randn(5, generator=generator)
    try:
        with torch.inference_mode():
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    except RuntimeError as e:
        logger.warning("oneDNN linear unavailable (%s); CPU matmuls use F.linear", e)
        return False
    return bool(torch.allclose(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-5))
