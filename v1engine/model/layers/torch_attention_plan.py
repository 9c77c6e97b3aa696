"""The torch attention backend's per-step plan: which blocks each request reads and which keys
it sees (`torch_attention.py` attends with it).

Every layer of a KV cache group attends with the same metadata, so everything derived from it
alone (block ids to gather, visibility masks, the grouping of decodes) is built once per step and
group, in `TorchAttentionBackend.build_metadata`; the layers only gather and multiply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1engine.kv_cache_interface import AttentionSpec, SlidingWindowSpec
from v1engine.model.layers.attention_backend import CommonAttentionMetadata
from v1engine.utils import cdiv

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
