"""Each CPU kernel against the torch code it replaces (the layers' own torch paths; a dense
reference for attention) on small inputs, once per process, before any is used: a library that
builds but computes wrongly here (a compiler or CPU quirk) must not serve a model. The inputs
cover each kernel's branches (a single matmul row and the four-row tiles, whole and partial token
panels, a sliding window, shuffled blocks, grouped query heads, both dtypes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v1engine.logger import init_logger
from v1engine.model.layers import activation, cpu_kernels, layernorm, rotary_embedding
from v1engine.model.layers.cpu_kernel_library import KERNEL_DTYPES

logger = init_logger(__name__)


def agrees_with_torch() -> bool:
    generator = torch.Generator().manual_seed(0)
    for dtype in KERNEL_DTYPES:
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        for name, out, expected in _cases(generator, dtype):
            if not torch.allclose(out.float(), expected.float(), rtol=tolerance, atol=tolerance):
                logger.warning(
                    "CPU %s kernel disagrees with torch (%s); the CPU kernels are not used",
                    name,
                    dtype,
                )
                return False
    return True


def _cases(generator: torch.Generator, dtype: torch.dtype):
    """(kernel name, its output, torch's) for each kernel."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    for tokens in (1, 5):  # one row; a four-row tile and a row after it
        x, weight, bias = randn(tokens, 37), randn(5, 37), randn(5)
        yield "gemv", cpu_kernels.gemv(x, weight, bias), F.linear(x, weight, bias)
    if cpu_kernels.max_gemm_tokens(dtype):
        # A full token panel and a partial one; a partial tile of weight rows.
        x, weight, bias = randn(50, 37), randn(11, 37), randn(11)
        yield "gemm", cpu_kernels.gemm(x, weight, bias), F.linear(x, weight, bias)
    x, residual, weight = randn(2, 37), randn(2, 37), randn(37)
    out, total = cpu_kernels.rms_norm(x, residual, weight, 1e-5)
    yield "rms_norm", out, layernorm.rms_norm(x + residual, weight, 1e-5)
    query, key, angles = randn(3, 4, 8), randn(3, 2, 8), torch.rand(3, 1, 8, generator=generator)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    yield (
        "rotary",
        torch.cat(cpu_kernels.rotary(query, key, cos, sin), 1),
        torch.cat(rotary_embedding.rotate(query, key, cos, sin), 1),
    )
    gate_up = randn(3, 10)
    yield "silu_and_mul", cpu_kernels.silu_and_mul(gate_up), activation.silu_and_mul(gate_up)
    for window in (None, 3):
        query, kv_cache, block_table, seq_lens = _attention_case(randn)
        out = cpu_kernels.decode_attention(query, *kv_cache, block_table, seq_lens, 0.3, window)
        expected = _decode_attention(query, kv_cache, block_table, seq_lens, 0.3, window)
        yield "decode_attention", out, expected


def _attention_case(randn) -> tuple:
    """Two sequences (5 and 3 keys), 4 query heads over 2 KV heads, blocks of 2, shuffled."""
    kv_cache = (randn(6, 2, 2, 8), randn(6, 2, 2, 8))
    block_table = torch.tensor([[4, 0, 5, 1], [2, 3, 1, 1]], dtype=torch.int32)
    return randn(2, 4, 8), kv_cache, block_table, torch.tensor([5, 3], dtype=torch.int32)


def _decode_attention(query, kv_cache, block_table, seq_lens, scale, window):
    out = torch.empty_like(query, dtype=torch.float32)
    block_size, num_kv_heads = kv_cache[0].shape[1], kv_cache[0].shape[2]
    group = query.shape[1] // num_kv_heads
    for s, seq_len in enumerate(seq_lens.tolist()):
        first = 0 if window is None else max(0, seq_len - window)
        positions = torch.arange(first, seq_len)
        slots = block_table[s].long()[positions // block_size] * block_size + positions % block_size
        key, value = (c.flatten(0, 1)[slots].float().repeat_interleave(group, 1) for c in kv_cache)
        weights = torch.softmax(torch.einsum("hd,khd->hk", query[s].float(), key) * scale, -1)
        out[s] = torch.einsum("hk,khd->hd", weights, value)
    return out
