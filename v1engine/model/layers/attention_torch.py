"""Paged attention in plain torch: the CPU path, and the reference the Triton kernels must match.

Both functions follow the contract in `attention_metadata.py`. Requests with one new token
(decode) are batched into a single SDPA call; every other request (prefill, chunked prefill,
prefill over a cached prefix) gets one SDPA call over its own gathered blocks with a
causal + sliding-window mask. There GQA never materializes repeated K/V: the query heads that
share a KV head are folded into the query-row dimension. A fresh prompt without a window instead
uses SDPA's built-in causal mask (several times faster on CPU), at the cost of repeating K/V.
Blocks wholly outside a request's window are never read, so a sliding-window KV manager may free
them. `causal_attention` is the no-cache path used before caches exist (profiling).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v1engine.model.layers.attention_metadata import AttentionMetadata

# Upper bound on gathered K elements per batched-decode SDPA call, so a large decode batch over
# long sequences gathers its blocks in pieces instead of all at once.
_MAX_GATHER_ELEMENTS = 1 << 24


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores each new token's K/V at its slot; slot -1 (padding) is skipped.

    key, value: [num_tokens, num_kv_heads, head_size]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size] (written in place)
    slot_mapping: [num_tokens] int64
    """
    num_tokens = slot_mapping.shape[0]
    valid = slot_mapping[:num_tokens] >= 0
    slots = slot_mapping[valid]
    # view (not reshape) so a non-contiguous cache fails loudly instead of writing to a copy.
    flat_key_cache = key_cache.view(-1, key_cache.shape[-2], key_cache.shape[-1])
    flat_value_cache = value_cache.view(-1, value_cache.shape[-2], value_cache.shape[-1])
    flat_key_cache.index_copy_(0, slots, key[:num_tokens][valid].to(key_cache.dtype))
    flat_value_cache.index_copy_(0, slots, value[:num_tokens][valid].to(value_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of every new token over its request's cached keys (new tokens included).

    query: [num_tokens, num_heads, head_size]; returns out of the same shape. Rows past
    `query_start_loc[-1]` (padding) come back as zeros.
    """
    out = torch.zeros_like(query)
    query_start_loc = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    decode_reqs = []
    for r in range(metadata.num_reqs):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if end - start == 1:
            decode_reqs.append(r)
        elif end > start:
            out[start:end] = _prefill_attention(
                query[start:end],
                key_cache,
                value_cache,
                metadata.block_table[r],
                seq_lens[r],
                scale,
                sliding_window,
            )
    if decode_reqs:
        _decode_attention(
            out, query, key_cache, value_cache, metadata, decode_reqs, scale, sliding_window
        )
    return out


def _prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One request's query rows ([query_len, num_heads, head_size]) over its cached keys."""
    query_len = query.shape[0]
    block_size = key_cache.shape[1]
    first_pos = seq_len - query_len
    # Keys older than the first query's window are invisible to every row: skip their blocks.
    first_key = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
    first_block = first_key // block_size
    last_block = (seq_len + block_size - 1) // block_size
    blocks = block_table[first_block:last_block].long()
    key_offset = first_block * block_size
    num_keys = seq_len - key_offset
    # [num_keys, num_kv_heads, head_size]; index_select is far faster than fancy indexing on CPU.
    key = key_cache.index_select(0, blocks).flatten(0, 1)[:num_keys]
    value = value_cache.index_select(0, blocks).flatten(0, 1)[:num_keys]
    if first_pos == 0 and sliding_window is None:
        return _causal_sdpa(query, key, value, scale)

    mask = _visible(first_pos, seq_len, key_offset, sliding_window, query.device)
    return _sdpa_gqa(query, key, value, mask, scale)


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention over the new tokens only, no KV cache (profiling, or a model run without one).

    query: [num_tokens, num_heads, head_size]; key, value: [num_tokens, num_kv_heads, head_size].
    Each request in `query_start_loc` (one request if None) is a fresh sequence.
    """
    out = torch.zeros_like(query)
    bounds = [0, query.shape[0]] if query_start_loc is None else query_start_loc.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q, k, v = query[start:end], key[start:end], value[start:end]
        if sliding_window is None:
            out[start:end] = _causal_sdpa(q, k, v, scale)
        else:
            out[start:end] = _sdpa_gqa(
                q, k, v, _visible(0, end - start, 0, sliding_window, query.device), scale
            )
    return out


def _visible(
    first_pos: int, seq_len: int, key_offset: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[num_queries, num_keys] bool; queries sit at first_pos.., keys at key_offset.., both up to
    seq_len - 1."""
    q_pos = torch.arange(first_pos, seq_len, device=device)[:, None]
    k_pos = torch.arange(key_offset, seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


def _causal_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """A fresh sequence (queries are all its keys): SDPA's built-in causal mask is much faster
    than an explicit one. query [seq_len, num_heads, head_size], key/value [seq_len, kv, hd]."""
    group = query.shape[1] // key.shape[1]
    q = query.transpose(0, 1)  # [num_heads, seq_len, head_size]
    # Repeated K/V rather than `enable_gqa`, which needs torch >= 2.5.
    k = key.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
    v = value.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return o.transpose(0, 1)


def _sdpa_gqa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [q_len, num_heads, head_size], key/value [num_keys, num_kv_heads, head_size]."""
    query_len, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    # [num_kv_heads, group * query_len, head_size]: query heads sharing a KV head become rows.
    q = query.view(query_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * query_len, head_size)
    k = key.transpose(0, 1).to(q.dtype)  # [num_kv_heads, num_keys, head_size]
    v = value.transpose(0, 1).to(q.dtype)
    o = F.scaled_dot_product_attention(q, k, v, mask.repeat(group, 1), scale=scale)
    # [num_kv_heads, group, query_len, head_size] -> [query_len, num_heads, head_size]
    o = o.view(num_kv_heads, group, query_len, head_size).permute(2, 0, 1, 3)
    return o.reshape(query_len, num_heads, head_size)


def _decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    reqs: list[int],
    scale: float,
    sliding_window: int | None,
) -> None:
    """Single-token requests in batches sized by `_MAX_GATHER_ELEMENTS`; writes into `out`."""
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    device = query.device
    req_index = torch.tensor(reqs, device=device)
    rows = metadata.query_start_loc.to(device)[req_index].long()
    seq_lens = metadata.seq_lens.to(device)[req_index].long()
    max_seq_len = int(seq_lens.max())
    per_req = ((max_seq_len + block_size - 1) // block_size) * block_size * num_kv_heads * head_size
    batch = max(1, _MAX_GATHER_ELEMENTS // per_req)
    for i in range(0, len(reqs), batch):
        sl = slice(i, i + batch)
        out[rows[sl]] = _decode_batch(
            query[rows[sl]],
            key_cache,
            value_cache,
            metadata.block_table[req_index[sl]],
            seq_lens[sl],
            scale,
            sliding_window,
        )


def _decode_batch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """query: [batch, num_heads, head_size], one row per request; returns the same shape."""
    batch, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = (int(seq_lens.max()) + block_size - 1) // block_size
    # Entries past a request's last block, or wholly before its window, may hold anything (a
    # sliding-window manager may have freed them): point them at block 0, whose keys are masked.
    block_start = torch.arange(num_blocks, device=query.device)[None, :] * block_size
    used = block_start < seq_lens[:, None]
    if sliding_window is not None:
        used &= block_start + block_size > seq_lens[:, None] - sliding_window
    blocks = torch.where(used, block_table[:, :num_blocks].long(), 0)
    # [batch, num_kv_heads, num_blocks * block_size, head_size]
    gathered_shape = (batch, num_blocks * block_size, num_kv_heads, -1)
    key = key_cache.index_select(0, blocks.flatten()).view(gathered_shape).transpose(1, 2)
    value = value_cache.index_select(0, blocks.flatten()).view(gathered_shape).transpose(1, 2)
    key, value = key.to(query.dtype), value.to(query.dtype)

    k_pos = torch.arange(num_blocks * block_size, device=query.device)[None, :]
    q_pos = (seq_lens - 1)[:, None]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    mask = mask[:, None, None, :]  # [batch, 1, 1, num_keys]

    group = num_heads // num_kv_heads
    q = query.view(batch, num_kv_heads, group, head_size)
    o = F.scaled_dot_product_attention(q, key, value, mask, scale=scale)
    return o.reshape(batch, num_heads, head_size)
