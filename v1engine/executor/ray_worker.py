"""RayWorker: the Ray actor behind one rank. It builds the same worker as a WorkerProc and serves
the same broadcast queue (worker_proc.py); only the process around it belongs to Ray.

The driver calls, in order: `get_node_info()` (to place ranks by node), `start(args)` (build the
worker, open the queues, return the reply queue's handle: the actor's READY), then `serve()`,
which runs until the engine sends SHUTDOWN; the driver keeps its ObjectRef and watches it to learn
of the actor's death.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray

from v1engine.executor.worker_proc import (
    StartedWorker,
    WorkerProcArgs,
    WorkerReady,
    serve_until_shutdown,
    start_worker,
)
from v1engine.logger import set_process_rank
from v1engine.process import get_open_port
from v1engine.worker.gpu_worker import LOCAL_WORLD_SIZE_ENV


@dataclass(frozen=True)
class NodeInfo:
    node_id: str  # Ray's node id: two nodes may share an IP (e.g. a simulated cluster)
    ip: str
    pid: int
    free_port: int  # a port free on this node, for torch.distributed when this is rank 0
    gpu_ids: tuple[str, ...]


class RayWorker:
    """Wrapped with `ray.remote` by RayWorkerGroup; a plain class here, so it stays importable
    and readable without a cluster."""

    def __init__(self) -> None:
        self._started: StartedWorker | None = None
        self._rank = -1

    def get_node_info(self) -> NodeInfo:
        return NodeInfo(
            node_id=ray.get_runtime_context().get_node_id(),
            ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            free_port=get_open_port(),
            gpu_ids=tuple(str(i) for i in ray.get_gpu_ids()),
        )

    def start(
        self, args: WorkerProcArgs, cuda_visible_devices: str | None, local_world_size: int
    ) -> WorkerReady:
        """Builds the worker (init_device + load_model) and attaches the queues.

        Args:
            cuda_visible_devices: every GPU of this node's ranks, in local-rank order. Ray shows
                an actor only its own GPU; the worker addresses `cuda:{local_rank}`.
            local_world_size: ranks on this node, so CPU workers share its cores among
                themselves only.
        """
        set_process_rank(args.rank)
        os.environ[LOCAL_WORLD_SIZE_ENV] = str(local_world_size)
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        self._rank = args.rank
        self._started = start_worker(args)
        return self._started.ready_message()

    def serve(self) -> None:
        serve_until_shutdown(self._started, self._rank)
