"""The persistent input batch: what the workers remember about requests between steps.

`CachedRequestState` holds one request's tokens, sampling parameters, seeded generator and block
ids; it lives from the step a request arrives until it appears in `finished_req_ids`, preemption
included. `InputBatch` holds the requests scheduled in the current step as dense rows
`0 .. num_reqs - 1` of preallocated numpy arrays, so each step's flat inputs are built with a few
vectorized gathers (see `model_inputs.py`) instead of Python loops over tokens:

    token_ids            [max_num_reqs, max_model_len + 1] int32  prompt + output tokens per row
    num_tokens           [max_num_reqs] int32                  valid length of each token row
    num_computed_tokens  [max_num_reqs] int32                  tokens already in the KV cache
    block_tables[g]      one `BlockTable` per KV cache group (its own block size)

Rows stay dense: removing a request moves the last row into its slot. Every rank applies the
same updates in the same order, so tensor-parallel ranks always hold identical batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from v1engine.sampling_params import SamplingParams
from v1engine.utils import cdiv


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Seeded requests draw from their own generator, kept across preemption; None: unseeded.
    generator: torch.Generator | None
    # One block-id list per KV cache group.
    block_ids: list[list[int]]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class BlockTable:
    """Block ids of every batch row for one KV cache group, and the slots they map tokens to."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = cdiv(max_model_len, block_size)
        self.table = np.zeros((max_num_reqs, self.max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise RuntimeError(
                f"block table row {row} would hold {end} blocks of {self.block_size} tokens, "
                f"more than the {self.max_num_blocks_per_req} a max_model_len request needs; "
                "the scheduler allocated more blocks than max_model_len allows"
            )
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        num_blocks = int(self.num_blocks[src])
        self.table[dst, :num_blocks] = self.table[src, :num_blocks]
        self.num_blocks[dst] = num_blocks

    def slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """[num_tokens] int64 cache slots of the tokens at `positions` of rows `req_indices`."""
        block_ids = self.table[req_indices, positions // self.block_size].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_sizes: list[int]) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # Row -> request id; dense, so rows 0 .. num_reqs - 1 are the batch.
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        # One column past max_model_len: a request's last sampled token (the one that reaches
        # the limit) is appended by the workers, though never computed.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_tables = [BlockTable(max_num_reqs, max_model_len, bs) for bs in block_sizes]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, state: CachedRequestState) -> None:
        """Writes the whole request into a new row (arrival, resumption, or rescheduling)."""
        if state.req_id in self.req_id_to_index:
            raise RuntimeError(f"request {state.req_id!r} is already in the input batch")
        if self.num_reqs >= self.max_num_reqs:
            raise RuntimeError(
                f"cannot add request {state.req_id!r}: the batch already holds max_num_seqs="
                f"{self.max_num_reqs} requests; the scheduler scheduled more than max_num_seqs"
            )
        row = self.num_reqs
        self.req_ids.append(state.req_id)
        self.req_id_to_index[state.req_id] = row
        self.num_tokens[row] = 0
        self.append_tokens(row, state.all_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        if len(state.block_ids) != len(self.block_tables):
            raise RuntimeError(
                f"request {state.req_id!r} has block ids for {len(state.block_ids)} KV cache "
                f"groups but the worker has {len(self.block_tables)}"
            )
        for table, block_ids in zip(self.block_tables, state.block_ids):
            table.set_row(row, block_ids)

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.max_model_len + 1:
            raise ValueError(
                f"request {self.req_ids[row]!r} would hold {end} tokens, more than "
                f"max_model_len={self.max_model_len}; the scheduler must cap prompt plus output "
                "tokens at max_model_len (one sampled token past it at most)"
            )
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def append_block_ids(self, row: int, new_block_ids: tuple[list[int], ...]) -> None:
        for table, block_ids in zip(self.block_tables, new_block_ids):
            table.append_row(row, block_ids)

    def remove_request(self, req_id: str) -> None:
        """Drops the request's row (if it has one); the last row moves into the hole."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        last_req_id = self.req_ids.pop()
        if row == last:
            return
        self.req_ids[row] = last_req_id
        self.req_id_to_index[last_req_id] = row
        num_tokens = int(self.num_tokens[last])
        self.token_ids[row, :num_tokens] = self.token_ids[last, :num_tokens]
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens[row] = self.num_computed_tokens[last]
        for table in self.block_tables:
            table.move_row(last, row)
