"""MultiprocExecutor: one spawned WorkerProc per rank, driven over shared-memory queues.

Start-up: spawn every worker, wait for each to report READY with the handle of its response
queue (or FAILED with a traceback: then everything is torn down and the constructor raises),
then pass the queues' ready barriers. A monitor thread watches the processes; when one dies,
pending and later calls raise WorkerDiedError and the queues are closed so nothing blocks.

Calls: `collective_rpc` broadcasts `(call_id, ...)` once; every worker answers on its own queue.
Calls complete in the order they were sent, so replies are always read in that order; a reply
whose call was abandoned (timed out) has a smaller call_id than any pending call and is dropped.
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from v1engine.executor.abstract import Executor, check_rpc_method, check_unique_reply_rank
from v1engine.executor.errors import WorkerDiedError, WorkerError
from v1engine.executor.message_queue import MessageQueue, QueueClosedError
from v1engine.executor.worker_group import WorkerGroup
from v1engine.logger import init_logger

logger = init_logger(__name__)


@dataclass
class _PendingCall:
    call_id: int
    method: str
    reply_rank: int | None
    deadline: float | None
    timeout: float | None
    future: Future = field(default_factory=Future)
    replies: dict[int, tuple[bool, Any]] = field(default_factory=dict)


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        self.world_size = self.config.parallel_config.world_size
        self._group = self._make_group()
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        self._call_ids = itertools.count()
        self._pending: deque[_PendingCall] = deque()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._collect_queue: queue.SimpleQueue[_PendingCall] | None = None
        self._group.start_monitor(self._on_worker_death)

    def _make_group(self) -> WorkerGroup:
        """Starts the workers. Another process layout (e.g. Ray actors) overrides this with a
        group of the same surface: broadcast_mq, response_mqs, dead_worker, is_shut_down,
        start_monitor(on_death), shutdown().
        """
        return WorkerGroup(self.config, self.world_size, _distributed_init_method())

    # -- calls ------------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> Any:
        name = check_rpc_method(self.worker_cls, method)
        check_unique_reply_rank(unique_reply_rank, self.world_size)
        self._raise_if_dead(name)
        call = self._send(method, name, args, kwargs or {}, timeout, unique_reply_rank)
        if non_block:
            self._collect_in_background(call)
            return call.future
        self._collect_until(call)
        return call.future.result()

    def _send(self, method, name, args, kwargs, timeout, reply_rank) -> _PendingCall:
        with self._send_lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            call = _PendingCall(next(self._call_ids), name, reply_rank, deadline, timeout)
            self._pending.append(call)
            try:
                self._group.broadcast_mq.enqueue(
                    (call.call_id, method, args, kwargs, reply_rank), timeout=timeout
                )
            except BaseException as e:
                self._pending.remove(call)
                if isinstance(e, QueueClosedError):
                    self._raise_if_dead(name)
                if isinstance(e, TimeoutError):
                    raise TimeoutError(
                        f"collective_rpc({name!r}) timed out after {timeout:.3g} s waiting for "
                        "the workers to take the call"
                    ) from None
                raise
            return call

    def _collect_until(self, target: _PendingCall) -> None:
        """Reads replies, oldest call first, until `target` is complete or past its deadline."""
        with self._recv_lock:
            while not target.future.done():
                if not self._pending or self._pending[0].call_id > target.call_id:
                    return  # target was abandoned by a timeout and already failed
                self._collect_one(self._pending[0], target)

    def _collect_one(self, call: _PendingCall, target: _PendingCall) -> None:
        for rank, mq in enumerate(self._group.response_mqs):
            if rank in call.replies:
                continue
            try:
                call.replies[rank] = self._read_reply(mq, call, target)
            except TimeoutError:
                self._abandon(target, rank)
                return
            except QueueClosedError:
                self._fail_pending()
                return
        self._pending.popleft()
        _complete(call)

    def _read_reply(self, mq: MessageQueue, call: _PendingCall, target: _PendingCall) -> tuple:
        while True:
            left = None if target.deadline is None else max(0.0, target.deadline - time.monotonic())
            call_id, ok, payload = mq.dequeue(timeout=left)
            if call_id == call.call_id:
                return ok, payload
            # An older call timed out and was abandoned; its late reply is dropped here.

    def _abandon(self, call: _PendingCall, rank: int) -> None:
        silent = [r for r in range(self.world_size) if r not in call.replies]
        self._pending.remove(call)
        ranks = ", ".join(f"rank {r}" for r in silent)
        call.future.set_exception(
            TimeoutError(
                f"collective_rpc({call.method!r}) timed out after {call.timeout:.3g} s; "
                f"no reply from {ranks}"
            )
        )

    def _collect_in_background(self, call: _PendingCall) -> None:
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
        self._collect_queue.put(call)

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
            call = self._pending.popleft()
            dead = self._group.dead_worker
            if dead is not None:
                error: BaseException = WorkerDiedError(dead[0], dead[1], call.method)
            else:
                error = RuntimeError(f"collective_rpc({call.method!r}): executor shut down")
            call.future.set_exception(error)

    def shutdown(self) -> None:
        self._group.shutdown()
        with self._send_lock:
            if self._recv_lock.acquire(timeout=1.0):
                self._fail_pending()
                self._recv_lock.release()
        if self._collect_queue is not None:
            self._collect_queue.put(None)


def _complete(call: _PendingCall) -> None:
    failures = [p for ok, p in call.replies.values() if not ok]
    if failures:
        failures.sort(key=lambda f: f.rank)
        call.future.set_exception(WorkerError(call.method, failures))
    elif call.reply_rank is not None:
        call.future.set_result(call.replies[call.reply_rank][1])
    else:
        call.future.set_result([call.replies[r][1] for r in sorted(call.replies)])


def _collector_loop(executor_ref, calls: queue.SimpleQueue) -> None:
    while (call := calls.get()) is not None:
        executor = executor_ref()
        if executor is None:
            return
        executor._collect_until(call)
        del executor


def _distributed_init_method() -> str:
    # A fresh port per engine, so two engines on one host never collide.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"
