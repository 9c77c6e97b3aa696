"""The three transports `bench_rpc.py` compares, each with its parent and its worker side.

`BenchWorker` is the class v1engine's executor imports from `worker_cls` (a dotted path) in each
spawned worker, and `pipe_worker`/`zmq_worker` are the baselines' spawn targets, so they all live in
this importable module: scripts/ is sys.path[0] of the benchmark, and spawned children inherit it.
Every system delivers the whole payload to every worker and gathers every worker's reply per call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import zmq

from v1engine.worker.worker_base import WorkerBase

BENCH_WORKER_CLS = "bench_worker.BenchWorker"
_START_TIMEOUT_S = 60.0
_REPLY_TIMEOUT_MS = 60_000


# ---- worker side ----


class BenchWorker(WorkerBase):
    """No device, no model (WorkerBase's init_device/load_model are no-ops): transport only."""

    def echo_len(self, payload: Any) -> int:
        return len(payload)

    def get_pid(self) -> int:
        return os.getpid()


def pipe_worker(conn: Connection) -> None:
    while (payload := conn.recv()) is not None:
        conn.send(len(payload))
    conn.close()


def zmq_worker(bcast_addr: str, reply_addr: str, rank: int) -> None:
    """Frames in: [tag, pickle header, *out-of-band buffers]; tags: Call, Ping, Go, Stop."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(bcast_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(reply_addr)
    try:
        while True:
            frames = sub.recv_multipart(copy=False)
            tag = frames[0].bytes
            if tag == b"C":
                payload = pickle.loads(frames[1].buffer, buffers=[f.buffer for f in frames[2:]])
                push.send(pickle.dumps(len(payload), protocol=5))
            elif tag in (b"P", b"G"):
                push.send(tag + str(rank).encode())
            elif tag == b"S":
                break
    finally:
        sub.close(linger=0)
        push.close(linger=0)
        ctx.term()


# ---- parent side ----


class System(ABC):
    """One transport: start N workers, broadcast a payload, gather every worker's reply."""

    name = ""

    @abstractmethod
    def start(self, num_workers: int) -> None: ...

    @abstractmethod
    def call(self, payload: np.ndarray) -> list[int]:
        """One call: every worker gets the payload; returns every worker's reply."""

    @abstractmethod
    def call_pipelined(self, payload: np.ndarray, depth: int) -> list[int]:
        """Issues `depth` calls before waiting for any; returns all depth * N replies."""

    @abstractmethod
    def worker_pids(self) -> list[int]: ...

    @abstractmethod
    def close(self) -> None:
        """Idempotent; also safe after a failed start."""


class V1EngineSystem(System):
    """`collective_rpc` of the executor that `backend` (distributed_executor_backend) selects."""

    name = "v1engine"
    backend = "mp"

    def __init__(self) -> None:
        self._executor: Any = None
        self._pids: list[int] = []

    def start(self, num_workers: int) -> None:
        from v1engine.config import EngineConfig, ParallelConfig
        from v1engine.executor.abstract import Executor

        parallel = ParallelConfig(
            tensor_parallel_size=num_workers,
            worker_cls=BENCH_WORKER_CLS,
            distributed_executor_backend=self.backend,
        )
        config = EngineConfig(parallel_config=parallel)
        self._executor = Executor.get_class(config)(config)
        self._pids = list(self._executor.collective_rpc("get_pid"))

    def call(self, payload: np.ndarray) -> list[int]:
        return self._executor.collective_rpc("echo_len", args=(payload,))

    def call_pipelined(self, payload: np.ndarray, depth: int) -> list[int]:
        rpc = self._executor.collective_rpc
        futures = [rpc("echo_len", args=(payload,), non_block=True) for _ in range(depth)]
        return [reply for future in futures for reply in future.result()]

    def worker_pids(self) -> list[int]:
        return self._pids

    def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown()


class ProcSystem(System):
    """Baselines whose worker processes this script spawns itself."""

    def __init__(self) -> None:
        self._procs: list[mp.process.BaseProcess] = []

    def _spawn(self, target: Any, args_per_rank: list[tuple[Any, ...]]) -> None:
        ctx = mp.get_context("spawn")
        for args in args_per_rank:
            proc = ctx.Process(target=target, args=args, daemon=True)
            proc.start()
            self._procs.append(proc)

    def _join(self) -> None:
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []

    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs if proc.pid is not None]


class PipeSystem(ProcSystem):
    name = "pipe"

    def __init__(self) -> None:
        super().__init__()
        self._conns: list[Connection] = []

    def start(self, num_workers: int) -> None:
        ctx = mp.get_context("spawn")
        pairs = [ctx.Pipe() for _ in range(num_workers)]
        self._conns = [parent for parent, _ in pairs]
        self._spawn(pipe_worker, [(child,) for _, child in pairs])
        for _, child in pairs:
            child.close()

    def call(self, payload: np.ndarray) -> list[int]:
        for conn in self._conns:
            conn.send(payload)
        return [conn.recv() for conn in self._conns]

    def call_pipelined(self, payload: np.ndarray, depth: int) -> list[int]:
        for _ in range(depth):
            for conn in self._conns:
                conn.send(payload)
        return [conn.recv() for _ in range(depth) for conn in self._conns]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass  # that worker is already gone
        self._join()
        for conn in self._conns:
            conn.close()
        self._conns = []


class ZmqSystem(ProcSystem):
    """PUB/SUB broadcast, PUSH/PULL replies, pickle 5 with out-of-band buffers, zero-copy sends."""

    name = "zmq"

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.mkdtemp(prefix="bench-rpc-")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop a broadcast
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.RCVTIMEO, _REPLY_TIMEOUT_MS)
        self._num_workers = 0

    def start(self, num_workers: int) -> None:
        bcast_addr, reply_addr = f"ipc://{self._dir}/bcast", f"ipc://{self._dir}/reply"
        self._pub.bind(bcast_addr)
        self._pull.bind(reply_addr)
        self._num_workers = num_workers
        self._spawn(zmq_worker, [(bcast_addr, reply_addr, rank) for rank in range(num_workers)])
        self._handshake()

    def _handshake(self) -> None:
        """Pings until every worker answered (so each is subscribed: no slow-joiner loss), then
        one Go whose acks come after every stale ping reply, leaving the reply channel clean."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        ready: set[bytes] = set()
        while len(ready) < self._num_workers:
            if time.monotonic() > deadline or not all(p.is_alive() for p in self._procs):
                raise RuntimeError(f"zmq workers died or not ready in {_START_TIMEOUT_S:.0f} s")
            self._pub.send(b"P")
            while self._pull.poll(10):
                ready.add(self._pull.recv())
        self._pub.send(b"G")
        acks = 0
        while acks < self._num_workers:
            acks += self._pull.recv().startswith(b"G")

    def _send(self, payload: np.ndarray) -> None:
        buffers: list[pickle.PickleBuffer] = []
        header = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
        self._pub.send_multipart([b"C", header, *buffers], copy=False)

    def _recv(self, num_replies: int) -> list[int]:
        return [pickle.loads(self._pull.recv()) for _ in range(num_replies)]

    def call(self, payload: np.ndarray) -> list[int]:
        self._send(payload)
        return self._recv(self._num_workers)

    def call_pipelined(self, payload: np.ndarray, depth: int) -> list[int]:
        for _ in range(depth):
            self._send(payload)
        return self._recv(depth * self._num_workers)

    def close(self) -> None:
        if self._procs:
            self._pub.send(b"S")
        self._join()
        self._pub.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


SYSTEM_CLASSES: dict[str, type[System]] = {
    cls.name: cls for cls in (V1EngineSystem, PipeSystem, ZmqSystem)
}
