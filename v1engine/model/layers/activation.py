"""Gated activations applied to the merged gate/up projection (SiluAndMul on CPU as one compiled
kernel, `cpu_elementwise.c`, where it is available)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from v1engine.model.layers import cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up, in torch ops."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.applies(x):
            return cpu_kernels.silu_and_mul(x)
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """[num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = gelu_tanh(gate) * up (Gemma's
    `gelu_pytorch_tanh`), in torch ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
