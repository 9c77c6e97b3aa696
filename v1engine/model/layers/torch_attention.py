"""Paged attention in plain torch: the CPU backend, and the reference for the Triton kernels.

`TorchAttentionBackend.build_metadata` plans, once per step and KV cache group, what each request
gathers and masks (the plan, below). Requests with one new token (decode) are attended in small
groups of similar length, one SDPA call each; every other request (prefill, chunked prefill,
prefill over a cached prefix) gets one SDPA call over its own gathered blocks with a causal +
sliding-window mask, where GQA never repeats K/V: the query heads that share a KV head become
query rows. A fresh prompt without a window uses SDPA's causal mask instead (several times faster
on CPU), at the cost of repeating K/V. Blocks wholly outside a request's window are never read,
so a sliding-window KV manager may free them. SDPA gets 4-D inputs (a batch of one): on CPU 3-D
ones take a path 1.5-2.8x slower. `causal_attention` is the no-cache path (profiling).

Layers with logit soft-capping (Gemma 2: each score s becomes cap * tanh(s / cap) before the
softmax) attend through `_attend`'s eager product instead of SDPA, which has no such option."""

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
    # Where the step's K/V go, resolved once per step rather than in every layer:
    slots: torch.Tensor  # [num_written] int64, the slots of the tokens that are written
    written_rows: torch.Tensor | None  # [num_written] their rows; None: rows 0.. in order
    plan: StepPlan


class TorchAttentionBackend:
    """The `AttentionBackend` for any device torch runs on; its metadata carries the step plan."""

    name = "torch"
    supports_cuda_graphs = False  # plans its gathers from host copies of the metadata

    def build_metadata(
        self, common: CommonAttentionMetadata, kv_cache_spec: AttentionSpec
    ) -> TorchAttentionMetadata:
        plan = build_step_plan(common, kv_cache_spec)
        return TorchAttentionMetadata(*written_slots(common.slot_mapping), plan)

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: TorchAttentionMetadata,
    ) -> None:
        _store_kv(key, value, *kv_cache, metadata.slots, metadata.written_rows)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: TorchAttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        # The plan was built for the group's spec, which the worker derived from its layers.
        assert sliding_window == metadata.plan.sliding_window, (sliding_window, metadata.plan)
        return paged_attention(query, *kv_cache, metadata.plan, scale, logits_soft_cap)


def written_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slots, rows) of the tokens whose slot is not -1 (padding); rows None when all are."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return slot_mapping, None
    rows = valid.nonzero().flatten()
    return slot_mapping.index_select(0, rows), rows


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
    _store_kv(key, value, key_cache, value_cache, *written_slots(slot_mapping))


def _store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor | None,
) -> None:
    if rows is None:
        key, value = key[: slots.shape[0]], value[: slots.shape[0]]
    else:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    # view (not reshape) so a non-contiguous cache fails loudly instead of writing to a copy.
    flat_key_cache = key_cache.view(-1, key_cache.shape[-2], key_cache.shape[-1])
    flat_value_cache = value_cache.view(-1, value_cache.shape[-2], value_cache.shape[-1])
    flat_key_cache.index_copy_(0, slots, key.to(key_cache.dtype))
    flat_value_cache.index_copy_(0, slots, value.to(value_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: StepPlan,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of every new token over its request's cached keys (new tokens included), with
    the window the plan was built for and the layer's logit soft-cap (None: none).

    query: [num_tokens, num_heads, head_size]; returns out of the same shape. Rows past
    `query_start_loc[-1]` (padding) come back as zeros.
    """
    if plan.decode_rows_are_all_rows(query.shape[0]):
        # Only decodes, in one group, in row order (batch 1, small batches): no scatter.
        group = plan.decode_groups[0]
        return _decode_group(query, key_cache, value_cache, group, scale, soft_cap)
    out = torch.zeros_like(query)
    for prefill in plan.prefills:
        rows = slice(prefill.start, prefill.end)
        out[rows] = _prefill_attention(
            query[rows], key_cache, value_cache, prefill, scale, soft_cap
        )
    for group in plan.decode_groups:
        group_out = _decode_group(query, key_cache, value_cache, group, scale, soft_cap)
        out.index_copy_(0, group.rows, group_out)
    return out


def _prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    prefill: PrefillPlan,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """One request's query rows ([query_len, num_heads, head_size]) over its cached keys."""
    # [num_keys, num_kv_heads, head_size]; index_select is far faster than fancy indexing on CPU.
    key = key_cache.index_select(0, prefill.blocks).flatten(0, 1)[: prefill.num_keys]
    value = value_cache.index_select(0, prefill.blocks).flatten(0, 1)[: prefill.num_keys]
    if prefill.mask is None:
        return _causal_sdpa(query, key, value, scale, soft_cap)
    return _sdpa_gqa(query, key, value, prefill.mask, scale, soft_cap)


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
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
            out[start:end] = _causal_sdpa(q, k, v, scale, soft_cap)
        else:
            mask = visible(0, end - start, 0, sliding_window, query.device)
            out[start:end] = _sdpa_gqa(q, k, v, mask, scale, soft_cap)
    return out


def _causal_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """A fresh sequence (queries are all its keys): SDPA's built-in causal mask is much faster
    than an explicit one. query [seq_len, num_heads, head_size], key/value [seq_len, kv, hd]."""
    group = query.shape[1] // key.shape[1]
    q = query.transpose(0, 1)  # [num_heads, seq_len, head_size]
    # Repeated K/V rather than `enable_gqa`, which needs torch >= 2.5.
    k = key.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
    v = value.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
    o = _attend(q[None], k[None], v[None], None, scale, soft_cap)
    return o[0].transpose(0, 1)


def _sdpa_gqa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """query [q_len, num_heads, head_size], key/value [num_keys, num_kv_heads, head_size]."""
    query_len, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    # [1, num_kv_heads, group * query_len, head_size]: query heads sharing a KV head become rows.
    q = query.view(query_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    q = q.reshape(1, num_kv_heads, group * query_len, head_size)
    k = key.transpose(0, 1).to(q.dtype)[None]  # [1, num_kv_heads, num_keys, head_size]
    v = value.transpose(0, 1).to(q.dtype)[None]
    o = _attend(q, k, v, mask.repeat(group, 1), scale, soft_cap)
    # [1, num_kv_heads, group * query_len, head_size] -> [query_len, num_heads, head_size]
    o = o.view(num_kv_heads, group, query_len, head_size).permute(2, 0, 1, 3)
    return o.reshape(query_len, num_heads, head_size)


def _decode_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """The group's query rows ([n, num_heads, head_size]) over their gathered blocks."""
    n = group.rows.shape[0]
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    # [n, num_kv_heads, num_blocks * block_size, head_size]
    gathered_shape = (n, group.num_blocks * block_size, num_kv_heads, head_size)
    key = key_cache.index_select(0, group.blocks).view(gathered_shape).transpose(1, 2)
    value = value_cache.index_select(0, group.blocks).view(gathered_shape).transpose(1, 2)
    q = query if group.rows_in_order and n == num_tokens else query.index_select(0, group.rows)
    q = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_size)
    o = _attend(q, key.to(q.dtype), value.to(q.dtype), group.mask, scale, soft_cap)
    return o.reshape(n, num_heads, head_size)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """softmax(q k^T scale [soft-capped], masked) v over the last two dims; mask None: causal.

    Soft-capped scores are computed eagerly, as HF's eager attention does for Gemma 2: capped and
    normalized in float32, so a bfloat16 model loses no more than its product's rounding."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            query, key, value, mask, is_causal=mask is None, scale=scale
        )
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)
