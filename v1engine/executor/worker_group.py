"""WorkerGroup: the worker processes of one engine and the queues that reach them.

Owns everything that must not outlive the engine: the processes, the broadcast queue's shared
memory, each worker's response queue and the private ipc directory. `shutdown()` is idempotent
and also runs at interpreter exit (the executor registers it with weakref.finalize).

`WorkerGroupBase` is what every process layout shares (RayWorkerGroup is the other one): the
queues, the record of a dead worker, the monitor thread and the order of shut-down.

A group dies once, by `abort(rank, cause)`: the monitor calls it when a worker dies, the executor
when a failed call stranded the other ranks in a collective. The survivors may be blocked inside
gloo or NCCL, where no message reaches them, so they are ended by force at once (SIGTERM, or
ray.kill), never asked to stop and waited for; `shutdown()` then reaps them.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from v1engine.executor.message_queue import MessageQueue, make_ipc_dir
from v1engine.executor.rpc_call import WorkerMethods
from v1engine.executor.worker_proc import (
    SHUTDOWN,
    WorkerProcArgs,
    WorkerReady,
    worker_env_defaults,
    worker_main,
)
from v1engine.process import (
    HANDSHAKE_TIMEOUT_S,
    WORKER_STARTUP_TIMEOUT_S,
    ChildProcess,
    ChildStartupError,
    stop_children,
    wait_until_ready,
)


class WorkerGroupBase:
    """The surface GroupExecutor drives: broadcast_mq, response_mqs, dead_worker,
    is_shut_down, start_monitor(on_death), abort(rank, cause), shutdown(). A subclass starts the
    workers, and says how to wait for one to die (`_wait_for_death`), how to end them
    (`_stop_workers`) and how to end them by force without waiting (`_kill_workers`).
    """

    def __init__(self) -> None:
        # (rank, how it died or failed), set once by abort().
        self.dead_worker: tuple[int, str] | None = None
        self.is_shut_down = False
        self.broadcast_mq: MessageQueue | None = None
        self.response_mqs: list[MessageQueue] = []
        self.worker_methods: WorkerMethods | None = None  # once started
        self._shutdown_lock = threading.Lock()
        self._monitor_thread: threading.Thread | None = None
        self.ipc_dir = make_ipc_dir()

    def _wait_for_death(self) -> tuple[int, str] | None:
        """Blocks until a worker dies: returns (rank, how it died), or None once shut down."""
        raise NotImplementedError

    def _stop_workers(self) -> None:
        """Ends every worker: `_ask_workers_to_stop`, then by force what is left."""
        raise NotImplementedError

    def _kill_workers(self) -> None:
        """Ends every worker by force and returns at once; shutdown() reaps them later."""
        raise NotImplementedError

    def _wake_monitor(self) -> None:
        """Makes `_wait_for_death` return soon; shutdown() calls it first. Default: nothing."""

    def _release(self) -> None:
        """Frees what the subclass holds beyond workers and queues, last. Default: nothing."""

    def start_monitor(self, on_death: Callable[[], None]) -> None:
        self._monitor_thread = threading.Thread(
            target=self._monitor, args=(on_death,), name="v1engine-worker-monitor", daemon=True
        )
        self._monitor_thread.start()

    def _monitor(self, on_death: Callable[[], None]) -> None:
        death = self._wait_for_death()
        # A death after abort() (the workers it killed) or shutdown() is no news.
        if death is not None and not self.is_shut_down and self.abort(*death):
            on_death()

    def abort(self, rank: int, cause: str) -> bool:
        """Marks the group dead because of `rank` (`cause`: how it died or failed), wakes every
        reader blocked on the queues (they then see `dead_worker`) and ends the workers by force.

        Returns:
            False when the group was already dead or shut down (nothing is done).
        """
        with self._shutdown_lock:
            if self.dead_worker is not None or self.is_shut_down:
                return False
            self.dead_worker = (rank, cause)
        self._close_queues()
        self._kill_workers()
        return True

    def shutdown(self) -> None:
        """Stops the workers, then removes every queue and shared resource; idempotent."""
        with self._shutdown_lock:
            if self.is_shut_down:
                return
            self.is_shut_down = True
        self._wake_monitor()
        monitor = self._monitor_thread
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join()
        self._stop_workers()
        self._close_queues()
        # A killed worker could not remove its own queue; the names share the engine's prefix.
        MessageQueue.remove_all(self.ipc_dir)
        self._release()

    def _ask_workers_to_stop(self) -> bool:
        """Broadcasts SHUTDOWN. Returns: whether the workers will leave by themselves (False
        while they are still starting, or when the queue is wedged)."""
        if not self.response_mqs:
            return False  # start-up failed: some workers are not reading the queue yet
        if self.dead_worker is not None:
            return False  # the survivors may be stuck in a collective: abort() killed them
        try:
            self.broadcast_mq.enqueue(SHUTDOWN, timeout=1.0)
        except Exception:  # a wedged worker: the caller ends it by force
            return False
        return True

    def _attach_response_queues(self, readies: list[WorkerReady]) -> None:
        """Reads each rank's replies, then passes every queue's ready barrier with the workers."""
        # Every rank runs the same class.
        self.worker_methods = readies[0].methods
        self.response_mqs = [MessageQueue.create_from_handle(r.response_handle, 0) for r in readies]
        self.broadcast_mq.wait_until_ready(timeout=HANDSHAKE_TIMEOUT_S)
        for mq in self.response_mqs:
            mq.wait_until_ready(timeout=HANDSHAKE_TIMEOUT_S)

    def _worker_args(
        self,
        config: Any,
        rank: int,
        local_rank: int,
        distributed_init_method: str,
        response_host: str | None = None,
    ) -> WorkerProcArgs:
        return WorkerProcArgs(
            config=config,
            rank=rank,
            local_rank=local_rank,
            distributed_init_method=distributed_init_method,
            broadcast_handle=self.broadcast_mq.export_handle(),
            ipc_dir=self.ipc_dir,
            response_host=response_host,
        )

    def _close_queues(self) -> None:
        for mq in (self.broadcast_mq, *self.response_mqs):
            if mq is not None:
                mq.close()


class WorkerGroup(WorkerGroupBase):
    """Spawned worker processes on this node."""

    def __init__(self, config: Any, world_size: int, distributed_init_method: str) -> None:
        super().__init__()
        self._procs: list[ChildProcess] = []
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self.broadcast_mq = MessageQueue(world_size, ipc_dir=self.ipc_dir)
        try:
            self._start(config, world_size, distributed_init_method)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: Any, world_size: int, distributed_init_method: str) -> None:
        for rank in range(world_size):
            args = self._worker_args(config, rank, rank, distributed_init_method)
            self._procs.append(
                ChildProcess(
                    worker_main,
                    (args,),
                    name=f"V1EngineWorker-{rank}",
                    label=f"worker rank {rank}",
                    daemon=True,
                    env_defaults=worker_env_defaults(),
                )
            )
        # A rank that fails or dies ends the wait at once with its traceback or exit code.
        try:
            readies = wait_until_ready(self._procs, WORKER_STARTUP_TIMEOUT_S)
        except ChildStartupError as e:
            raise e.for_caller() from None
        self._attach_response_queues(readies)

    # -- monitoring and shut-down ------------------------------------------------------------
    def _wait_for_death(self) -> tuple[int, str] | None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        ready = wait([*sentinels, self._stop_r])
        if self._stop_r in ready:
            return None
        rank = next(sentinels[s] for s in ready if s in sentinels)
        return rank, self._procs[rank].exit_reason()

    def _wake_monitor(self) -> None:
        self._stop_w.send(None)

    def _stop_workers(self) -> None:
        stop_children(self._procs, self._ask_workers_to_stop)

    def _kill_workers(self) -> None:
        for proc in self._procs:
            proc.terminate()

    def _release(self) -> None:
        self._stop_r.close()
        self._stop_w.close()
