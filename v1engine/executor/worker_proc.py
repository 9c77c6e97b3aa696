"""The worker process: build the worker, report READY, then serve broadcast calls until told to
stop. Runs in a spawned child (process.py starts it; worker_group.py is the parent's side). A
Ray actor (ray_worker.py) runs the same steps: start_worker, then serve_until_shutdown.

Messages on the broadcast queue are `(call_id, RpcCall)` or `SHUTDOWN`; each worker answers
every call on its own response queue with `(call_id, ok, payload)`, where payload is the result
(None on ranks other than `unique_reply_rank`) or a RemoteFailure. group_executor.py holds the
whole call contract.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from v1engine.executor.abstract import build_worker, get_worker_class
from v1engine.executor.errors import RemoteFailure
from v1engine.executor.message_queue import Handle, MessageQueue, QueueClosedError
from v1engine.executor.rpc_call import RpcCall, WorkerMethods
from v1engine.logger import set_process_rank
from v1engine.process import (
    HANDSHAKE_TIMEOUT_S,
    install_sigterm_handler,
    report_startup,
    watch_parent,
)

SHUTDOWN = "__v1engine_worker_shutdown__"
# How long a worker ending on SIGTERM waits to see whether its engine process dies too.
ORPHAN_CLEAN_UP_GRACE_S = 1.0

# The worker process's OpenMP waits. Every parallel op (matmul, attention, norm) ends in a barrier,
# where libgomp (the OpenMP of PyTorch's Linux wheels) spins up to 300,000 times, a few ms, before
# it sleeps. On cores another process also wants, the peer a thread waits for is often
# descheduled, and each of a step's hundreds of barriers burns a time slice: with one busy process
# per core, batch-1 decode ran 3.7x slower than idle. Sleeping too soon costs the other way: a
# slept thread takes tens of microseconds to wake, and a batch-1 decode step starts ~120 parallel
# matmuls with ~20-150 us of single-threaded work between them. Measured with
# `scripts/profile_steps.py --busy` (batch 1, float32, our CPU kernels): 1,000 spins gave 25
# tok/s idle, 1.3x slower busy; 10,000 spins (about 0.2 ms) 31.5-33.6 tok/s idle, 2.0-2.1x slower
# busy; 300,000 gave 35.9 idle, 3.7x busy. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins
# (GOMP_SPINCOUNT=300000 restores libgomp's default, for a machine of one's own). While the cores
# stay shared, worker/cpu_threads.py also takes small steps off the barriers: one thread.
_WORKER_SPIN_COUNT = "10000"

# glibc's malloc (2.35 and later) asks the kernel for transparent huge pages on the memory it
# maps, where the kernel leaves them to the program (THP "madvise", Debian's and many distros'
# default): a worker's weights and KV cache then sit in 2 MiB pages, and a decode step, which
# streams every weight and jumps between KV blocks, walks a page table 512x less often (in a
# VM, each walk is two). Without and with, alternating in one window (LLM.generate, default
# model, float32, 2 runs each): batch-1 decode 29.3 -> 31.1 tok/s, bench_throughput's 64
# requests 176 -> 185 tok/s. Older glibc and other C libraries ignore the variable; a user's own
# GLIBC_TUNABLES wins whole.
_WORKER_GLIBC_TUNABLES = "glibc.malloc.hugetlb=1"


def worker_env_defaults() -> dict[str, str]:
    """The environment a worker process starts with, for the names this one does not set."""
    defaults = {"GLIBC_TUNABLES": _WORKER_GLIBC_TUNABLES}
    if "OMP_WAIT_POLICY" not in os.environ:
        defaults["GOMP_SPINCOUNT"] = _WORKER_SPIN_COUNT
    return defaults


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


@dataclass(frozen=True)
class StartedWorker:
    worker: Any
    broadcast_mq: MessageQueue
    response_mq: MessageQueue

    def ready_message(self) -> WorkerReady:
        return WorkerReady(self.response_mq.export_handle(), WorkerMethods.of(type(self.worker)))


@dataclass(frozen=True)
class WorkerReady:
    """What a started worker tells the engine: where to read its replies, and what it runs."""

    response_handle: Handle
    methods: WorkerMethods


def worker_main(args: WorkerProcArgs, ready_conn: Connection) -> None:
    """Entry point of a spawned worker process; READY carries its `WorkerReady`."""
    set_process_rank(args.rank)
    install_sigterm_handler()
    # Ctrl-C reaches the whole process group; the engine process decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The engine process died (even by SIGKILL): remove the shared memory and socket files it
    # can no longer remove itself.
    parent_watch = watch_parent(lambda: MessageQueue.remove_all(args.ipc_dir))
    started = report_startup(ready_conn, lambda: start_worker(args), StartedWorker.ready_message)
    try:
        serve_until_shutdown(started, args.rank)
    except SystemExit:
        # SIGTERM. Sent to the whole process group (`kill -- -PGID`, a supervisor), it also
        # ended an engine process that had no handler, leaving its queues behind: give the
        # parent watch a moment to see that death and remove them before this process ends.
        if parent_watch is not None:
            parent_watch.join(ORPHAN_CLEAN_UP_GRACE_S)
        raise


def start_worker(args: WorkerProcArgs) -> StartedWorker:
    """Builds the worker (init_device, load_model) and attaches its queues."""
    worker_cls = get_worker_class(args.config.parallel_config)
    worker = build_worker(
        worker_cls, args.config, args.rank, args.local_rank, args.distributed_init_method
    )
    response_mq = None
    try:
        if args.response_host is None:
            response_mq = MessageQueue(1, ipc_dir=args.ipc_dir)
        else:
            response_mq = MessageQueue(1, n_local_reader=0, remote_host=args.response_host)
        broadcast_mq = MessageQueue.create_from_handle(args.broadcast_handle, args.rank)
    except BaseException:
        if response_mq is not None:
            response_mq.close()
        worker.shutdown()
        raise
    return StartedWorker(worker, broadcast_mq, response_mq)


def serve_until_shutdown(started: StartedWorker, rank: int) -> None:
    """Passes the queues' ready barriers, serves calls until SHUTDOWN or a closed queue, then
    releases the worker and the queues."""
    try:
        started.broadcast_mq.wait_until_ready(timeout=HANDSHAKE_TIMEOUT_S)
        started.response_mq.wait_until_ready(timeout=HANDSHAKE_TIMEOUT_S)
        _serve(started.worker, rank, started.broadcast_mq, started.response_mq)
    finally:
        started.worker.shutdown()
        started.broadcast_mq.close()
        started.response_mq.close()


def _serve(worker: Any, rank: int, broadcast_mq: MessageQueue, response_mq: MessageQueue) -> None:
    while True:
        try:
            message = broadcast_mq.dequeue()
        except QueueClosedError:
            return  # the engine is gone or shutting down
        if message == SHUTDOWN:
            return
        call_id, call = message
        reply = _run_call(worker, rank, call)
        try:
            response_mq.enqueue((call_id, *reply))
        except Exception as e:  # e.g. a result that cannot be pickled
            response_mq.enqueue((call_id, False, RemoteFailure.from_exception(rank, e)))


def _run_call(worker: Any, rank: int, call: RpcCall) -> tuple[bool, Any]:
    try:
        result = call.run_on(worker)
    except Exception as e:
        return False, RemoteFailure.from_exception(rank, e)
    return True, result if call.unique_reply_rank in (None, rank) else None
