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
        x, weight, bias = randn(50, 38), randn(11, 38), randn(11)  # even K: bfloat16 pairs
        yield "gemm", cpu_kernels.gemm(x, weight, bias), F.linear(x, weight, bias)
    if cpu_kernels.max_gemm_packed_tokens(dtype):
        # Full blocks of tokens and a partial one; a full panel of outputs and a partial one.
        x, weight, bias = randn(19, 37), randn(61, 37), randn(61)
        packed = cpu_kernels.pack_weight(weight)
        yield "gemm_packed", cpu_kernels.gemm_packed(x, packed, 61, bias), F.linear(x, weight, bias)
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
        for head_size, query_start_loc in ((8, None), (16, [0, 3, 4])):
            case = _attention_case(randn, head_size, query_start_loc)
            yield (
                "paged_attention",
                cpu_kernels.paged_attention(*case[:5], 0.3, window, case[5]),
                _paged_attention(*case, 0.3, window),
            )


def _attention_case(randn, head_size: int, query_start_loc: list[int] | None) -> tuple:
    """Two sequences of 5 and 3 keys, blocks of 2, shuffled; 4 query heads over 2 KV heads; one
    query row per sequence, or the rows query_start_loc gives (the first sequence's last 3)."""
    kv_cache = (randn(6, 2, 2, head_size), randn(6, 2, 2, head_size))
    block_table = torch.tensor([[4, 0, 5, 1], [2, 3, 1, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 3], dtype=torch.int32)
    if query_start_loc is None:
        return randn(2, 4, head_size), *kv_cache, block_table, seq_lens, None
    starts = torch.tensor(query_start_loc, dtype=torch.int32)
    return randn(query_start_loc[-1], 4, head_size), *kv_cache, block_table, seq_lens, starts


def _paged_attention(query, key_cache, value_cache, block_table, seq_lens, starts, scale, window):
    """A dense reference: every query row over the keys it sees, gathered position by position."""
    out = torch.empty_like(query, dtype=torch.float32)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    bounds = list(range(len(seq_lens) + 1)) if starts is None else starts.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        for row in range(bounds[s], bounds[s + 1]):
            position = seq_len - (bounds[s + 1] - row)
            first = 0 if window is None else max(0, position + 1 - window)
            keys = torch.arange(first, position + 1)
            table = block_table[s].long()
            slots = table[keys // block_size] * block_size + keys % block_size
            k, v = (
                c.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
                for c in (key_cache, value_cache)
            )
            weights = torch.softmax(torch.einsum("hd,khd->hk", query[row].float(), k) * scale, -1)
            out[row] = torch.einsum("hk,khd->hd", weights, v)
    return out
