"""The Ray systems `bench_rpc.py --backend ray` adds, and the Ray cluster they run on.

- `v1engine-ray`: `RayExecutor.collective_rpc`, one actor per worker; ranks on the driver's node
  use shared memory, the others the message queue's TCP leg.
- `ray-call`: a bare Ray actor call per worker (`ray.get([a.echo_len.remote(p) ...])`), what
  a collective_rpc built on Ray calls would cost at the least.

Without `--ray-address`, the run starts a simulated cluster on this machine (`ray.cluster_utils`),
one node with one CPU per worker, so worker 1 onwards really is on another (Ray) node.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np
import ray
from bench_worker import System, V1EngineSystem
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

_INLINE_MAX_BYTES = 100 * 1024  # Ray's default max_direct_call_object_size


class RayCluster:
    """Joins `address`, or starts `num_nodes` one-CPU nodes here; `close()` undoes it."""

    def __init__(self, address: str | None, num_nodes: int) -> None:
        self._cluster: Any = None
        self._temp_dir: str | None = None
        if address is not None:
            ray.init(address=address)
            return
        from ray.cluster_utils import Cluster

        # A private, short temp dir (Ray's unix sockets live under it), removed at close().
        self._temp_dir = tempfile.mkdtemp(prefix="v1e-ray-")
        os.environ["RAY_TMPDIR"] = self._temp_dir
        self._cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(num_nodes - 1):
            self._cluster.add_node(num_cpus=1)
        self._cluster.wait_for_nodes()
        ray.init(address=self._cluster.address)

    def close(self) -> None:
        ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            os.environ.pop("RAY_TMPDIR", None)


class V1EngineRaySystem(V1EngineSystem):
    name = "v1engine-ray"
    backend = "ray"


class EchoActor:
    def echo_len(self, payload: Any) -> int:
        return len(payload)

    def get_pid(self) -> int:
        return os.getpid()


class RayCallSystem(System):
    """One Ray actor per worker, one bundle each (so they spread over nodes as RayExecutor's)."""

    name = "ray-call"

    def __init__(self) -> None:
        self._actors: list[Any] = []
        self._group: Any = None
        self._pids: list[int] = []

    def start(self, num_workers: int) -> None:
        self._group = placement_group([{"CPU": 1.0}] * num_workers, strategy="PACK")
        ray.get(self._group.ready(), timeout=60)
        actor_cls = ray.remote(num_cpus=1)(EchoActor)
        self._actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, i)
            ).remote()
            for i in range(num_workers)
        ]
        self._pids = ray.get([a.get_pid.remote() for a in self._actors], timeout=60)

    def call(self, payload: np.ndarray) -> list[int]:
        arg = _broadcast_arg(payload)
        return ray.get([a.echo_len.remote(arg) for a in self._actors])

    def call_pipelined(self, payload: np.ndarray, depth: int) -> list[int]:
        refs = []
        for _ in range(depth):
            arg = _broadcast_arg(payload)
            refs += [a.echo_len.remote(arg) for a in self._actors]
        return ray.get(refs)

    def worker_pids(self) -> list[int]:
        return self._pids

    def close(self) -> None:
        for actor in self._actors:
            ray.kill(actor)
        if self._group is not None:
            remove_placement_group(self._group)
        self._actors, self._group = [], None


def _broadcast_arg(payload: np.ndarray) -> Any:
    # Ray inlines small arguments in the call; a large one goes to the object store once per
    # call and every actor reads it from there, as Ray users broadcast.
    return ray.put(payload) if payload.nbytes > _INLINE_MAX_BYTES else payload


RAY_SYSTEM_CLASSES: dict[str, type[System]] = {
    cls.name: cls for cls in (V1EngineRaySystem, RayCallSystem)
}
