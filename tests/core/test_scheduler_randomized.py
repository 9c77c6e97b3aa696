"""The scheduler under random workloads (arrivals over time, shared prefixes, a tight pool,
random aborts), under both policies: every step keeps the queues' invariants, every request's
tokens equal the reference's, and everything is freed at the end."""

from __future__ import annotations

import random

import pytest

from tests.core.fake_worker import (
    FakeWorker,
    assert_all_free,
    make_request,
    make_scheduler,
    make_worker,
    reference_output,
    step,
)
from v1engine.core.scheduler import Scheduler
from v1engine.request import Request, RequestStatus


def _make_random_requests(rng: random.Random, num_requests: int, priorities: bool) -> list[Request]:
    """Prompts drawn from a few shared prefixes plus a random tail, so prefixes get reused;
    priorities from -2 to 2 if `priorities`."""
    prefixes = [[rng.randrange(3, 97) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    requests = []
    for i in range(num_requests):
        tail = [rng.randrange(3, 97)] * rng.randrange(1, 12)
        prompt = rng.choice(prefixes)[: rng.randrange(0, 24)] + tail
        max_tokens = rng.randrange(1, 24)
        ignore_eos = rng.random() < 0.5
        priority = rng.randrange(-2, 3) if priorities else 0
        requests.append(
            make_request(
                f"r{i}", prompt, 64, priority=priority, max_tokens=max_tokens, ignore_eos=ignore_eos
            )
        )
    return requests


def _check_queues(scheduler: Scheduler) -> None:
    config = scheduler.scheduler_config
    assert len(scheduler.running) <= config.max_num_seqs
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.running)
    if scheduler.by_priority:  # both queues in (priority, arrival) order
        for queue in (scheduler.running, scheduler.waiting):
            keys = [(r.priority, r.arrival_time) for r in queue]
            assert keys == sorted(keys)
    else:  # preempted requests go back to the front, arrivals to the back: never interleaved
        statuses = [r.status for r in scheduler.waiting]
        num_preempted = statuses.count(RequestStatus.PREEMPTED)
        assert statuses[:num_preempted] == [RequestStatus.PREEMPTED] * num_preempted
        assert all(status == RequestStatus.WAITING for status in statuses[num_preempted:])
    ids = [r.request_id for r in scheduler.running] + [r.request_id for r in scheduler.waiting]
    assert sorted(ids) == sorted(scheduler.requests)


def _random_workload(rng: random.Random, scheduler: Scheduler, worker: FakeWorker) -> None:
    """Arrivals over time, shared prefixes, a tight pool, random aborts; checks every step."""
    requests = _make_random_requests(rng, 24, scheduler.by_priority)
    arrivals: dict[int, list[Request]] = {}
    for request in requests:
        arrivals.setdefault(rng.randrange(0, 20), []).append(request)
    aborted = set()
    for step_index in range(2000):
        for request in arrivals.pop(step_index, []):
            scheduler.add_request(request)
        if rng.random() < 0.03 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        if not arrivals and not scheduler.has_unfinished_requests():
            break
        had_requests = scheduler.has_unfinished_requests()
        scheduler_output, _ = step(scheduler, worker)
        # Progress: the pool holds any one request, so a step with work schedules some.
        num_tokens = scheduler_output.total_num_scheduled_tokens
        assert (num_tokens > 0) == had_requests
        assert num_tokens <= scheduler.scheduler_config.max_num_batched_tokens
        _check_queues(scheduler)
    for request in requests:
        expected, reason = reference_output(request, 64)
        if request.request_id in aborted:
            assert expected[: request.num_output_tokens] == request.output_token_ids
        else:
            assert request.output_token_ids == expected
            assert str(request.get_finish_reason()) == reason


@pytest.mark.parametrize(
    "seed, policy", [(seed, "fcfs") for seed in range(6)] + [(6, "priority"), (7, "priority")]
)
def test_randomized_workload_matches_the_reference_and_frees_everything(
    seed: int, policy: str
) -> None:
    rng = random.Random(seed)
    num_groups = 2 if seed == 4 else 1
    scheduler = make_scheduler(
        # 16 blocks per group hold one max_model_len request; block 0 is reserved.
        num_blocks=rng.randrange(16, 21) * num_groups + 1,
        max_num_batched_tokens=rng.choice([8, 16, 32, 64]),
        max_num_seqs=rng.randrange(4, 9),
        max_model_len=64,
        enable_prefix_caching=seed != 5,
        num_groups=num_groups,
        policy=policy,
    )
    worker = make_worker(scheduler)
    _random_workload(rng, scheduler, worker)
    assert_all_free(scheduler, worker)
    stats = scheduler.make_stats()
    assert stats.num_preemptions > 0
    assert (stats.num_prefix_cache_hit_tokens > 0) == (seed != 5)
