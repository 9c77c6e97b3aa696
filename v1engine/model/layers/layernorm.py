"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer. On CPU
both run as one compiled kernel (`cpu_rms_norm.c`) where it is available, with the same
arithmetic; torch's six small ops otherwise."""

from __future__ import annotations

import torch
from torch import nn

from v1engine.model.layers import cpu_kernels
from v1engine.model.weight_utils import default_weight_loader


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch ops: statistics in float32 whatever the model dtype, cast back before the
    scale (as HF does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual) for the next add."""
        if cpu_kernels.applies(x, residual, self.weight):
            out, total = cpu_kernels.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, total)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint holds an offset, the scale is 1 + weight, and it multiplies
    the normalized float32 values before the cast back (HF's Gemma3RMSNorm). In float32 on CPU
    that is RMSNorm's kernel with 1 + weight as its scale (the same operations in the same
    order; the scale is made each call, one small op, so it always follows the loaded weight);
    in other dtypes torch ops, since the kernel rounds before it scales."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual), as RMSNorm's."""
        if x.dtype == torch.float32 and cpu_kernels.applies(x, residual, self.weight):
            out, total = cpu_kernels.rms_norm(x, residual, 1.0 + self.weight, self.eps)
            return out if residual is None else (out, total)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)
