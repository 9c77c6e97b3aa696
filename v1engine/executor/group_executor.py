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
  blocking caller itself or, for `non_block` calls, by one collector thread.
- Timeouts: a call not complete by its deadline fails with a TimeoutError naming the method and
  the silent ranks, and is abandoned; its late replies carry a call_id smaller than any pending
  call's and are dropped when read.
- Death: the group's monitor thread sees a worker die and closes the queues, which wakes every
  blocked reader; pending and later calls raise WorkerDiedError (rank, how it died, method).
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
from v1engine.executor.errors import WorkerDiedError, WorkerError
from v1engine.executor.message_queue import MessageQueue, QueueClosedError
from v1engine.executor.rpc_call import RpcCall
from v1engine.executor.worker_group import WorkerGroupBase
from v1engine.logger import init_logger

logger = init_logger(__name__)


@dataclass
class _PendingCall:
    call_id: int
    rpc: RpcCall
    deadline: float | None
    future: Future = field(default_factory=Future)
    replies: dict[int, tuple[bool, Any]] = field(default_factory=dict)


class GroupExecutor(Executor):
    """An Executor over a WorkerGroupBase: one broadcast queue to every worker, one response
    queue from each."""

    @abstractmethod
    def _make_group(self) -> WorkerGroupBase:
        """Starts the workers (raising, with nothing left running, if one fails)."""

    def _init_executor(self) -> None:
        self._group = self._make_group()
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        self._call_ids = itertools.count()
        self._pending: deque[_PendingCall] = deque()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._collect_queue: queue.SimpleQueue[_PendingCall | None] | None = None
        self._group.start_monitor(self._on_worker_death)

    # -- calls ------------------------------------------------------------------------------
    def _run_rpc(self, call: RpcCall, non_block: bool) -> Any:
        self._raise_if_dead(call.name)
        pending = self._send(call)
        if non_block:
            self._collect_in_background(pending)
            return pending.future
        self._collect_until(pending)
        return pending.future.result()

    def _send(self, call: RpcCall) -> _PendingCall:
        with self._send_lock:
            deadline = None if call.timeout is None else time.monotonic() + call.timeout
            pending = _PendingCall(next(self._call_ids), call, deadline)
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
        for rank, mq in enumerate(self._group.response_mqs):
            if rank in pending.replies:
                continue
            try:
                pending.replies[rank] = self._read_reply(mq, pending, target)
            except TimeoutError:
                self._abandon(target)
                return
            except QueueClosedError:
                self._fail_pending()
                return
        self._pending.popleft()
        _complete(pending)

    def _read_reply(self, mq: MessageQueue, pending: _PendingCall, target: _PendingCall) -> tuple:
        while True:
            left = None if target.deadline is None else max(0.0, target.deadline - time.monotonic())
            call_id, ok, payload = mq.dequeue(timeout=left)
            if call_id == pending.call_id:
                return ok, payload
            # An older call timed out and was abandoned; its late reply is dropped here.

    def _abandon(self, pending: _PendingCall) -> None:
        silent = [r for r in range(self.world_size) if r not in pending.replies]
        self._pending.remove(pending)
        ranks = ", ".join(f"rank {r}" for r in silent)
        pending.future.set_exception(
            TimeoutError(
                f"collective_rpc({pending.rpc.name!r}) timed out after "
                f"{pending.rpc.timeout:.3g} s; no reply from {ranks}"
            )
        )

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


def _complete(pending: _PendingCall) -> None:
    failures = [p for ok, p in pending.replies.values() if not ok]
    reply_rank = pending.rpc.unique_reply_rank
    if failures:
        failures.sort(key=lambda f: f.rank)
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
