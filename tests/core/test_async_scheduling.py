"""Async scheduling: step N+1 is scheduled and sent before step N's tokens come back.

The scheduler half runs the real Scheduler against the fake worker (which checks every KV read)
with the worker always one step ahead of the outputs, as the engine core drives it, and compares
each request's tokens and finish reason with the reference. The engine half shows the real
EngineCore over worker processes really schedules N+1 while N is still running.
"""

from __future__ import annotations

import os
import threading
from collections import deque

import pytest

from tests.core.counting_worker import expected_tokens, make_config
from tests.core.fake_worker import (
    FakeWorker,
    assert_all_free,
    make_request,
    make_scheduler,
    make_worker,
    reference_output,
)
from tests.timeouts import scaled
from v1engine.core.engine_core import EngineCore
from v1engine.core.scheduler import Scheduler
from v1engine.request import EngineCoreRequest, RequestStatus
from v1engine.sampling_params import SamplingParams


def run_one_step_ahead(
    scheduler: Scheduler, worker: FakeWorker, abort_at: dict[int, str] | None = None
) -> tuple[dict[str, tuple[list[int], str | None]], int]:
    """Steps to completion with the worker always one step ahead of the scheduler's outputs
    (what EngineCore.step does). Returns each request's (tokens, finish reason) and how many
    times a request was scheduled on top of a token still in flight. `abort_at`: step ->
    request id to abort once that step's successor was sent."""
    results: dict[str, tuple[list[int], str | None]] = {}
    in_flight: deque = deque()
    num_ahead = 0
    for step in range(1000):
        if not in_flight:
            scheduler_output = scheduler.schedule()
            in_flight.append((scheduler_output, worker.execute_model(scheduler_output)))
        if scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
            scheduler_output = scheduler.schedule()
            in_flight.append((scheduler_output, worker.execute_model(scheduler_output)))
            num_ahead += sum(
                scheduler.requests[r].num_output_placeholders == 2
                for r in scheduler_output.num_scheduled_tokens
            )
        if abort_at and step in abort_at:
            scheduler.finish_requests(abort_at[step], RequestStatus.FINISHED_ABORTED)
        scheduler_output, model_output = in_flight.popleft()
        for out in scheduler.update_from_output(scheduler_output, model_output).outputs:
            tokens = results.get(out.request_id, ([], None))[0] + out.new_token_ids
            results[out.request_id] = (tokens, out.finish_reason and str(out.finish_reason))
        if not scheduler.has_unfinished_requests() and not in_flight:
            return results, num_ahead
    raise AssertionError("did not finish")


def _requests(num: int, max_model_len: int = 128) -> list:
    requests = []
    for i in range(num):
        prompt = [(7 * i + j) % 90 + 3 for j in range(3 + 5 * i)]
        kwargs = {"max_tokens": 4 + 3 * i}
        if i % 3 == 0:
            kwargs["ignore_eos"] = True  # runs to max_tokens; the others may stop at EOS
        requests.append(make_request(f"r{i}", prompt, max_model_len=max_model_len, **kwargs))
    return requests


@pytest.mark.parametrize(
    "scheduler_kwargs",
    [
        {},  # everything fits: pure decode overlap
        {"max_num_batched_tokens": 8},  # chunked prefill in flight under decodes
        {"num_blocks": 21, "max_num_batched_tokens": 16},  # 20 blocks: preemption while ahead
    ],
    ids=["roomy", "chunked", "preempting"],
)
def test_one_step_ahead_gives_every_request_its_reference_tokens(scheduler_kwargs) -> None:
    scheduler = make_scheduler(**scheduler_kwargs)
    worker = make_worker(scheduler)
    requests = _requests(8)
    for request in requests:
        scheduler.add_request(request)
    results, num_ahead = run_one_step_ahead(scheduler, worker)
    for request in requests:
        tokens, reason = results[request.request_id]
        assert (tokens, reason) == reference_output(request, 128), request.request_id
    assert num_ahead > 0, "no request was ever scheduled on top of an in-flight token"
    if "num_blocks" in scheduler_kwargs:
        assert scheduler.make_stats().num_preemptions > 0
    assert_all_free(scheduler, worker)


def test_one_step_ahead_stops_at_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=12)
    worker = make_worker(scheduler)
    requests = [
        make_request(f"r{n}", [5] * n, max_model_len=12, max_tokens=None, ignore_eos=True)
        for n in (4, 11, 12)
    ]
    for request in requests:
        scheduler.add_request(request)
    results, _ = run_one_step_ahead(scheduler, worker)
    for request in requests:
        assert results[request.request_id] == reference_output(request, 12)
        assert request.num_tokens == 12 or request.num_prompt_tokens == 12
    assert_all_free(scheduler, worker)


def test_an_abort_while_its_token_is_in_flight_drops_that_token() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    a = make_request("a", [1, 2, 3], max_tokens=20, ignore_eos=True)
    b = make_request("b", [4, 5, 6], max_tokens=6, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(b)
    results, _ = run_one_step_ahead(scheduler, worker, abort_at={3: "a"})
    assert results["b"] == reference_output(b, 128)
    tokens, reason = results["a"]
    # Outputs of steps 0..2 arrived before the abort; the two steps then in flight are dropped.
    assert reason is None and 0 < len(tokens) < 20
    assert tokens == reference_output(a, 128)[0][: len(tokens)]
    assert_all_free(scheduler, worker)


# -- the engine core over worker processes -------------------------------------------------------


def test_engine_core_schedules_the_next_step_while_the_workers_run_this_one(tmp_path) -> None:
    """The worker cannot answer step N before a gate file exists; the core must still schedule
    and send step N+1 (every wait has a limit; nothing is timed)."""
    gate = str(tmp_path / "gate")
    core = EngineCore(make_config(tensor_parallel_size=1))
    try:
        core.collective_rpc("set_gate", args=(gate, scaled(60)))
        events: list[str] = []
        two_sent = threading.Event()
        schedule, update = core.scheduler.schedule, core.scheduler.update_from_output
        execute_model = core.executor.execute_model

        def traced_execute_model(*args, **kwargs):
            future = execute_model(*args, **kwargs)
            events.append("send")
            if events.count("send") == 2:
                two_sent.set()
            return future

        core.scheduler.schedule = lambda: events.append("schedule") or schedule()
        core.scheduler.update_from_output = lambda *a: events.append("update") or update(*a)
        core.executor.execute_model = traced_execute_model
        prompt = [3, 4, 5]
        core.add_request(EngineCoreRequest("a", prompt, SamplingParams(max_tokens=4)))
        tokens: list[int] = []

        def run_to_completion() -> None:
            while core.has_work():
                tokens.extend(t for out in core.step().outputs for t in out.new_token_ids)

        stepper = threading.Thread(target=run_to_completion)
        stepper.start()
        assert two_sent.wait(scaled(30)), events
        # Step N+1 went to the worker while it is held inside step N: no reply can have come.
        assert events == ["schedule", "send", "schedule", "send"]
        assert not os.path.exists(gate)
        open(gate, "w").close()
        stepper.join(scaled(60))
        assert not stepper.is_alive()
        assert tokens == expected_tokens(prompt, 4)
        # Throughout, step k + 1 was scheduled before step k's outputs were read.
        updates = [i for i, event in enumerate(events) if event == "update"]
        assert len(updates) == 4, events
        for k, index in enumerate(updates[:-1]):
            assert events[:index].count("schedule") >= k + 2, events
    finally:
        core.shutdown()
