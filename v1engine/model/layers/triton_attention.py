"""Paged attention kernels in Triton: the CUDA backend (`triton_attention_backend.py`).

One kernel serves decode, prefill, chunked prefill and prefill over a cached prefix, mixed in one
batch. A program owns one *query tile* (up to BLOCK_Q consecutive new tokens of one request) and
one KV head; its BLOCK_M rows are those tokens times the GROUP query heads sharing that KV head,
so GQA reads each K/V block once per tile. It walks the tile's visible keys BLOCK_N at a time,
gathering them through the block table, with an online (running max / running sum) softmax in
fp32 and causal + sliding-window masks. Decode-only batches are usually too small to fill the GPU,
so they also split each request's keys over `num_kv_splits` programs (flash-decoding); a second
kernel merges the partial results.

Tests run these kernels on CPU under TRITON_INTERPRET=1, whose `tl.dot` cannot multiply bfloat16
(triton-lang/triton#11584), so off CUDA bfloat16 operands are widened to float32 first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from v1engine.model.layers.attention_backend import CommonAttentionMetadata

# A decode split below this many keys costs more in merging than it gains in parallelism.
_MIN_KEYS_PER_SPLIT = 256
# Power of two: the merge kernel loads all splits of a row as one block.
_MAX_KV_SPLITS = 16
# Stands in for "no sliding window": larger than any position, small enough for int32 math.
_NO_WINDOW = 1 << 30
_LOG2_E = 1.4426950408889634
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_SIZE)  # [HEADS_PAD, HEAD_PAD]
    cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    cache_off += offs_h * stride_ch + offs_d
    key = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(key_cache_ptr + cache_off, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_off, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The request owning virtual tile `tile`.

    Request r's tiles start at `query_start_loc[r] // BLOCK_Q + r`: non-decreasing in r and at
    least cdiv(query_len_r, BLOCK_Q) apart, so a grid of `num_tokens // BLOCK_Q + num_reqs` tiles
    covers every request without a host-side count; spare tiles find no rows and exit.
    """
    lo = 0
    hi = num_reqs - 1
    while lo < hi:  # last r whose first tile is <= tile
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attend_range(
    q, q_pos, kv_lo, kv_hi, sliding_window, qk_scale, soft_cap, key_cache_ptr, value_cache_ptr,
    block_table_row_ptr, kv_head, stride_cb, stride_cs, stride_ch,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, SOFT_CAP: tl.constexpr,
):  # fmt: skip
    """Online softmax of q ([BLOCK_M, HEAD_PAD]) over keys [kv_lo, kv_hi); returns the
    unnormalized output [BLOCK_M, HEAD_PAD], the running max and the running sum (log2 units)."""
    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_SIZE
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_hi
        # Unused block-table entries hold garbage: only read those of keys in range.
        block_id = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        # [BLOCK_N] int64: a cache can hold more than 2**31 elements.
        key_off = block_id.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs
        key_off += kv_head * stride_ch
        k_mask = d_valid[:, None] & n_valid[None, :]
        k = tl.load(key_cache_ptr + key_off[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
        # [BLOCK_M, BLOCK_N]; ieee keeps fp32 exact on tensor cores (no tf32), ignored otherwise.
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision="ieee") * qk_scale
        if SOFT_CAP:  # Gemma 2's cap * tanh(s / cap), in log2 units as s; tanh x = 2 sig(2x) - 1
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        visible &= q_pos[:, None] - offs_n[None, :] < sliding_window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps max -inf: shift by 0 so exp2 gives 0, not nan.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_mask = n_valid[:, None] & d_valid[None, :]
        v = tl.load(value_cache_ptr + key_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_reqs", "num_kv_splits", "sliding_window"])
def _paged_attention_kernel(
    out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale, soft_cap, sliding_window, num_reqs, num_heads, num_kv_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, WRITE_PARTIALS: tl.constexpr, SOFT_CAP: tl.constexpr,
):  # fmt: skip
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    q_first = (tile - q_begin // BLOCK_Q - req) * BLOCK_Q  # first query row of the tile
    if q_first >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + req) - query_len  # cached keys before the new tokens
    # Row m is query row q_first + m // GROUP, head kv_head * GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_first + offs_m // GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_idx < query_len)
    q_pos = tl.where(row_valid, context_len + q_idx, -1)  # -1 sees no key
    token = (q_begin + q_idx).to(tl.int64)
    head = kv_head * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, HEAD_PAD)
    mask = row_valid[:, None] & (offs_d < HEAD_SIZE)[None, :]
    q_ptrs = query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_PAD]
    # Keys the tile can see are [kv_lo, kv_hi); this program takes chunk `split` of them.
    kv_hi = context_len + tl.minimum(q_first + BLOCK_Q, query_len)
    kv_lo = tl.maximum(context_len + q_first - sliding_window + 1, 0)
    chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_kv_splits), BLOCK_N) * BLOCK_N
    split_lo = kv_lo + split * chunk
    split_hi = tl.minimum(split_lo + chunk, kv_hi)
    acc, m_i, l_i = _attend_range(
        q, q_pos, split_lo, split_hi, sliding_window, qk_scale, soft_cap, key_cache_ptr,
        value_cache_ptr, block_table_ptr + req.to(tl.int64) * stride_bt, kv_head, stride_cb,
        stride_cs, stride_ch, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, DOT_DTYPE,
        SOFT_CAP,
    )  # fmt: skip
    if WRITE_PARTIALS:  # partials are [num_tokens, num_heads, num_kv_splits(, HEAD_PAD)]
        row = (token * num_heads + head) * num_kv_splits + split
        tl.store(partial_max_ptr + row, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + row, l_i, mask=row_valid)
        tl.store(partial_acc_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=mask)
    else:
        out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(out_ptrs + offs_d[None, :], _normalize(acc, l_i, out_ptr), mask=mask)


@triton.jit
def _normalize(acc, l_sum, out_ptr):
    # A row whose sum is 0 saw no key (padding rows only): keep it 0 rather than nan.
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    return out.to(out_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["num_reqs", "num_kv_splits"])
def _merge_splits_kernel(
    out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, query_start_loc_ptr,
    num_reqs, num_heads, num_kv_splits, stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr,
):  # fmt: skip
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):  # padding rows: no partials, stay 0
        return
    offs_s = tl.arange(0, MAX_SPLITS)
    s_valid = offs_s < num_kv_splits
    row = (token * num_heads + head) * num_kv_splits + offs_s  # [MAX_SPLITS]
    m = tl.load(partial_max_ptr + row, mask=s_valid, other=float("-inf"))
    l_sum = tl.load(partial_sum_ptr + row, mask=s_valid, other=0.0)
    m_all = tl.max(m, 0)
    # Splits that saw no visible key have max -inf and weight 0.
    weight = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    offs_d = tl.arange(0, HEAD_PAD)
    acc_ptrs = partial_acc_ptr + row[:, None] * HEAD_PAD + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=s_valid[:, None], other=0.0)  # [MAX_SPLITS, HEAD_PAD]
    denom = tl.sum(l_sum * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    out_ptrs = out_ptr + token * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores each new token's K/V at its slot; slot -1 (padding) is skipped.

    A kernel rather than `index_copy_`: skipping -1 slots in torch needs a boolean gather whose
    size the host must read back (a sync every layer), while the kernel masks them on device, reads
    strided K/V (views of a fused qkv projection) without a copy and casts to the cache dtype.

    key, value: [num_tokens, num_kv_heads, head_size]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size] (written in place)
    slot_mapping: [num_tokens] int64
    """
    _check_caches(key_cache, value_cache)
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    if key.shape[1:] != (num_kv_heads, head_size) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [num_tokens, {num_kv_heads}, {head_size}] to match the cache, "
            f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=key_cache.shape[1],
    )  # fmt: skip


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: CommonAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of every new token over its request's cached keys (new tokens included), each
    score s capped to soft_cap * tanh(s / soft_cap) if given.

    query: [num_tokens, num_heads, head_size]; returns out of the same shape and dtype. Rows past
    `query_start_loc[-1]` (padding) come back as zeros. Softmax and accumulation run in fp32.
    """
    config = _choose_launch_config(query, key_cache, metadata)
    args = (scale, sliding_window, config, soft_cap)
    return _paged_attention(query, key_cache, value_cache, metadata, *args)


@dataclass(frozen=True)
class _LaunchConfig:
    block_m: int  # rows per program: block_m // group query tokens x group heads
    block_n: int  # keys per inner-loop step
    num_kv_splits: int  # programs sharing one tile's keys (> 1 adds the merge kernel)
    num_warps: int = 4


def _choose_launch_config(
    query: torch.Tensor, key_cache: torch.Tensor, metadata: CommonAttentionMetadata
) -> _LaunchConfig:
    """Tile sizes that compile without register spills on sm_90 (checked with ptxas, not timed)."""
    group = query.shape[1] // key_cache.shape[2]
    head_pad = max(16, triton.next_power_of_2(query.shape[2]))
    decode_only = metadata.max_query_len <= 1
    is_fp32 = query.dtype == torch.float32  # fp32 dots run on FMA units: smaller tiles
    # Decode tiles hold one token, so rows beyond the group are padding: keep them few.
    block_m = 16 if decode_only else 32 if is_fp32 and head_pad > 128 else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    block_n = 16 if is_fp32 else 64 if head_pad <= 64 else 32 if head_pad <= 128 else 16
    num_warps = 8 if not decode_only and (head_pad >= 128 or is_fp32) else 4
    num_kv_splits = 1
    if decode_only:
        num_programs = max(1, metadata.num_reqs * key_cache.shape[2])
        by_occupancy = triton.cdiv(2 * _num_sms(query.device), num_programs)
        by_length = triton.cdiv(metadata.max_seq_len, _MIN_KEYS_PER_SPLIT)
        num_kv_splits = max(1, min(_MAX_KV_SPLITS, by_occupancy, by_length))
    return _LaunchConfig(block_m, block_n, num_kv_splits, num_warps)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: CommonAttentionMetadata,
    scale: float,
    sliding_window: int | None,
    config: _LaunchConfig,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """`paged_attention` with the launch configuration chosen by the caller (tests force splits)."""
    _check_attention_inputs(query, key_cache, value_cache, sliding_window, config)
    query = _last_dim_contiguous(query)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    out = torch.zeros_like(query)
    if num_tokens == 0 or metadata.num_reqs == 0:
        return out
    splits = config.num_kv_splits
    partial_acc = partial_max = partial_sum = out  # placeholders: unused without splits
    if splits > 1:
        # Unnormalized outputs, maxima and sums of each split, merged by the second kernel.
        partial_acc = out.new_empty((num_tokens, num_heads, splits, head_pad), dtype=torch.float32)
        partial_max = out.new_empty((num_tokens, num_heads, splits), dtype=torch.float32)
        partial_sum = torch.empty_like(partial_max)
    block_table, query_start_loc = metadata.block_table, metadata.query_start_loc
    grid = (num_tokens // (config.block_m // group) + metadata.num_reqs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        out, partial_acc, partial_max, partial_sum, query, key_cache, value_cache,
        block_table, query_start_loc, metadata.seq_lens,
        # log2(e): the softmax runs on exp2, so the scores (and their cap) are in log2 units.
        scale * _LOG2_E, (soft_cap or 0.0) * _LOG2_E, sliding_window or _NO_WINDOW,
        metadata.num_reqs, num_heads, splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        GROUP=group, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, DOT_DTYPE=_dot_dtype(query),
        WRITE_PARTIALS=splits > 1, SOFT_CAP=soft_cap is not None, num_warps=config.num_warps,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_acc, partial_max, partial_sum, query_start_loc,
            metadata.num_reqs, num_heads, splits, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, MAX_SPLITS=_MAX_KV_SPLITS,
        )  # fmt: skip
    return out


def _dot_dtype(query: torch.Tensor) -> tl.dtype:
    # Off CUDA the kernels only run under the interpreter, whose tl.dot misreads bfloat16.
    if query.dtype == torch.bfloat16 and query.device.type != "cuda":
        return tl.float32
    return _TL_DTYPES[query.dtype]


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # Kernels take strides for every dim but the last, so views of a fused qkv projection pass.
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_size], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    # The kernels address both caches with one set of strides and a unit head_size stride.
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError(
            "key_cache and value_cache must share strides with a contiguous last dim, got "
            f"{key_cache.stride()} and {value_cache.stride()}"
        )


def _check_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sliding_window: int | None,
    config: _LaunchConfig,
) -> None:
    _check_caches(key_cache, value_cache)
    if query.dtype not in _TL_DTYPES:
        raise ValueError(f"query dtype must be one of {list(_TL_DTYPES)}, got {query.dtype}")
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if head_size != key_cache.shape[3] or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query [num_tokens, num_heads, head_size] = {tuple(query.shape)} does not fit the "
            f"cache {tuple(key_cache.shape)}: head_size must match and num_heads must be a "
            "multiple of num_kv_heads"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    assert 1 <= config.num_kv_splits <= _MAX_KV_SPLITS, config
