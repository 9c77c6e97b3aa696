"""The batch description every attention backend reads, built once per step by the model runner.

A step's tokens are flattened: request r owns query rows
`query_start_loc[r] : query_start_loc[r + 1]`, which are its *last* `query_len_r` tokens, so a
query row i of request r sits at position `seq_lens[r] - query_len_r + i`. Prefill (with or
without a cached prefix), chunked prefill and decode (query_len 1) mix freely in one batch.

Paged KV: a slot is `block_id * block_size + offset_in_block`. `block_table[r, j]` is the block
holding positions `j * block_size ... (j + 1) * block_size - 1` of request r. Key position k is
visible to a query at position p iff `k <= p` and, with a sliding window W, `p - k < W`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: where each new token's K/V is written; -1 marks padding (skip).
    slot_mapping: torch.Tensor
    # [num_reqs + 1] int32: prefix sums of the query lengths.
    query_start_loc: torch.Tensor
    # [num_reqs] int32: tokens in the KV cache after this step (cached prefix + new tokens).
    seq_lens: torch.Tensor
    # [num_reqs, max_num_blocks_per_req] int32: block ids; unused entries may hold anything.
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # What a backend derives from this metadata alone, built by the first layer and reused by
    # the rest of the step (e.g. the torch backend's gather plan). Not copied by `replace`.
    backend_cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
