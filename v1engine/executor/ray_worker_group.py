"""RayWorkerGroup: one Ray actor per rank, reached through the same queues as WorkerGroup.

The group offers WorkerGroupBase's surface (broadcast_mq, response_mqs, dead_worker,
is_shut_down, start_monitor, shutdown), so GroupExecutor's call bookkeeping drives it as it drives
WorkerGroup. Calls never go through Ray: per step, a Ray actor call costs about a millisecond,
our queues tens of microseconds (scripts/bench_rpc.py --backend ray). Ranks on the engine's node
read the broadcast from shared memory and reply through it; ranks on other nodes use the queues'
TCP leg, chosen by Ray node id, not host name, so two nodes on one host still talk over TCP.

A monitor thread watches each actor's `serve()` ObjectRef: one that ends while the engine runs
means the actor (or its node) died, and names the rank. `shutdown()` asks the workers to stop,
kills the actors, removes the placement group and, if the engine started Ray, stops it.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from v1engine.executor.message_queue import MessageQueue
from v1engine.executor.ray_cluster import (
    connect_ray,
    cuda_visible_devices,
    local_ranks,
    order_ranks,
    reserve_placement_group,
)
from v1engine.executor.ray_worker import NodeInfo, RayWorker
from v1engine.executor.worker_group import WorkerGroupBase
from v1engine.executor.worker_proc import WorkerReady, worker_env_defaults
from v1engine.logger import init_logger
from v1engine.process import (
    GRACEFUL_STOP_S,
    WORKER_STARTUP_TIMEOUT_S,
    get_distributed_init_method,
)

logger = init_logger(__name__)

# ray.kill returns at once; Ray takes a moment to see the actor gone and free its resources.
_KILL_WAIT_S = 5.0
_MONITOR_SLICE_S = 0.25  # only bounds how long the monitor takes to notice shutdown()


class RayWorkerGroup(WorkerGroupBase):
    def __init__(self, config: Any, world_size: int) -> None:
        super().__init__()
        self.actors: list[Any] = []  # in rank order
        self.node_infos: list[NodeInfo] = []  # in rank order
        self._serve_refs: list[Any] = []
        self._placement_group = None
        self._started_ray = False
        try:
            self._started_ray = connect_ray()
            self._start(config, world_size)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: Any, world_size: int) -> None:
        use_gpu = config.device_config.device_type == "cuda"
        self._placement_group = reserve_placement_group(world_size, use_gpu)
        self._place_actors(world_size, use_gpu)
        readies = self._start_workers(config, world_size)
        self._serve_refs = [actor.serve.remote() for actor in self.actors]
        self._attach_response_queues(readies)

    def _place_actors(self, world_size: int, use_gpu: bool) -> None:
        """One actor per bundle; then self.actors and self.node_infos in rank order."""
        actor_cls = ray.remote(num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0)(
            RayWorker
        )
        # The OpenMP wait policy multiprocess workers get (worker_proc says why); a Ray worker's
        # environment comes from its node's raylet, so it travels in the actor's runtime_env.
        env = {k: v for k, v in worker_env_defaults().items() if k not in os.environ}
        self.actors = [  # set at once, so shutdown() kills them even if the rest fails
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=i
                ),
                runtime_env={"env_vars": env},
            ).remote()
            for i in range(world_size)
        ]
        try:
            refs = [actor.get_node_info.remote() for actor in self.actors]
            infos = ray.get(refs, timeout=WORKER_STARTUP_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(
                f"a Ray actor for the workers could not start ({describe_actor_death(e)}); "
                "every node needs v1engine and the worker class importable"
            ) from None
        order = order_ranks(infos, ray.get_runtime_context().get_node_id())
        self.actors = [self.actors[i] for i in order]
        self.node_infos = [infos[i] for i in order]
        logger.info(
            "Ray executor: %d rank(s) on %d node(s): %s",
            world_size,
            len({info.node_id for info in infos}),
            ", ".join(
                f"rank {r} on node {i.node_id[:8]} ({i.ip})" for r, i in enumerate(self.node_infos)
            ),
        )

    def _start_workers(self, config: Any, world_size: int) -> list[WorkerReady]:
        driver_node_id = ray.get_runtime_context().get_node_id()
        is_local = [info.node_id == driver_node_id for info in self.node_infos]
        self.broadcast_mq = MessageQueue(
            world_size,
            ipc_dir=self.ipc_dir,
            n_local_reader=sum(is_local),  # order_ranks put them first
            remote_host=ray.util.get_node_ip_address(),
        )
        # Rank 0 hosts torch.distributed's store: on the driver's node whenever it has a rank.
        init_method = get_distributed_init_method(
            self.node_infos[0].ip, self.node_infos[0].free_port
        )
        visible = cuda_visible_devices(self.node_infos)
        per_node = Counter(info.node_id for info in self.node_infos)
        refs = []
        for rank, local_rank in enumerate(local_ranks(self.node_infos)):
            response_host = None if is_local[rank] else self.node_infos[rank].ip
            args = self._worker_args(config, rank, local_rank, init_method, response_host)
            node_ranks = per_node[self.node_infos[rank].node_id]
            refs.append(self.actors[rank].start.remote(args, visible[rank], node_ranks))
        return self._wait_for_ready(refs)

    def _wait_for_ready(self, refs: list[Any]) -> list[WorkerReady]:
        """Collects every rank's READY (`WorkerReady`); the first rank to fail ends the wait with
        its traceback, so a broken worker never hangs the engine."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        readies: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + WORKER_STARTUP_TIMEOUT_S
        while len(readies) < len(refs):
            pending = [ref for ref, rank in rank_of.items() if rank not in readies]
            ready, _ = ray.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"workers did not start within {WORKER_STARTUP_TIMEOUT_S:.0f} s")
            rank = rank_of[ready[0]]
            try:
                readies[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(
                    f"worker rank {rank} died during start-up ({describe_actor_death(e)})"
                ) from None
            except ray.exceptions.RayTaskError as e:
                raise RuntimeError(f"worker rank {rank} failed to start:\n{e}") from None
        return [readies[rank] for rank in range(len(refs))]

    # -- monitoring and shut-down ------------------------------------------------------------
    def _wait_for_death(self) -> tuple[int, str] | None:
        rank_of = {ref: rank for rank, ref in enumerate(self._serve_refs)}
        ready: list[Any] = []
        while not ready:
            if self.is_shut_down:
                return None
            ready, _ = ray.wait(list(rank_of), num_returns=1, timeout=_MONITOR_SLICE_S)
        return rank_of[ready[0]], _describe_end(ready[0])

    def _stop_workers(self) -> None:
        """Graceful stop, then ray.kill; then the placement group goes."""
        if not ray.is_initialized():
            return  # Ray already shut down (at interpreter exit): it ended the actors itself
        if self._ask_workers_to_stop():
            # Lets each worker run its shutdown() (leave the process group, free memory).
            ray.wait(self._serve_refs, num_returns=len(self._serve_refs), timeout=GRACEFUL_STOP_S)
        for actor in self.actors:
            ray.kill(actor)
        if self._serve_refs:  # their ends confirm the kills: Ray has seen each actor die
            ray.wait(self._serve_refs, num_returns=len(self._serve_refs), timeout=_KILL_WAIT_S)
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)

    def _kill_workers(self) -> None:
        if ray.is_initialized():
            for actor in self.actors:
                ray.kill(actor)  # returns at once; _stop_workers waits for Ray to confirm

    def _release(self) -> None:
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def _describe_end(serve_ref: Any) -> str:
    try:
        ray.get(serve_ref, timeout=0)
    except ray.exceptions.RayActorError as e:
        return describe_actor_death(e)
    except ray.exceptions.RayTaskError as e:
        return f"its serve loop raised:\n{e}"
    return "its serve loop returned while the engine was running"


def describe_actor_death(error: Exception) -> str:
    """Ray's reason, on one line: which actor and node, and why its process ended (without
    Ray's generic list of common causes)."""
    text = " ".join(str(error).split()).split(" Some common causes")[0]
    return f"Ray actor died: {text[:400]}"
