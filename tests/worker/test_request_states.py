"""RequestStates without a model: the real scheduler's outputs applied to the persistent batch,
seeded generators, and SchedulerOutputs that break the contract (rejected before any change).
tests/core/test_scheduler.py drives the same module through `FakeWorker` on every step."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.core.fake_worker import make_request, make_scheduler, make_worker, step
from v1engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from v1engine.sampling_params import SamplingParams
from v1engine.worker.request_states import CachedRequestState, InputBatch


def _running_pair():
    """A scheduler and a worker whose states hold "a" (seeded) and "b", both in the batch."""
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], seed=11))
    scheduler.add_request(make_request("b", [6, 7, 8]))
    step(scheduler, worker)
    return scheduler, worker


def test_seeded_request_gets_its_own_generator_on_the_given_device():
    _, worker = _running_pair()
    states = worker.states.requests
    assert states["b"].generator is None
    generator = states["a"].generator
    assert generator.device == torch.device("cpu") and generator.initial_seed() == 11


def test_rows_are_exactly_the_scheduled_requests_and_track_the_diffs():
    scheduler, worker = _running_pair()
    step(scheduler, worker)
    batch = worker.states.input_batch
    for req_id in ("a", "b"):
        row = batch.req_id_to_index[req_id]
        state = worker.states.requests[req_id]
        num_tokens = int(batch.num_tokens[row])
        assert batch.token_ids[row, :num_tokens].tolist() == state.all_token_ids
        assert int(batch.num_computed_tokens[row]) == state.num_computed_tokens
        table = batch.block_tables[0]
        assert table.table[row, : table.num_blocks[row]].tolist() == state.block_ids[0]


def _new_request(req_id: str) -> NewRequestData:
    return NewRequestData(req_id, [1, 2], SamplingParams(), ([1],), 0)


def _snapshot(states) -> tuple:
    batch = states.input_batch
    per_request = {
        req_id: (state.all_token_ids, copy.deepcopy(state.block_ids), state.num_computed_tokens)
        for req_id, state in states.requests.items()
    }
    return per_request, list(batch.req_ids), batch.token_ids.tolist()


@pytest.mark.parametrize(
    ("scheduler_output", "match"),
    [
        (
            SchedulerOutput(
                scheduled_cached_reqs=CachedRequestData(["ghost"], [False], [None], [3]),
                num_scheduled_tokens={"ghost": 1},
            ),
            "scheduled_cached_reqs names request 'ghost'",
        ),
        (SchedulerOutput(num_scheduled_tokens={"ghost": 1}), "'ghost' is scheduled but"),
        (
            SchedulerOutput(scheduled_new_reqs=[_new_request("c"), _new_request("a")]),
            "'a' arrives as a new request but the workers already hold it",
        ),
        (
            SchedulerOutput(
                scheduled_cached_reqs=CachedRequestData(["b"], [True], [None], [0]),
                num_scheduled_tokens={"b": 3},
            ),
            "'b' resumes from preemption without a block table",
        ),
        (
            # Finished requests are dropped first: a diff for one is for an unknown request.
            SchedulerOutput(
                scheduled_cached_reqs=CachedRequestData(["a"], [False], [None], [5]),
                num_scheduled_tokens={"a": 1},
                finished_req_ids={"a"},
            ),
            "scheduled_cached_reqs names request 'a'",
        ),
    ],
    ids=["unknown_diff", "unknown_scheduled", "new_twice", "resumed_without_table", "finished"],
)
def test_a_broken_scheduler_output_raises_and_changes_nothing(scheduler_output, match):
    _, worker = _running_pair()
    before = _snapshot(worker.states)
    with pytest.raises(RuntimeError, match=match):
        worker.states.update(scheduler_output)
    assert _snapshot(worker.states) == before


def test_a_row_that_would_overflow_raises_and_keeps_its_contents():
    batch = InputBatch(max_num_reqs=1, max_model_len=32, block_sizes=[16])
    state = CachedRequestState("r", list(range(30)), SamplingParams(), None, [[5, 6]], 0)
    batch.add_request(state)
    with pytest.raises(RuntimeError, match=r"'r' would hold 34 tokens.*max_model_len=32"):
        batch.append_tokens(0, [1, 2, 3, 4])  # one sampled token past max_model_len is allowed
    batch.append_tokens(0, [1, 2, 3])
    assert batch.num_tokens[0] == 33
    with pytest.raises(RuntimeError, match=r"row 0 would hold 3 blocks of 16 tokens.* 2 a "):
        batch.append_block_ids(0, ([7],))
    assert batch.block_tables[0].num_blocks[0] == 2
