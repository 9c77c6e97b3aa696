"""The "priority" scheduling policy (vLLM's): the waiting queue and the running batch in
(priority, arrival) order, lower first; the least urgent running request is the one preempted,
and goes back to its place in the queue. Driven through `FakeWorker` like test_scheduler.py."""

from __future__ import annotations

import pytest

from tests.core.fake_worker import (
    assert_all_free,
    make_request,
    make_scheduler,
    make_worker,
    reference_output,
    run_to_completion,
    step,
)
from v1engine.config import SchedulerConfig


def test_the_most_urgent_waiting_request_is_admitted_first():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    worker = make_worker(scheduler)
    requests = [
        make_request("late", [5] * 4, priority=5, max_tokens=2),
        make_request("urgent", [6] * 4, priority=-1, max_tokens=2),
        make_request("normal", [7] * 4, priority=0, max_tokens=2),
        make_request("normal2", [8] * 4, priority=0, max_tokens=2),  # after "normal": a tie
    ]
    for request in requests:
        scheduler.add_request(request)
    admitted = []
    while scheduler.has_unfinished_requests():
        scheduler_output, _ = step(scheduler, worker)
        admitted += [new.req_id for new in scheduler_output.scheduled_new_reqs]
    assert admitted == ["urgent", "normal", "normal2", "late"]
    for request in requests:
        assert (request.output_token_ids, str(request.get_finish_reason())) == (
            reference_output(request, 128)
        )
    assert_all_free(scheduler, worker)


def test_the_least_urgent_running_request_is_preempted_and_queued_by_priority():
    scheduler = make_scheduler(num_blocks=5, policy="priority")  # 4 usable blocks of 4 tokens
    worker = make_worker(scheduler)
    a = make_request("a", [1, 2, 3, 4], priority=1, max_tokens=8, ignore_eos=True)
    b = make_request("b", [5, 6, 7, 8], priority=0, max_tokens=8, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(5):  # both compute tokens 0-7 in 2 blocks each: the pool is full
        scheduler_output, _ = step(scheduler, worker)
        assert set(scheduler_output.num_scheduled_tokens) == {"a", "b"}
    c = make_request("c", [9], priority=0, max_tokens=2)
    scheduler.add_request(c)
    # Both need a 3rd block; b, more urgent, goes first, and a (not the newest, b) makes room.
    scheduler_output, _ = step(scheduler, worker)
    assert scheduler_output.num_scheduled_tokens == {"b": 1}
    assert scheduler_output.preempted_req_ids == {"a"}
    # a goes back behind c, which is more urgent (first come, first served would put a first).
    assert [r.request_id for r in scheduler.waiting] == ["c", "a"]
    run_to_completion(scheduler, worker)
    for request in (a, b, c):
        assert (request.output_token_ids, str(request.get_finish_reason())) == (
            reference_output(request, 128)
        )
    assert_all_free(scheduler, worker)


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match=r"policy must be one of \('fcfs', 'priority'\)"):
        SchedulerConfig(policy="lottery")
