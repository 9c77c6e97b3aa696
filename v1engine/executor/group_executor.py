"""GroupExecutor: the call bookkeeping of every executor whose workers live in other processes,
shared by MultiprocExecutor (spawned processes) and RayExecutor (Ray actors). A subclass only
says how to start its worker group (`_make_group`); everything about calls is here.

RPC call semantics:
- `collective_rpc` checks the call (RpcCall.check: nothing is broadcast for an unknown method),
  then broadcasts `(call_id, RpcCall)` once on the group's broadcast queue. Every worker runs the
  calls in the order they were sent and answers each on its own response queue with
  `(call_id, ok, payload)`: the result (None on ranks other than `unique_reply_rank`) or a
  RemoteFailure. A call whose workers all answered completes: a WorkerError naming every
  failing rank with its traceback, else the results in rank order (or `unique_reply_rank`'s).
- Calls complete in the order they were sent, so replies are always read in that order, by the
  blocking caller itself or, for `non_block` calls, by one collector thread. Within a call the
  ranks are read in whatever order they answer: a reader never waits on one rank's queue for
  more than _POLL_SLICE_S while another rank's reply may be waiting.
- Failures that strand the others: a rank that raised has left the call, but its peers may be
  blocked in one of the call's collectives (an all-reduce) waiting for it, where no message can
  reach them; they will never answer, and the group cannot run another call. So a call fails
  as soon as one rank reports an error, once the ranks yet to answer had a grace to do so:
  ranks that fail alike (a bad argument, a request every rank refuses) answer at about the same
  time, stranded ones never. The grace is LOCKSTEP_GRACE_S for lockstep calls (`lockstep=True`:
  the engine's steps and the other calls that run the model, whose ranks run in step, see
  Executor) and PEER_GRACE_S for any other call (a user's method may take longer on one rank
  than on another), or the call's deadline if sooner. If every rank answered, no rank can be
  inside a collective: the WorkerError leaves the group usable. If one stayed silent, it is
  presumed stuck: the call fails with a WorkerError that says so, and the group is ended
  (`WorkerGroupBase.abort`): the workers are killed at once (SIGTERM or ray.kill: they may be
  stuck in gloo or NCCL), and every pending and later call raises WorkerDiedError naming the
  rank that failed.
- Timeouts: a call not complete by its deadline fails with a TimeoutError naming the method and
  the silent ranks, and is abandoned; its late replies carry a call_id smaller than any pending
  call's and are dropped when read.
- Death: the group's monitor thread sees a worker die, ends the group as above and closes the
  queues, which wakes every blocked reader; pending and later calls raise WorkerDiedError
  (rank, how it died, method).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from abc import abstractmethod
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from v1engine.executor.abstract import Executor
from v1engine.executor.errors import RemoteFailure, WorkerDiedError, WorkerError
from v1engine.executor.message_queue import QueueClosedError
from v1engine.executor.rpc_call import RpcCall
from v1engine.executor.worker_group import WorkerGroupBase
from v1engine.logger import init_logger

logger = init_logger(__name__)

# How long a reader blocks on one rank's queue while other ranks are silent too: bounds how late
# an error from another rank is seen while this one is still busy (e.g. in an all-reduce).
_POLL_SLICE_S = 0.05
# After one rank failed a call, how long the others may take to answer before they are presumed
# stuck in a collective with it (see the module doc): lockstep calls, and any other.
LOCKSTEP_GRACE_S = 1.0
PEER_GRACE_S = 5.0


@dataclass
class _PendingCall:
    call_id: int
    rpc: RpcCall
    deadline: float | None
    lockstep: bool
    future: Future = field(default_factory=Future)
    replies: dict[int, tuple[bool, Any]] = field(default_factory=dict)
    # Once a rank reported an error: until when the silent ranks may still answer.
    grace_end: float | None = None

    def record(self, rank: int, ok: bool, payload: Any) -> None:
        self.replies[rank] = (ok, payload)
        if not ok and self.grace_end is None:
            self.grace_end = time.monotonic() + self.grace_s

    @property
    def grace_s(self) -> float:
        return LOCKSTEP_GRACE_S if self.lockstep else PEER_GRACE_S

    def failures(self) -> list[RemoteFailure]:
        return sorted((p for ok, p in self.replies.values() if not ok), key=lambda f: f.rank)


class GroupExecutor(Executor):
    """An Executor over a WorkerGroupBase: one broadcast queue to every worker, one response
    queue from each."""

    @abstractmethod
    def _make_group(self) -> WorkerGroupBase:
        """Starts the workers (raising, with nothing left running, if one fails)."""

    def _init_executor(self) -> None:
        self._group = self._make_group()
        self.worker_methods = self._group.worker_methods
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        self._call_ids = itertools.count()
        self._pending: deque[_PendingCall] = deque()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._collect_queue: queue.SimpleQueue[_PendingCall | None] | None = None
        self._group.start_monitor(self._on_worker_death)

    # -- calls ------------------------------------------------------------------------------
    def _run_rpc(self, call: RpcCall, non_block: bool, lockstep: bool) -> Any:
        self._raise_if_dead(call.name)
        pending = self._send(call, lockstep)
        if non_block:
            self._collect_in_background(pending)
            return pending.future
        self._collect_until(pending)
        return pending.future.result()

    def _send(self, call: RpcCall, lockstep: bool) -> _PendingCall:
        with self._send_lock:
            deadline = None if call.timeout is None else time.monotonic() + call.timeout
            pending = _PendingCall(next(self._call_ids), call, deadline, lockstep)
            self._pending.append(pending)
            try:
                self._group.broadcast_mq.enqueue((pending.call_id, call), timeout=call.timeout)
            except BaseException as e:
                self._pending.remove(pending)
                if isinstance(e, QueueClosedError):
                    self._raise_if_dead(call.name)
                if isinstance(e, TimeoutError):
                    raise TimeoutError(
                        f"collective_rpc({call.name!r}) timed out after {call.timeout:.3g} s "
                        "waiting for the workers to take the call"
                    ) from None
                raise
            return pending

    def _collect_until(self, target: _PendingCall) -> None:
        """Reads replies, oldest call first, until `target` is complete or past its deadline."""
        with self._recv_lock:
            while not target.future.done():
                if not self._pending or self._pending[0].call_id > target.call_id:
                    return  # target was abandoned by a timeout and already failed
                self._collect_one(self._pending[0], target)

    def _collect_one(self, pending: _PendingCall, target: _PendingCall) -> None:
        """Reads `pending`'s replies until every rank answered, a failure stranded the silent
        ranks (the group is then ended), or `target`'s deadline passed."""
        silent = self._silent_ranks(pending)
        try:
            while silent:
                until = _earliest(pending.grace_end, target.deadline)
                if until is not None and time.monotonic() >= until:
                    if pending.grace_end is not None:
                        break  # stranded: handled below
                    self._abandon(target)
                    return
                self._read_any(pending, silent, until)
                silent = [r for r in silent if r not in pending.replies]
        except QueueClosedError:
            self._fail_pending()
            return
        self._pending.popleft()
        if silent:  # only a failure ends the loop early
            self._end_group(pending, silent)
        else:
            _complete(pending)

    def _silent_ranks(self, pending: _PendingCall) -> list[int]:
        return [r for r in range(self.world_size) if r not in pending.replies]

    def _read_any(self, pending: _PendingCall, silent: list[int], until: float | None) -> None:
        """Reads one reply of `pending` from any of the `silent` ranks, or returns at `until`
        (a monotonic time; None: no limit) without one."""
        left = None if until is None else max(0.0, until - time.monotonic())
        if len(silent) > 1:  # block on one queue only briefly, then look at the others
            left = _POLL_SLICE_S if left is None else min(left, _POLL_SLICE_S)
        if self._read_reply(silent[0], pending, left) or len(silent) == 1:
            return
        for rank in silent[1:]:
            if self._read_reply(rank, pending, 0.0):
                return

    def _read_reply(self, rank: int, pending: _PendingCall, timeout: float | None) -> bool:
        """Waits up to `timeout` s for `rank`'s reply to `pending`; True once recorded."""
        mq = self._group.response_mqs[rank]
        while True:
            try:
                call_id, ok, payload = mq.dequeue(timeout=timeout)
            except TimeoutError:
                return False
            if call_id == pending.call_id:
                pending.record(rank, ok, payload)
                return True
            # An older call timed out and was abandoned; its late reply is dropped here. Such
            # replies are already queued, so waiting `timeout` again overshoots by nothing.

    def _abandon(self, pending: _PendingCall) -> None:
        silent = self._silent_ranks(pending)
        self._pending.remove(pending)
        ranks = ", ".join(f"rank {r}" for r in silent)
        pending.future.set_exception(
            TimeoutError(
                f"collective_rpc({pending.rpc.name!r}) timed out after "
                f"{pending.rpc.timeout:.3g} s; no reply from {ranks}"
            )
        )

    def _end_group(self, pending: _PendingCall, silent: list[int]) -> None:
        """Fails `pending` with its ranks' errors, then ends the group (module doc)."""
        failures = pending.failures()
        name = pending.rpc.name
        ranks = ", ".join(f"rank {r}" for r in silent)
        note = (
            f"{ranks} did not answer within {pending.grace_s:.3g} s, presumably stuck in a "
            "collective with the failed rank; the executor stopped every worker: start a new "
            "engine"
        )
        pending.future.set_exception(WorkerError(name, failures, note))
        rank = failures[0].rank
        logger.error("worker rank %d failed in collective_rpc(%r): %s", rank, name, note)
        self._group.abort(rank, f"it raised in collective_rpc({name!r}) and the group was stopped")
        self._fail_pending()

    def _collect_in_background(self, pending: _PendingCall) -> None:
        # One daemon thread completes non-blocking calls in order; blocking callers collect
        # on their own thread, so a sequential call pays no thread hand-off.
        if self._collect_queue is None:
            self._collect_queue = queue.SimpleQueue()
            threading.Thread(
                target=_collector_loop,
                args=(weakref.ref(self), self._collect_queue),
                name="v1engine-rpc-collector",
                daemon=True,
            ).start()
        self._collect_queue.put(pending)

    # -- failures ----------------------------------------------------------------------------
    def _raise_if_dead(self, method: str | None) -> None:
        dead = self._group.dead_worker
        if dead is not None:
            raise WorkerDiedError(dead[0], dead[1], method)
        if self._group.is_shut_down:
            raise RuntimeError("the executor has been shut down")

    def _on_worker_death(self) -> None:
        # Called from the monitor thread; the group already closed the queues, so blocked
        # readers wake with QueueClosedError and fail their calls below.
        rank, cause = self._group.dead_worker
        logger.error("worker rank %d died (%s)", rank, cause)

    def _fail_pending(self) -> None:
        while self._pending:
            pending = self._pending.popleft()
            dead = self._group.dead_worker
            if dead is not None:
                error: BaseException = WorkerDiedError(dead[0], dead[1], pending.rpc.name)
            else:
                error = RuntimeError(f"collective_rpc({pending.rpc.name!r}): executor shut down")
            pending.future.set_exception(error)

    def shutdown(self) -> None:
        self._group.shutdown()
        with self._send_lock:
            if self._recv_lock.acquire(timeout=1.0):
                self._fail_pending()
                self._recv_lock.release()
        if self._collect_queue is not None:
            self._collect_queue.put(None)


def _earliest(a: float | None, b: float | None) -> float | None:
    """The earlier of two times, where None is never."""
    if a is None or b is None:
        return b if a is None else a
    return min(a, b)


def _complete(pending: _PendingCall) -> None:
    failures = pending.failures()
    reply_rank = pending.rpc.unique_reply_rank
    if failures:
        pending.future.set_exception(WorkerError(pending.rpc.name, failures))
    elif reply_rank is not None:
        pending.future.set_result(pending.replies[reply_rank][1])
    else:
        pending.future.set_result([pending.replies[r][1] for r in sorted(pending.replies)])


def _collector_loop(executor_ref: weakref.ref, calls: queue.SimpleQueue) -> None:
    while (pending := calls.get()) is not None:
        executor = executor_ref()
        if executor is None:
            return
        executor._collect_until(pending)
        del executor
