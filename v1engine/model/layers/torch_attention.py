"""Paged attention in plain torch: the CPU backend, and the reference for the Triton kernels.

`TorchAttentionBackend.build_metadata` plans, once per step and KV cache group, what each request
gathers and masks (the plan, below). Requests with one new token (decode) are attended in small
groups of similar length, one SDPA call each; every other request (prefill, chunked prefill,
prefill over a cached prefix) gets one SDPA call over its own gathered blocks with a causal +
sliding-window mask, where GQA never repeats K/V: the query heads that share a KV head become
query rows. A fresh prompt without a window uses SDPA's causal mask instead (several times faster
on CPU), at the cost of repeating K/V. Blocks wholly outside a request's window are never read,
so a sliding-window KV manager may free them. SDPA gets 4-D inputs (a batch of one): on CPU 3-D
ones take a path 1.5-2.8x slower. `causal_attention` is the no-cache path (profiling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from v1engine.kv_cache_interface import AttentionSpec, SlidingWindowSpec
from v1engine.model.layers.attention_backend import CommonAttentionMetadata, KVCache
from v1engine.utils import cdiv


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
    ) -> torch.Tensor:
        # The plan was built for the group's spec, which the worker derived from its layers.
        assert sliding_window == metadata.plan.sliding_window, (sliding_window, metadata.plan)
        return paged_attention(query, *kv_cache, metadata.plan, scale)


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
) -> torch.Tensor:
    """Attention of every new token over its request's cached keys (new tokens included), with
    the window the plan was built for.

    query: [num_tokens, num_heads, head_size]; returns out of the same shape. Rows past
    `query_start_loc[-1]` (padding) come back as zeros.
    """
    if plan.decode_rows_are_all_rows(query.shape[0]):
        # Only decodes, in one group, in row order (batch 1, small batches): no scatter.
        return _decode_group(query, key_cache, value_cache, plan.decode_groups[0], scale)
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
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
    return o[0].transpose(0, 1)


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
    # [1, num_kv_heads, group * query_len, head_size]: query heads sharing a KV head become rows.
    q = query.view(query_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    q = q.reshape(1, num_kv_heads, group * query_len, head_size)
    k = key.transpose(0, 1).to(q.dtype)[None]  # [1, num_kv_heads, num_keys, head_size]
    v = value.transpose(0, 1).to(q.dtype)[None]
    o = F.scaled_dot_product_attention(q, k, v, mask.repeat(group, 1), scale=scale)
    # [1, num_kv_heads, group * query_len, head_size] -> [query_len, num_heads, head_size]
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
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    # [n, num_kv_heads, num_blocks * block_size, head_size]
    gathered_shape = (n, group.num_blocks * block_size, num_kv_heads, head_size)
    key = key_cache.index_select(0, group.blocks).view(gathered_shape).transpose(1, 2)
    value = value_cache.index_select(0, group.blocks).view(gathered_shape).transpose(1, 2)
    q = query if group.rows_in_order and n == num_tokens else query.index_select(0, group.rows)
    q = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_size)
    o = F.scaled_dot_product_attention(
        q, key.to(q.dtype), value.to(q.dtype), group.mask, scale=scale
    )
    return o.reshape(n, num_heads, head_size)


# -- the per-step plan -----------------------------------------------------------------------------
# The torch backend's per-step plan: which blocks each request reads and which keys it sees.
#
# Every layer of a KV cache group attends with the same metadata, so everything derived from it
# alone (block ids to gather, visibility masks, the grouping of decodes) is built once per step and
# group, in `TorchAttentionBackend.build_metadata`; the layers only gather and multiply.
#
# Decodes (one new token) are sorted by length and attended in small groups. Each group gathers its
# requests' blocks padded to its longest one, so sorting keeps the padding small, and a small
# group's gathered K/V (up to `DECODE_GROUP_SIZE` requests) is still in cache when SDPA reads it:
# on the 2-core benchmark machine, groups of 8 ran decode attention about 2.5x faster than one
# padded batch of 64.
DECODE_GROUP_SIZE = 8
# Upper bound on gathered K elements per decode group, so long sequences shrink the group.
MAX_GATHER_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class PrefillPlan:
    """One request with several query rows (prefill, chunked prefill, prefill over a prefix)."""

    start: int  # its query rows are start:end
    end: int
    blocks: torch.Tensor  # [num_blocks] int64, the blocks holding its visible keys, in order
    num_keys: int  # keys in those blocks that exist (the last block may be partly filled)
    # [query_len, num_keys] bool; None for a fresh prompt without a window (SDPA's causal mask).
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token requests attended in one SDPA call."""

    rows: torch.Tensor  # [n] int64 query rows
    blocks: torch.Tensor  # [n * num_blocks] int64, row-major; unused entries point at block 0
    mask: torch.Tensor  # [n, 1, 1, num_blocks * block_size] bool
    num_blocks: int
    rows_in_order: bool  # rows == 0, 1, ..., n - 1


@dataclass(frozen=True)
class StepPlan:
    prefills: list[PrefillPlan]
    decode_groups: list[DecodeGroup]
    sliding_window: int | None  # the window its masks and skipped blocks were built for

    def decode_rows_are_all_rows(self, num_tokens: int) -> bool:
        """One decode group and no prefill, whose rows are 0 .. num_tokens - 1 in order."""
        groups = self.decode_groups
        if self.prefills or len(groups) != 1:
            return False
        return groups[0].rows_in_order and groups[0].rows.shape[0] == num_tokens


def build_step_plan(metadata: CommonAttentionMetadata, kv_cache_spec: AttentionSpec) -> StepPlan:
    """The plan of one step for the layers of one KV cache group (block size, window)."""
    block_size = kv_cache_spec.block_size
    sliding_window = None
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        sliding_window = kv_cache_spec.sliding_window
    query_start_loc = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    prefills, decodes = [], []
    for r in range(metadata.num_reqs):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if end - start == 1:
            decodes.append(r)
        elif end > start:
            prefills.append(
                _prefill_plan(metadata, r, start, end, seq_lens[r], block_size, sliding_window)
            )
    # Longest first: each group's padding is bounded by its own longest request.
    decodes.sort(key=lambda r: seq_lens[r], reverse=True)
    groups = [
        _plan_decode_group(metadata, members, query_start_loc, block_size, sliding_window)
        for members in _split_decodes(decodes, seq_lens, kv_cache_spec)
    ]
    return StepPlan(prefills, groups, sliding_window)


def _split_decodes(
    decodes: list[int], seq_lens: list[int], kv_cache_spec: AttentionSpec
) -> list[list[int]]:
    """Runs of the (sorted) decodes: up to DECODE_GROUP_SIZE each, fewer when the run's longest
    request would gather more than MAX_GATHER_ELEMENTS K elements."""
    block_size = kv_cache_spec.block_size
    per_token = kv_cache_spec.num_kv_heads * kv_cache_spec.head_size
    runs: list[list[int]] = []
    i = 0
    while i < len(decodes):
        longest_blocks = cdiv(seq_lens[decodes[i]], block_size)
        fit = max(1, MAX_GATHER_ELEMENTS // (longest_blocks * block_size * per_token))
        runs.append(decodes[i : i + min(DECODE_GROUP_SIZE, fit)])
        i += len(runs[-1])
    return runs


def _prefill_plan(
    metadata: CommonAttentionMetadata,
    r: int,
    start: int,
    end: int,
    seq_len: int,
    block_size: int,
    sliding_window: int | None,
) -> PrefillPlan:
    first_pos = seq_len - (end - start)
    # Keys older than the first query's window are invisible to every row: skip their blocks.
    first_key = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
    first_block = first_key // block_size
    last_block = cdiv(seq_len, block_size)
    blocks = metadata.block_table[r, first_block:last_block].long()
    key_offset = first_block * block_size
    fresh = first_pos == 0 and sliding_window is None  # SDPA's own causal mask serves it
    mask = None if fresh else visible(first_pos, seq_len, key_offset, sliding_window, blocks.device)
    return PrefillPlan(start, end, blocks, seq_len - key_offset, mask)


def _plan_decode_group(
    metadata: CommonAttentionMetadata,
    members: list[int],
    query_start_loc: list[int],
    block_size: int,
    sliding_window: int | None,
) -> DecodeGroup:
    device = metadata.block_table.device
    member_index = torch.tensor(members, device=device)
    seq_lens = metadata.seq_lens[member_index].long()
    num_blocks = cdiv(int(seq_lens.max()), block_size)
    # Entries past a request's last block, or wholly before its window, may hold anything (a
    # sliding-window manager may have freed them): point them at block 0, whose keys are masked.
    block_start = torch.arange(num_blocks, device=device)[None, :] * block_size
    used = block_start < seq_lens[:, None]
    if sliding_window is not None:
        used &= block_start + block_size > seq_lens[:, None] - sliding_window
    table = metadata.block_table[member_index, :num_blocks].long()
    blocks = torch.where(used, table, 0).flatten()

    k_pos = torch.arange(num_blocks * block_size, device=device)[None, :]
    q_pos = (seq_lens - 1)[:, None]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    row_list = [query_start_loc[r] for r in members]
    rows = torch.tensor(row_list, device=device)
    in_order = row_list == list(range(len(row_list)))
    return DecodeGroup(rows, blocks, mask[:, None, None, :], num_blocks, in_order)


def visible(
    first_pos: int, seq_len: int, key_offset: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[num_queries, num_keys] bool: queries at first_pos.., keys at key_offset.., below seq_len."""
    q_pos = torch.arange(first_pos, seq_len, device=device)[:, None]
    k_pos = torch.arange(key_offset, seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask
