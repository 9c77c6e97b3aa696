"""The worker process: build the worker, report READY, then serve broadcast calls until told to
stop. Runs in a spawned child; the parent side lives in multiproc_executor.py. A Ray actor
(ray_worker.py) runs the same steps: build_worker, make_response_queue, serve_until_shutdown.

Messages on the broadcast queue are `(call_id, method, args, kwargs, reply_rank)` or `SHUTDOWN`;
each worker answers every call on its own response queue with `(call_id, ok, payload)`, where
payload is the result (None on ranks other than `reply_rank`) or a RemoteFailure.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from v1engine.executor.abstract import resolve_worker_cls
from v1engine.executor.errors import RemoteFailure
from v1engine.executor.message_queue import Handle, MessageQueue, QueueClosedError
from v1engine.logger import init_logger, set_process_rank

logger = init_logger(__name__)

SHUTDOWN = "__v1engine_worker_shutdown__"
READY = "READY"
FAILED = "FAILED"
_HANDSHAKE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WorkerProcArgs:
    config: Any
    rank: int
    local_rank: int
    distributed_init_method: str
    broadcast_handle: Handle
    ipc_dir: str
    # None: the engine shares this node, replies go through shared memory in ipc_dir. Else this
    # node's IP address, on which the reply queue publishes over TCP to the engine's node.
    response_host: str | None = None


def worker_main(args: WorkerProcArgs, ready_conn: Connection) -> None:
    """Entry point of a spawned worker process."""
    set_process_rank(args.rank)
    response_mq: MessageQueue | None = None
    _watch_parent(args)
    try:
        worker = build_worker(args)
        response_mq = make_response_queue(args)
        broadcast_mq = MessageQueue.create_from_handle(args.broadcast_handle, args.rank)
    except BaseException:
        ready_conn.send((FAILED, traceback.format_exc()))
        if response_mq is not None:
            response_mq.close()
        ready_conn.close()
        raise SystemExit(1) from None
    ready_conn.send((READY, response_mq.export_handle()))
    ready_conn.close()
    serve_until_shutdown(worker, args.rank, broadcast_mq, response_mq)


def serve_until_shutdown(
    worker: Any, rank: int, broadcast_mq: MessageQueue, response_mq: MessageQueue
) -> None:
    """Passes the queues' ready barriers, serves calls until SHUTDOWN or a closed queue, then
    releases the worker and the queues."""
    try:
        broadcast_mq.wait_until_ready(timeout=_HANDSHAKE_TIMEOUT_S)
        response_mq.wait_until_ready(timeout=_HANDSHAKE_TIMEOUT_S)
        _serve(worker, rank, broadcast_mq, response_mq)
    finally:
        worker.shutdown()
        broadcast_mq.close()
        response_mq.close()


def make_response_queue(args: WorkerProcArgs) -> MessageQueue:
    if args.response_host is None:
        return MessageQueue(1, ipc_dir=args.ipc_dir)
    return MessageQueue(1, n_local_reader=0, remote_host=args.response_host)


def build_worker(args: WorkerProcArgs) -> Any:
    worker_cls = resolve_worker_cls(args.config.parallel_config.worker_cls)
    worker = worker_cls(
        config=args.config,
        local_rank=args.local_rank,
        rank=args.rank,
        distributed_init_method=args.distributed_init_method,
        is_driver_worker=args.rank == 0,
    )
    worker.init_device()
    worker.load_model()
    return worker


def _serve(worker: Any, rank: int, broadcast_mq: MessageQueue, response_mq: MessageQueue) -> None:
    while True:
        try:
            message = broadcast_mq.dequeue()
        except QueueClosedError:
            return  # the engine is gone or shutting down
        if message == SHUTDOWN:
            return
        call_id, method, args, kwargs, reply_rank = message
        reply = _run_call(worker, rank, method, args, kwargs, reply_rank)
        try:
            response_mq.enqueue((call_id, *reply))
        except Exception:  # e.g. a result that cannot be pickled
            response_mq.enqueue((call_id, False, _failure(rank)))


def _run_call(
    worker: Any, rank: int, method: Any, args: tuple, kwargs: dict, reply_rank: int | None
) -> tuple[bool, Any]:
    try:
        if isinstance(method, str):
            result = getattr(worker, method)(*args, **kwargs)
        else:
            result = method(worker, *args, **kwargs)
    except Exception:
        return False, _failure(rank)
    return True, result if reply_rank in (None, rank) else None


def _failure(rank: int) -> RemoteFailure:
    exc = sys.exc_info()[1]
    return RemoteFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())


def _watch_parent(args: WorkerProcArgs) -> None:
    """When the engine process dies (even by SIGKILL), remove the shared memory and socket
    files it can no longer remove itself, then exit at once.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        MessageQueue.remove_all(args.ipc_dir)
        os._exit(1)

    threading.Thread(target=watch, name="v1engine-parent-watch", daemon=True).start()
