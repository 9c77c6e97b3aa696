"""WorkerGroup: the worker processes of one engine and the queues that reach them.

Owns everything that must not outlive the engine: the processes, the broadcast queue's shared
memory, each worker's response queue and the private ipc directory. `shutdown()` is idempotent
and also runs at interpreter exit (the executor registers it with weakref.finalize).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from v1engine.executor.errors import describe_exitcode
from v1engine.executor.message_queue import Handle, MessageQueue, make_ipc_dir
from v1engine.executor.worker_proc import FAILED, SHUTDOWN, WorkerProcArgs, worker_main
from v1engine.logger import init_logger

logger = init_logger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a large model can take minutes; failures end it sooner
_HANDSHAKE_TIMEOUT_S = 60.0
_GRACEFUL_EXIT_S = 5.0
_TERMINATE_EXIT_S = 2.0


class WorkerGroup:
    def __init__(self, config: Any, world_size: int, distributed_init_method: str) -> None:
        # (rank, how it died), set once by the monitor thread.
        self.dead_worker: tuple[int, str] | None = None
        self.is_shut_down = False
        self.response_mqs: list[MessageQueue] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._shutdown_lock = threading.Lock()
        self._monitor_thread: threading.Thread | None = None
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self.ipc_dir = make_ipc_dir()
        self.broadcast_mq = MessageQueue(world_size, ipc_dir=self.ipc_dir)
        try:
            self._start(config, world_size, distributed_init_method)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: Any, world_size: int, distributed_init_method: str) -> None:
        context = multiprocessing.get_context("spawn")
        ready_conns = []
        for rank in range(world_size):
            args = WorkerProcArgs(
                config=config,
                rank=rank,
                local_rank=rank,
                distributed_init_method=distributed_init_method,
                broadcast_handle=self.broadcast_mq.export_handle(),
                ipc_dir=self.ipc_dir,
            )
            reader, writer = context.Pipe(duplex=False)
            proc = context.Process(
                target=worker_main, args=(args, writer), name=f"V1EngineWorker-{rank}", daemon=True
            )
            proc.start()
            writer.close()
            self._procs.append(proc)
            ready_conns.append(reader)
        handles = self._wait_for_ready(ready_conns)
        self.response_mqs = [MessageQueue.create_from_handle(h, 0) for h in handles]
        self.broadcast_mq.wait_until_ready(timeout=_HANDSHAKE_TIMEOUT_S)
        for mq in self.response_mqs:
            mq.wait_until_ready(timeout=_HANDSHAKE_TIMEOUT_S)

    def _wait_for_ready(self, conns: list[Connection]) -> list[Handle]:
        """Collects READY from every rank. A rank that reports FAILED or dies ends the wait
        at once with its traceback, so a broken worker never hangs the engine.
        """
        handles: dict[int, Handle] = {}
        rank_of = {conn: rank for rank, conn in enumerate(conns)}
        rank_of.update({proc.sentinel: rank for rank, proc in enumerate(self._procs)})
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(handles) < len(conns):
            left = deadline - time.monotonic()
            ready = wait([c for c in conns if rank_of[c] not in handles] + self._sentinels(), left)
            if not ready:
                raise RuntimeError(f"workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
            for obj in ready:
                rank = rank_of[obj]
                if isinstance(obj, Connection) and obj.poll():
                    status, payload = obj.recv()
                    if status == FAILED:
                        raise RuntimeError(f"worker rank {rank} failed to start:\n{payload}")
                    handles[rank] = payload
                elif not isinstance(obj, Connection):
                    code = self._procs[rank].exitcode
                    raise RuntimeError(
                        f"worker rank {rank} died during start-up ({describe_exitcode(code)})"
                    )
        for conn in conns:
            conn.close()
        return [handles[rank] for rank in range(len(conns))]

    def _sentinels(self) -> list[int]:
        return [p.sentinel for p in self._procs if p.exitcode is None]

    # -- monitoring ----------------------------------------------------------------------------
    def start_monitor(self, on_death: Callable[[], None]) -> None:
        self._monitor_thread = threading.Thread(
            target=self._monitor, args=(on_death,), name="v1engine-worker-monitor", daemon=True
        )
        self._monitor_thread.start()

    def _monitor(self, on_death: Callable[[], None]) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        ready = wait([*sentinels, self._stop_r])
        if self.is_shut_down or self._stop_r in ready:
            return
        rank = next(sentinels[s] for s in ready if s in sentinels)
        self._procs[rank].join(1.0)  # reap it, so its exit code is known
        self.dead_worker = (rank, describe_exitcode(self._procs[rank].exitcode))
        # Wake everything blocked on the queues; callers then see dead_worker.
        self.broadcast_mq.close()
        for mq in self.response_mqs:
            mq.close()
        on_death()

    # -- shut-down -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Graceful stop, then SIGTERM, then SIGKILL; removes every shared resource."""
        with self._shutdown_lock:
            if self.is_shut_down:
                return
            self.is_shut_down = True
        self._stop_w.send(None)
        monitor = self._monitor_thread
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join()
        if self.dead_worker is None and self.response_mqs:
            try:
                self.broadcast_mq.enqueue(SHUTDOWN, timeout=1.0)
            except Exception:  # a wedged or dead worker: terminate below
                pass
        self._stop_processes()
        self.broadcast_mq.close()
        for mq in self.response_mqs:
            mq.close()
        # A killed worker could not remove its own queue; the names share the engine's prefix.
        MessageQueue.remove_all(self.ipc_dir)
        self._stop_r.close()
        self._stop_w.close()

    def _stop_processes(self) -> None:
        deadline = time.monotonic() + _GRACEFUL_EXIT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + _TERMINATE_EXIT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.exitcode is None:
                logger.warning("worker pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.join()
            proc.close()
