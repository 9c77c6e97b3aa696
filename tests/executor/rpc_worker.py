"""A worker class for RPC tests: no model, just methods that exercise the transport."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from v1engine.worker.worker_base import WorkerBase


class RPCTestWorker(WorkerBase):
    def echo(self, value):
        return value

    def get_rank(self) -> int:
        return self.rank

    def get_pid(self) -> int:
        return os.getpid()

    def raise_error(self, message: str = "boom", only_rank: int | None = None) -> int:
        if only_rank is None or only_rank == self.rank:
            raise ValueError(f"{message} from rank {self.rank}")
        return self.rank

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def make_tensor(self, num_bytes: int) -> torch.Tensor:
        return torch.full((num_bytes // 4,), float(self.rank), dtype=torch.float32)

    def tensor_sum(self, tensor: torch.Tensor) -> float:
        return float(tensor.double().sum())

    def array_checksum(self, array: np.ndarray) -> int:
        return int(array.sum(dtype=np.int64))

    def unpicklable_result(self):
        return lambda: None

    def exit_now(self, code: int) -> None:
        os._exit(code)


class FailingInitWorker(WorkerBase):
    def init_device(self) -> None:
        if self.rank == 1:
            raise RuntimeError("no device for rank 1")


def rank_times(worker: RPCTestWorker, factor: int) -> int:
    """A module-level function run as fn(worker, *args)."""
    return worker.rank * factor


def ignore_sigterm_and_sleep(worker: RPCTestWorker, seconds: float) -> None:
    """Simulates a wedged worker: busy in a call and deaf to SIGTERM."""
    import signal

    if worker.rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)


def process_id(worker: WorkerBase) -> int:
    """The pid of any worker class's process."""
    return os.getpid()


def ray_node_id(worker: WorkerBase) -> str:
    """The Ray node a worker runs on (Ray executor tests)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def torch_threads(worker: WorkerBase) -> int:
    """The intra-op thread count the worker settled on."""
    return torch.get_num_threads()
