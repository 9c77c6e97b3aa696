"""Test helpers: hand-built `AttentionMetadata` and a dense reference for paged attention.

`BlockAllocator` hands out shuffled block ids per request so tests catch any backend that assumes
a request's blocks are contiguous; `build_metadata` turns (request, num_computed, num_new) triples
into the flattened-batch description the attention backends read.
"""

from __future__ import annotations

import torch

from v1engine.model.layers.attention_metadata import AttentionMetadata


class BlockAllocator:
    """Per-request block tables over a shuffled pool of `num_blocks` blocks."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=generator).tolist()
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}

    def ensure(self, req_id: int, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(req_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table


def build_metadata(
    allocator: BlockAllocator,
    steps: list[tuple[int, int, int]],
    num_padding_tokens: int = 0,
) -> AttentionMetadata:
    """steps: (req_id, num_computed_tokens, num_new_tokens) per request, in batch order."""
    block_size = allocator.block_size
    slots, query_start_loc, seq_lens, tables = [], [0], [], []
    for req_id, num_computed, num_new in steps:
        seq_len = num_computed + num_new
        table = allocator.ensure(req_id, seq_len)
        for pos in range(num_computed, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + num_new)
        seq_lens.append(seq_len)
        tables.append(table)
    slots += [-1] * num_padding_tokens
    width = max(len(t) for t in tables)
    # Unused entries hold garbage on purpose: backends must not read them.
    block_table = torch.full((len(tables), width), 10**6, dtype=torch.int32)
    for r, table in enumerate(tables):
        block_table[r, : len(table)] = torch.tensor(table, dtype=torch.int32)
    query_lens = [n for _, _, n in steps]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Naive reference for one request whose query rows are its last tokens.

    query: [query_len, num_heads, head_size]; key, value: [seq_len, num_kv_heads, head_size].
    """
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    key = key.repeat_interleave(group, dim=1).float()
    value = value.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)
