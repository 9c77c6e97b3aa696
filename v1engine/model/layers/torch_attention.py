"""Paged attention in plain torch: the CPU backend, and the reference for the Triton kernels.

`TorchAttentionBackend.build_metadata` plans, once per step and KV cache group, what each request
gathers and masks (`torch_attention_plan.py`). Requests with one new token (decode) are attended
in small groups of similar length, one SDPA call each; every other request (prefill, chunked
prefill, prefill over a cached prefix) gets one SDPA call over its own gathered blocks with a
causal + sliding-window mask. There GQA never materializes repeated K/V: the query heads that
share a KV head are folded into the query-row dimension. A fresh prompt without a window instead
uses SDPA's built-in causal mask (several times faster on CPU), at the cost of repeating K/V.
Blocks wholly outside a request's window are never read, so a sliding-window KV manager may free
them. `causal_attention` is the no-cache path used before caches exist (profiling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.model.layers.attention_backend import CommonAttentionMetadata, KVCache
from v1engine.model.layers.torch_attention_plan import (
    DecodeGroup,
    PrefillPlan,
    StepPlan,
    build_step_plan,
    visible,
)


@dataclass(frozen=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    plan: StepPlan


class TorchAttentionBackend:
    """The `AttentionBackend` for any device torch runs on; its metadata carries the step plan."""

    name = "torch"

    def build_metadata(
        self, common: CommonAttentionMetadata, kv_cache_spec: AttentionSpec
    ) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(common.slot_mapping, build_step_plan(common, kv_cache_spec))

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: TorchAttentionMetadata,
    ) -> None:
        write_kv_cache(key, value, *kv_cache, metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: TorchAttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        # The plan was built for the group's spec, which the worker derived from its layers.
        assert sliding_window == metadata.plan.sliding_window, (sliding_window, metadata.plan)
        return paged_attention(query, *kv_cache, metadata.plan, scale)


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
    plan: StepPlan,
    scale: float,
) -> torch.Tensor:
    """Attention of every new token over its request's cached keys (new tokens included), with
    the window the plan was built for.

    query: [num_tokens, num_heads, head_size]; returns out of the same shape. Rows past
    `query_start_loc[-1]` (padding) come back as zeros.
    """
    out = torch.zeros_like(query)
    for prefill in plan.prefills:
        out[prefill.start : prefill.end] = _prefill_attention(
            query[prefill.start : prefill.end], key_cache, value_cache, prefill, scale
        )
    for group in plan.decode_groups:
        out.index_copy_(0, group.rows, _decode_group(query, key_cache, value_cache, group, scale))
    return out


def _prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    prefill: PrefillPlan,
    scale: float,
) -> torch.Tensor:
    """One request's query rows ([query_len, num_heads, head_size]) over its cached keys."""
    # [num_keys, num_kv_heads, head_size]; index_select is far faster than fancy indexing on CPU.
    key = key_cache.index_select(0, prefill.blocks).flatten(0, 1)[: prefill.num_keys]
    value = value_cache.index_select(0, prefill.blocks).flatten(0, 1)[: prefill.num_keys]
    if prefill.mask is None:
        return _causal_sdpa(query, key, value, scale)
    return _sdpa_gqa(query, key, value, prefill.mask, scale)


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
                q, k, v, visible(0, end - start, 0, sliding_window, query.device), scale
            )
    return out


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


def _decode_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:
    """The group's query rows ([n, num_heads, head_size]) over their gathered blocks."""
    n = group.rows.shape[0]
    _, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    # [n, num_kv_heads, num_blocks * block_size, head_size]
    gathered_shape = (n, group.num_blocks * block_size, num_kv_heads, head_size)
    key = key_cache.index_select(0, group.blocks).view(gathered_shape).transpose(1, 2)
    value = value_cache.index_select(0, group.blocks).view(gathered_shape).transpose(1, 2)
    q = query.index_select(0, group.rows).view(n, num_kv_heads, num_heads // num_kv_heads, -1)
    o = F.scaled_dot_product_attention(
        q, key.to(q.dtype), value.to(q.dtype), group.mask, scale=scale
    )
    return o.reshape(n, num_heads, head_size)
