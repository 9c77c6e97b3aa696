"""Test helpers: a step's `CommonAttentionMetadata` built by the worker's own input code, the
torch backend over it, and a dense reference for paged attention.

`BlockAllocator` hands out shuffled block ids per request so tests catch any backend that assumes
a request's blocks are contiguous; `build_metadata` turns (request, num_computed, num_new) triples
into the flattened-batch description the attention backends read.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.model.layers.attention import Attention
from v1engine.model.layers.attention_backend import CommonAttentionMetadata
from v1engine.model.layers.torch_attention import TorchAttentionBackend
from v1engine.worker.model_inputs import build_common_attn_metadata, step_layout
from v1engine.worker.request_states import BlockTable

# Written into every block table entry a request does not use: backends must never read it.
GARBAGE_BLOCK_ID = 10**6


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
    device: str | torch.device = "cpu",
) -> CommonAttentionMetadata:
    """steps: (req_id, num_computed_tokens, num_new_tokens) per request, in batch order; padding
    tokens (slot -1) follow the last request's."""
    num_computed = np.array([c for _, c, _ in steps], dtype=np.int64)
    query_lens = np.array([n for _, _, n in steps], dtype=np.int64)
    layout = step_layout(num_computed, query_lens)
    table = BlockTable(len(steps), int(layout.seq_lens.max()), allocator.block_size)
    table.table[:] = GARBAGE_BLOCK_ID
    for row, (req_id, _, _) in enumerate(steps):
        table.set_row(row, allocator.ensure(req_id, int(layout.seq_lens[row])))
    query_start_loc = torch.from_numpy(layout.query_start_loc).to(device, torch.int32)
    [common] = build_common_attn_metadata([table], layout, query_start_loc, torch.device(device))
    if not num_padding_tokens:
        return common
    padding = torch.full((num_padding_tokens,), -1, dtype=torch.int64, device=device)
    return dataclasses.replace(common, slot_mapping=torch.cat([common.slot_mapping, padding]))


def attention_spec(key_cache: torch.Tensor, sliding_window: int | None = None) -> AttentionSpec:
    """The spec of a layer with a [num_blocks, block_size, num_kv_heads, head_size] cache."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    layer = Attention(num_kv_heads, head_size, 1.0, num_kv_heads, "spec", sliding_window)
    return layer.get_kv_cache_spec(block_size, key_cache.dtype)


def torch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    common: CommonAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """The torch backend's attention of one layer over a step described by `common`."""
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(common, attention_spec(key_cache, sliding_window))
    kv_cache = (key_cache, value_cache)
    return backend.forward(query, kv_cache, metadata, scale, sliding_window, soft_cap)


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Naive reference for one request whose query rows are its last tokens; with `soft_cap`
    each score s is cap * tanh(s / cap) (Gemma 2).

    query: [query_len, num_heads, head_size]; key, value: [seq_len, num_kv_heads, head_size].
    """
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    key = key.repeat_interleave(group, dim=1).float()
    value = value.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)
