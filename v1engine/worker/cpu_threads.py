"""How many threads a CPU worker computes with: its share of the cores at start-up, and fewer
for small steps while other processes compete for those cores.

A step's parallel work (matmuls, attention) splits evenly over the worker's threads and ends in
a barrier, so a step runs at the pace of its slowest thread. When another busy process shares a
core, the thread on that core is descheduled for a time slice (milliseconds) at a time while
its peers wait for it at the barrier, and a batch-1 decode step starts over a hundred such
splits. Measured with `scripts/profile_steps.py --busy` (one busy process per core, 2 cores,
float32, default model): a batch-1 decode step took 50.7 ms with 2 threads and 24.8 ms with 1
(13.4 ms with 2 on the quiet machine); 16 requests 59.5 and 47.0 ms; 64 requests 148 and 156
ms; a prefill of 64 prompts 1.98 and 2.69 s. So under contention small steps run on one thread
and large ones keep them all; `contended_step_tokens` says where the cut lies.

Contention is read from the kernel's scheduler statistics (/proc/self/task/*/schedstat: per
thread, the time it ran and the time it waited, runnable, for a CPU): over a window of steps, if
some busy thread of this worker spent more than 30% of its runnable time waiting, the cores
are shared. A thread that shares its core with one busy process waits about half the time; on a
quiet machine a worker's threads waited 0-4% of it in `LLM`, and up to 27-34% in brief bursts
when the server's own processes were busy (start-up, a burst of streamed tokens). Back on all
threads is tried once the waits fall; if contention returns at once, the next try waits twice
as long.
`V1ENGINE_CPU_ADAPTIVE_THREADS=0` keeps every step on all threads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

import torch

from v1engine.logger import info_once, init_logger
from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.linear import max_kernel_tokens

logger = init_logger(__name__)

ADAPTIVE_ENV = "V1ENGINE_CPU_ADAPTIVE_THREADS"
# While the cores are shared, steps of up to CONTENDED_MIN_TOKENS run on one thread, and up to
# CONTENDED_MAX_TOKENS where our kernels take the step's matmuls (`contended_step_tokens`).
# Decode steps (above): 16 requests gained, 64 were level. Prompts: on two threads a step that
# took ~120 ms sometimes took ~330 instead, a third of them in one server run (64-token prompts,
# bfloat16, one busy process per core, 2-core AMD EPYC Zen 4); on one thread ~80-165, rarely
# more. `scripts/bench_serve.py --busy`, 128 against 32, medians of 3 sweeps: concurrency 1
# TTFT p50 139 against 137 ms, p99 185 against 357; concurrency 16 246 against 235 tokens/s,
# TTFT p50 546 against 616 ms. Past 128 two threads win (`profile_steps.py --busy --threads`:
# a 128-token prompt 215 against 244 ms, 512 tokens 734 against 930).
CONTENDED_MIN_TOKENS = 32
CONTENDED_MAX_TOKENS = 128
# Decisions are made over windows of at least this long and this much runnable thread time; the
# threads they weigh ran at least half as long as the busiest one: the compute threads, which
# split a step's work evenly (gloo's TCP loop ran 10% as long as they did, and waited half of it).
WINDOW_S = 0.2
MIN_RUNNABLE_S = 0.02
MIN_RAN_SHARE = 0.5
# Waiting for a CPU above this share of a thread's runnable time means the cores are shared;
# all threads are tried again only once every thread waits less than the lower share.
CONTENDED_WAIT_SHARE = 0.3
QUIET_WAIT_SHARE = 0.10
# How long one thread is kept before all are tried again, doubling while each try meets
# contention at once, up to the maximum.
MIN_HOLD_S = 0.5
MAX_HOLD_S = 16.0

# thread id -> (ns running, ns waiting runnable); None where the kernel keeps no schedstat.
SchedStats = dict[str, tuple[int, int]]


def read_thread_schedstats(task_dir: str = "/proc/self/task") -> SchedStats | None:
    """Per thread of this process, the nanoseconds it ran and waited runnable, or None where
    /proc has no schedstat (a kernel without CONFIG_SCHED_INFO, or no /proc)."""
    stats: SchedStats = {}
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]
        except (FileNotFoundError, ProcessLookupError):  # the thread ended since the listing
            continue
        except (OSError, ValueError):
            return None
        stats[tid] = (int(ran), int(waited))
    return stats


def wait_share(before: SchedStats, after: SchedStats) -> tuple[float, int]:
    """Between two readings: the largest share of runnable time spent waiting for a CPU among
    the threads that ran at least MIN_RAN_SHARE as long as the one that ran longest, and the
    runnable nanoseconds of all threads in `after` together. Threads that barely ran are left
    out: a helper that wakes for a moment (gloo's TCP loop) while the compute threads hold every
    core waits much of its short life, which says nothing about other processes."""
    deltas = []
    for tid, (ran, waited) in after.items():
        ran0, waited0 = before.get(tid, (0, 0))
        deltas.append((ran - ran0, waited - waited0))
    floor = max(MIN_RAN_SHARE * max((ran for ran, _ in deltas), default=0), 1)
    shares = [waited / (ran + waited) for ran, waited in deltas if ran >= floor]
    return max(shares, default=0.0), sum(ran + waited for ran, waited in deltas)


class CpuThreadGovernor:
    """Chooses each step's thread count: all of `full_threads`, or one for small steps while
    the cores are shared. `before_step` is called by the worker before every step."""

    def __init__(
        self,
        full_threads: int,
        small_step_tokens: int = CONTENDED_MIN_TOKENS,
        read_stats: Callable[[], SchedStats | None] = read_thread_schedstats,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.full_threads = full_threads
        self.small_step_tokens = small_step_tokens  # steps of up to this many take one thread
        self.contended = False
        self._read_stats, self._clock, self._set_threads = read_stats, clock, set_threads
        self._threads = full_threads
        self._stats = read_stats()
        self._window_start = clock()
        self._hold_s = MIN_HOLD_S
        self._changed_at = float("-inf")
        self._told = False  # the first switch to one thread is logged at INFO, later ones at DEBUG

    @property
    def active(self) -> bool:
        return self.full_threads > 1 and self._stats is not None

    def before_step(self, num_tokens: int) -> None:
        """Sets the thread count for a step of `num_tokens` tokens."""
        if not self.active:
            return
        now = self._clock()
        if now - self._window_start >= WINDOW_S:
            self._end_window(now)
        small = num_tokens <= self.small_step_tokens
        threads = 1 if self.contended and small else self.full_threads
        if threads != self._threads:
            self._set_threads(threads)
            self._threads = threads

    def _end_window(self, now: float) -> None:
        stats = self._read_stats()
        if stats is None:  # /proc went away: this step goes back to all threads, for good
            self._stats, self.contended = None, False
            return
        share, runnable = wait_share(self._stats, stats)
        if runnable < MIN_RUNNABLE_S * 1e9:  # too little ran to tell: widen the window
            return
        self._stats, self._window_start = stats, now
        if not self.contended and share > CONTENDED_WAIT_SHARE:
            # Contention back within two windows of trying all threads: wait longer next time.
            quick = now - self._changed_at <= 2 * WINDOW_S + 1e-9
            self._hold_s = min(2 * self._hold_s, MAX_HOLD_S) if quick else MIN_HOLD_S
            self._switch(True, now, share)
        elif self.contended and share < QUIET_WAIT_SHARE and now - self._changed_at >= self._hold_s:
            self._switch(False, now, share)

    def _switch(self, contended: bool, now: float, share: float) -> None:
        self.contended, self._changed_at = contended, now
        logger.debug(
            "CPU threads: %s (largest wait share %.2f)",
            f"1 for steps of up to {self.small_step_tokens} tokens" if contended else "all",
            share,
        )
        if contended and not self._told:
            self._told = True
            info_once(
                logger,
                "Other processes share this worker's cores: steps of up to %d tokens run on one "
                "thread while they do (set %s=0 to keep %d)",
                self.small_step_tokens,
                ADAPTIVE_ENV,
                self.full_threads,
            )


def contended_step_tokens(dtype: torch.dtype, in_features: Iterable[int]) -> int:
    """The most tokens a step of a model computing in `dtype`, whose matmuls read inputs of the
    widths `in_features`, runs on one thread while the cores are shared: CONTENDED_MAX_TOKENS as
    far as our matmul kernels take every one of them, as they compute each output on one thread
    in a fixed order and so give one thread all threads' bits (torch's and oneDNN's kernels past
    them may split a sum by thread); CONTENDED_MIN_TOKENS in any case."""
    ours = max_kernel_tokens(dtype, *in_features) if cpu_kernels.available() else 0
    return max(CONTENDED_MIN_TOKENS, min(CONTENDED_MAX_TOKENS, ours))


def cpu_thread_governor(small_step_tokens: int) -> CpuThreadGovernor | None:
    """The governor over the threads torch has now, or None where the user turned it off.

    Raises:
        ValueError: the environment variable is set to something other than 0 or 1.
    """
    value = os.environ.get(ADAPTIVE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ADAPTIVE_ENV}={value!r}: set it to 0 (all threads) or 1 (adaptive)")
    if value == "0":
        return None
    return CpuThreadGovernor(torch.get_num_threads(), small_step_tokens)


def init_cpu_threads(local_rank: int, local_world_size: int) -> None:
    """Splits this process's cores between the local workers: a disjoint, equal set pinned per
    rank when there are enough cores, otherwise an equal thread count on shared cores, so
    N ranks never run N x cpu_count threads that fight over the same cores."""
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = len(cpus) // local_world_size
    if local_world_size > 1 and per_rank >= 1:
        own = cpus[local_rank * per_rank : (local_rank + 1) * per_rank]
        os.sched_setaffinity(0, own)
    torch.set_num_threads(max(1, per_rank))
    info_once(
        logger,
        "CPU worker: %d thread(s) per rank over %d core(s)%s",
        max(1, per_rank),
        len(cpus),
        ", pinned per rank" if local_world_size > 1 and per_rank >= 1 else "",
    )
