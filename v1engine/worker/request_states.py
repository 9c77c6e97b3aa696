"""The worker's request states, kept in step with the scheduler by applying each SchedulerOutput.

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

`RequestStates` owns every request's `CachedRequestState` and the persistent `InputBatch`, and is
the one implementation of the worker side of the contract below: `GPUModelRunner` and every test
double use it. It knows no model and no device; a seeded request's generator is made on the
device it is given.

The SchedulerOutput-diff contract (the types are in `v1engine/outputs.py`):
- New requests arrive whole, once: the first time a request is scheduled it comes as a
  `NewRequestData` (prompt, sampling parameters, one block-id list per KV cache group, and its
  computed-token count, prefix-cache hits included). Workers keep its state until it appears in
  `finished_req_ids`, preemption included.
- Running requests arrive as diffs: each later step that schedules a request names it in
  `scheduled_cached_reqs` with the blocks it gained this step per group (None when it gained
  none) and its computed-token count (what the step starts from).
- Workers append what they sample (`append_sampled`, every rank the driver's tokens), so the
  scheduler never sends output tokens back, and may schedule step N+1 before step N's tokens
  reach it: the token step N+1 computes on is the one the workers sampled in step N. A token
  sampled for a request that finished meanwhile is dropped with the request's state.
- `finished_req_ids`: requests finished or aborted since the last step; workers drop their
  state. Ids the workers never received (aborted while waiting) are ignored.
- `preempted_req_ids`: requests preempted this step. They lose their blocks and leave the batch,
  but workers keep their tokens and generator. A resumed request comes as a diff with
  `resumed_from_preemption` and its whole new block table in `new_block_ids` (its old blocks
  may all have been reused); its computed-token count says where recomputation starts.
- `num_scheduled_tokens` names every request scheduled this step. Requests not in it leave the
  batch and keep their state, so batch rows 0 .. num_reqs - 1 are exactly this step's requests;
  a request that has no row (new, resumed, or left out of an earlier step) is written whole.
- A request samples only when its computed tokens plus this step's reach the end of its known
  tokens; a partial prefill chunk samples nothing.
- `scheduled_spec_decode_tokens` (speculative decoding): drafted tokens the step computes after
  a request's known tokens, counted in its scheduled tokens; the workers return the drafts they
  accept and one token after them, and append those.
- Every tensor-parallel rank applies the same SchedulerOutput and must end with the same rows,
  or the all-reduces mix requests. Sets iterate in each process's own string-hash order, so
  removals go in sorted order; additions follow the order of `num_scheduled_tokens`.
A SchedulerOutput naming requests the workers cannot hold raises `RuntimeError` before any
state changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from v1engine.lora.request import LoRARequest
from v1engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
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
    lora_request: LoRARequest | None = None

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
        _append_to_row(
            self.table,
            self.num_blocks,
            row,
            block_ids,
            lambda end: (
                f"block table row {row} would hold {end} blocks of {self.block_size} "
                f"tokens, more than the {self.max_num_blocks_per_req} a max_model_len request "
                "needs; the scheduler allocated more blocks than max_model_len allows"
            ),
        )

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
        _append_to_row(
            self.token_ids,
            self.num_tokens,
            row,
            token_ids,
            lambda end: (
                f"request {self.req_ids[row]!r} would hold {end} tokens, more than "
                f"max_model_len={self.max_model_len}; the scheduler must cap prompt plus output "
                "tokens at max_model_len (one sampled token past it at most)"
            ),
        )

    def write_drafts(self, row: int, drafts: list[int]) -> None:
        """Writes drafted tokens after the row's known tokens (which they do not join: only
        those the step accepts are appended, as sampled tokens)."""
        start = int(self.num_tokens[row])
        if start + len(drafts) > self.token_ids.shape[1] - 1:
            raise RuntimeError(
                f"request {self.req_ids[row]!r} has {start} tokens and {len(drafts)} drafts, "
                f"more than max_model_len={self.max_model_len} with the token after them; the "
                "scheduler must trim drafts to the room left"
            )
        self.token_ids[row, start : start + len(drafts)] = drafts

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


def _append_to_row(
    data: np.ndarray,
    lengths: np.ndarray,
    row: int,
    values: list[int],
    overflow: Callable[[int], str],
) -> None:
    """Writes `values` after the `lengths[row]` entries of `data[row]`.

    Raises:
        RuntimeError: the row cannot hold them (`overflow(new length)` says why).
    """
    start = int(lengths[row])
    end = start + len(values)
    if end > data.shape[1]:
        raise RuntimeError(overflow(end))
    data[row, start:end] = values
    lengths[row] = end


@dataclass
class PromptProgress:
    """A request that asked for prompt logprobs (worker/prompt_logprobs.py) and still has
    prompt positions to score."""

    num_prompt_tokens: int
    num_logprobs: int  # k: top tokens per position, besides the prompt token itself
    num_scored: int = 0  # positions 0 .. num_scored - 1 are scored and returned


class RequestStates:
    def __init__(self, input_batch: InputBatch, generator_device: torch.device | str) -> None:
        self.input_batch = input_batch
        # Where seeded requests' generators live: the device the sampler runs on.
        self.generator_device = torch.device(generator_device)
        self.requests: dict[str, CachedRequestState] = {}
        # In arrival order, which every rank sees alike; a request leaves once fully scored.
        self.prompt_logprobs: dict[str, PromptProgress] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Applies one step's SchedulerOutput to the request states and the input batch."""
        self._check(scheduler_output)
        batch = self.input_batch
        for req_id in sorted(scheduler_output.finished_req_ids):
            self.requests.pop(req_id, None)
            self.prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in sorted(scheduler_output.preempted_req_ids):
            batch.remove_request(req_id)
        for new_req in scheduler_output.scheduled_new_reqs:
            self.requests[new_req.req_id] = self._new_request_state(new_req)
            k = new_req.sampling_params.prompt_logprobs
            if k is not None and len(new_req.prompt_token_ids) > 1:
                self.prompt_logprobs[new_req.req_id] = PromptProgress(
                    len(new_req.prompt_token_ids), k
                )
        self._apply_cached_diffs(scheduler_output.scheduled_cached_reqs)
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in [r for r in batch.req_ids if r not in scheduled]:
            batch.remove_request(req_id)  # not scheduled this step: its state stays
        for req_id in scheduled:
            if req_id not in batch.req_id_to_index:
                batch.add_request(self.requests[req_id])
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            batch.write_drafts(batch.req_id_to_index[req_id], drafts)

    def _check(self, scheduler_output: SchedulerOutput) -> None:
        """Raises on a SchedulerOutput that names requests the workers cannot hold."""
        held = self.requests.keys() - scheduler_output.finished_req_ids
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.req_id in held:
                raise RuntimeError(
                    f"request {new_req.req_id!r} arrives as a new request but the workers "
                    "already hold it; the scheduler sends a request whole only once"
                )
        known = held | {new_req.req_id for new_req in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, resumed, new_block_ids in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids
        ):
            if req_id not in known:
                raise RuntimeError(
                    f"scheduled_cached_reqs names request {req_id!r}, which the workers do not "
                    "know: it never arrived as a new request or has finished"
                )
            if resumed and new_block_ids is None:
                raise RuntimeError(
                    f"request {req_id!r} resumes from preemption without a block table; "
                    "the scheduler must send its whole table in new_block_ids"
                )
        for req_id in scheduler_output.num_scheduled_tokens:
            if req_id not in known:
                raise RuntimeError(
                    f"request {req_id!r} is scheduled but the workers never received it as a "
                    "new request (or it already finished)"
                )

    def _new_request_state(self, new_req: NewRequestData) -> CachedRequestState:
        generator = None
        seed = new_req.sampling_params.seed
        if seed is not None:
            generator = torch.Generator(device=self.generator_device)
            generator.manual_seed(seed)
        return CachedRequestState(
            req_id=new_req.req_id,
            prompt_token_ids=list(new_req.prompt_token_ids),
            sampling_params=new_req.sampling_params,
            generator=generator,
            block_ids=[list(ids) for ids in new_req.block_ids],
            num_computed_tokens=new_req.num_computed_tokens,
            lora_request=new_req.lora_request,
        )

    def _apply_cached_diffs(self, cached: CachedRequestData) -> None:
        """Updates each running request's state and, when it keeps its row, the row itself;
        requests without a row are written whole afterwards."""
        batch = self.input_batch
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            new_block_ids = cached.new_block_ids[i]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.resumed_from_preemption[i]:
                # The scheduler sends the whole table: its blocks may all have changed.
                state.block_ids = [list(ids) for ids in new_block_ids]
                batch.remove_request(req_id)
                continue
            if new_block_ids is not None:
                for ids, new_ids in zip(state.block_ids, new_block_ids):
                    ids.extend(new_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                continue
            batch.num_computed_tokens[row] = state.num_computed_tokens
            if new_block_ids is not None:
                batch.append_block_ids(row, new_block_ids)

    def append_sampled(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """Appends the step's sampled tokens (one list per batch row, in `req_ids` order; [] for
        a partial prefill) to the request states and their rows."""
        batch = self.input_batch
        for row, (req_id, token_ids) in enumerate(zip(req_ids, sampled, strict=True)):
            if token_ids:
                self.requests[req_id].output_token_ids.extend(token_ids)
                batch.append_tokens(row, token_ids)
