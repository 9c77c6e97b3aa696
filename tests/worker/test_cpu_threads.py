"""The CPU worker's thread count under shared cores: the kernel's per-thread scheduler statistics
as read from /proc, and the governor's policy on given readings (one thread for small steps
while some thread waits for a CPU, all threads back after a hold that doubles while contention
returns at once)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.model.checkpoints import make_checkpoint
from tests.worker.worker_utils import (
    RunRecord,
    executor_step,
    make_engine_config,
    make_prompts,
    make_request,
    make_scheduler,
    run_kv_cache_handshake,
    run_mixed_scenario,
    run_requests,
)
from v1engine.executor.multiproc_executor import MultiprocExecutor
from v1engine.model.layers import cpu_kernels
from v1engine.worker import cpu_threads
from v1engine.worker.cpu_threads import (
    CONTENDED_MAX_TOKENS,
    CONTENDED_MIN_TOKENS,
    MAX_HOLD_S,
    MIN_HOLD_S,
    WINDOW_S,
    CpuThreadGovernor,
    contended_step_tokens,
    cpu_thread_governor,
    read_thread_schedstats,
    wait_share,
)

MS = 1_000_000  # nanoseconds
VOCAB_SIZE = 131  # tests/model/checkpoints.py's models


def test_schedstats_are_read_per_thread_of_this_process():
    stats = read_thread_schedstats()
    if stats is None:
        pytest.skip("this kernel keeps no /proc/<pid>/task/<tid>/schedstat")
    assert str(threading.get_native_id()) in stats
    assert all(ran >= 0 and waited >= 0 for ran, waited in stats.values())
    before = stats[str(threading.get_native_id())][0]
    total = 0
    for i in range(2_000_000):  # some CPU time on this thread
        total += i
    assert read_thread_schedstats()[str(threading.get_native_id())][0] > before


def test_schedstats_are_none_without_proc(tmp_path):
    assert read_thread_schedstats(str(tmp_path / "absent")) is None
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "schedstat").write_text("garbage\n")
    assert read_thread_schedstats(str(tmp_path)) is None


def test_the_wait_share_is_the_busiest_waiters_among_threads_that_ran():
    before = {"1": (10 * MS, 0), "2": (0, 0)}
    after = {
        "1": (40 * MS, 10 * MS),  # 30 ms ran, 10 waited: 0.25
        "2": (14 * MS, 22 * MS),  # ran 14 ms, under half the longest: a helper, ignored
        "3": (20 * MS, 20 * MS),  # new since the first reading: 0.5
    }
    assert wait_share(before, after) == (0.5, 116 * MS)
    assert wait_share(before, {"1": after["1"]}) == (0.25, 40 * MS)
    assert wait_share(before, {"1": after["1"], "2": after["2"]}) == (0.25, 76 * MS)
    assert wait_share(before, {"2": (0, 5 * MS)}) == (0.0, 5 * MS)


class Machine:
    """Readings as the kernel would give them: each `run(seconds, wait_share)` adds that much
    runnable time to one thread, the given share of it spent waiting, and moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.ran = self.waited = 0
        self.threads: list[int] = []
        self.has_schedstat = True

    def stats(self):
        return {"7": (self.ran, self.waited)} if self.has_schedstat else None

    def run(self, seconds: float, wait_share: float) -> None:
        self.now += seconds
        self.waited += int(seconds * wait_share * 1e9)
        self.ran += int(seconds * (1 - wait_share) * 1e9)

    def governor(
        self, full_threads: int = 4, small_step_tokens: int = CONTENDED_MIN_TOKENS
    ) -> CpuThreadGovernor:
        return CpuThreadGovernor(
            full_threads,
            small_step_tokens,
            read_stats=self.stats,
            clock=lambda: self.now,
            set_threads=self.threads.append,
        )


def steps(machine, governor, seconds, wait_share) -> None:
    """One-token steps, one per 10 ms, for `seconds`."""
    for _ in range(round(seconds / 0.01)):
        governor.before_step(1)
        machine.run(0.01, wait_share)


def test_a_quiet_machine_keeps_every_thread():
    machine = Machine()
    governor = machine.governor()
    steps(machine, governor, 5.0, wait_share=0.05)
    assert not governor.contended and machine.threads == []


def test_shared_cores_put_small_steps_on_one_thread_and_large_ones_on_all():
    machine = Machine()
    governor = machine.governor()
    steps(machine, governor, 2 * WINDOW_S + 0.02, wait_share=0.5)
    assert governor.contended and machine.threads == [1]
    governor.before_step(CONTENDED_MIN_TOKENS)
    assert machine.threads == [1]
    governor.before_step(CONTENDED_MIN_TOKENS + 1)
    governor.before_step(CONTENDED_MIN_TOKENS + 1)  # no call when the count stays
    governor.before_step(1)
    assert machine.threads == [1, 4, 1]


def test_all_threads_come_back_after_the_hold_and_the_hold_doubles_when_contention_returns():
    machine = Machine()
    governor = machine.governor()
    steps(machine, governor, 0.5, wait_share=0.5)
    assert governor.contended
    steps(machine, governor, MIN_HOLD_S / 2, wait_share=0.0)
    assert governor.contended  # quiet, but the hold has not passed

    def hold() -> float:
        """Quiet steps until all threads are back; then contention at once."""
        start = machine.now
        while governor.contended:
            steps(machine, governor, 0.01, wait_share=0.0)
        assert machine.threads[-1] == 4
        held = machine.now - start
        steps(machine, governor, WINDOW_S + 0.01, wait_share=0.5)
        assert governor.contended and machine.threads[-1] == 1
        return held

    assert hold() <= MIN_HOLD_S  # counted from the switch to one thread, before the quiet steps
    holds = [hold() for _ in range(7)]
    for held, expected in zip(holds, [1, 2, 4, 8, 16, 16, 16]):
        assert expected <= held <= expected + WINDOW_S + 0.02
    steps(machine, governor, MAX_HOLD_S + 1, wait_share=0.0)  # a long quiet spell on all threads
    assert not governor.contended
    steps(machine, governor, 2 * WINDOW_S + 0.02, wait_share=0.5)
    assert governor.contended and hold() <= MIN_HOLD_S + WINDOW_S + 0.02  # the hold starts over


def test_a_window_with_too_little_running_decides_nothing():
    machine = Machine()
    governor = machine.governor()
    for _ in range(20):  # idle between steps: a second apart, each 1 ms of which half waits
        governor.before_step(1)
        machine.run(0.001, 0.5)
        machine.now += 1.0
    assert not governor.contended
    steps(machine, governor, 0.1, wait_share=0.5)  # the same window, now with enough runnable
    assert governor.contended


def test_nothing_to_govern_with_one_thread_or_without_schedstat():
    machine = Machine()
    one = machine.governor(full_threads=1)
    steps(machine, one, 1.0, wait_share=0.9)
    assert not one.active and machine.threads == []
    blind = CpuThreadGovernor(4, read_stats=lambda: None, set_threads=machine.threads.append)
    blind.before_step(1)
    assert not blind.active and machine.threads == []


def test_schedstat_vanishing_later_returns_to_every_thread():
    machine = Machine()
    governor = machine.governor()
    steps(machine, governor, 0.5, wait_share=0.5)
    assert machine.threads == [1]
    machine.has_schedstat = False
    steps(machine, governor, 0.5, wait_share=0.5)
    assert not governor.active and not governor.contended and machine.threads == [1, 4]


def test_the_cut_for_small_steps_is_given():
    machine = Machine()
    governor = machine.governor(small_step_tokens=100)
    steps(machine, governor, 2 * WINDOW_S + 0.02, wait_share=0.5)
    governor.before_step(100)
    governor.before_step(101)
    assert machine.threads == [1, 4]


def test_small_steps_reach_as_far_as_our_matmul_kernels_within_the_bounds(monkeypatch):
    for ours, cut in ((0, CONTENDED_MIN_TOKENS), (64, 64), (4096, CONTENDED_MAX_TOKENS)):
        monkeypatch.setattr(cpu_threads, "max_kernel_tokens", lambda dtype, *widths, n=ours: n)
        monkeypatch.setattr(cpu_kernels, "available", lambda: True)
        assert contended_step_tokens(torch.float32, (256,)) == cut
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert contended_step_tokens(torch.float32, (256,)) == CONTENDED_MIN_TOKENS


def test_the_environment_can_turn_it_off(monkeypatch):
    monkeypatch.setenv(cpu_threads.ADAPTIVE_ENV, "0")
    assert cpu_thread_governor(CONTENDED_MIN_TOKENS) is None
    monkeypatch.setenv(cpu_threads.ADAPTIVE_ENV, "1")
    governor = cpu_thread_governor(64)
    assert governor.full_threads == torch.get_num_threads() and governor.small_step_tokens == 64
    monkeypatch.setenv(cpu_threads.ADAPTIVE_ENV, "off")
    with pytest.raises(ValueError, match="V1ENGINE_CPU_ADAPTIVE_THREADS='off': set it to 0"):
        cpu_thread_governor(CONTENDED_MIN_TOKENS)


def _governor_state(worker) -> tuple[int, int | None, int | None]:
    governor = worker.cpu_threads
    if governor is None:
        return torch.get_num_threads(), None, None
    return torch.get_num_threads(), governor.full_threads, governor.small_step_tokens


def _hold_threads(worker, threads: int) -> None:
    worker.cpu_threads = None  # no governor from here: the count stays as set
    torch.set_num_threads(threads)


def _run_large_steps(step, kv_cache_config, max_tokens: int) -> RunRecord:
    """Three prompts that fill a first step of exactly `max_tokens` tokens, the largest the
    governor puts on one thread; the rest of the last prompt and the decodes follow."""
    lens = [max_tokens // 4, max_tokens // 2, max_tokens // 2 + 8]
    prompts = make_prompts(VOCAB_SIZE, lens, seed=2)
    max_len = max(lens) + 8
    requests = [make_request(f"r{i}", p, max_len) for i, p in enumerate(prompts)]
    scheduler = make_scheduler(kv_cache_config, token_budget=max_tokens, max_model_len=max_len)
    record = run_requests(scheduler, step, {0: requests})
    assert record.scheduler_outputs[0].total_num_scheduled_tokens == max_tokens
    return record


def test_a_cpu_worker_governs_its_threads_and_one_thread_gives_all_threads_bits(tmp_path):
    """The governor may move small steps to one thread at any time, so one thread must compute
    the same logits, bit for bit, as all: the real scheduler's mixed scenario (chunked prefill,
    prefix hits, preemption; steps of at most 10 tokens), then steps as large as the governor
    lets one thread take (`contended_step_tokens`), on one thread and on all. The model is wide
    enough (hidden 256) that the gemv splits its rows between threads."""
    cores = len(os.sched_getaffinity(0))
    path = make_checkpoint(tmp_path, "llama", hidden_size=256, intermediate_size=512)
    large = contended_step_tokens(torch.float32, (256, 512))
    config = make_engine_config(path, max_model_len=large, max_num_batched_tokens=large)
    executor = MultiprocExecutor(config)
    try:
        kv_cache_config = run_kv_cache_handshake(executor)[0]
        [state] = executor.collective_rpc(_governor_state)
        records = []
        for held in (1, max(2, cores)):
            executor.collective_rpc(_hold_threads, args=(held,))
            step = executor_step(executor)
            mixed = run_mixed_scenario(step, kv_cache_config, VOCAB_SIZE)[1]
            records.append((mixed, _run_large_steps(step, kv_cache_config, large)))
    finally:
        executor.shutdown()
    assert state == (cores, cores, large)
    for one, every in zip(*records):
        assert one.logits.keys() == every.logits.keys() and len(one.logits) in (3, 5)
        for req_id, rows in one.logits.items():
            assert len(rows) == len(every.logits[req_id])
            for a, b in zip(rows, every.logits[req_id]):
                assert torch.equal(a, b), req_id
