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


class CollectiveWorker(RPCTestWorker):
    """Joins a real gloo group, so that a rank can be stranded in an all-reduce the way a
    model's ranks are when one of them fails in the middle of a forward."""

    def init_device(self) -> None:
        from v1engine.model.parallel_state import init_distributed

        world_size = self.config.parallel_config.world_size
        init_distributed(self.rank, world_size, self.distributed_init_method, backend="gloo")

    def execute_model(self, scheduler_output: tuple[int | None, bool]) -> int:
        """`scheduler_output` is (fail_rank, all_reduce): `fail_rank` raises; the others
        all-reduce (and so wait there for it forever), or return at once without all_reduce."""
        fail_rank, all_reduce = scheduler_output
        if self.rank == fail_rank:
            raise RuntimeError(f"injected fault on rank {self.rank}")
        if not all_reduce:
            return 0
        import torch.distributed as dist

        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        return int(tensor.item())

    def all_reduce_unless(self, fail_rank: int | None) -> int:
        """The same as a user's own method, called with collective_rpc."""
        return self.execute_model((fail_rank, True))

    def shutdown(self) -> None:
        from v1engine.model.parallel_state import destroy_distributed

        destroy_distributed()
