"""The Ray cluster side of RayExecutor: joining the cluster, reserving one bundle per rank, and
deciding which actor gets which rank.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from v1engine.executor.ray_worker import NodeInfo
from v1engine.logger import init_logger

logger = init_logger(__name__)

PLACEMENT_TIMEOUT_S = 60.0


def connect_ray() -> bool:
    """Joins the running Ray cluster: the one this process already joined, else the one at
    RAY_ADDRESS or started on this machine with `ray start`, else starts a local one.

    Returns: True when this call started Ray, so the caller must shut it down.
    """
    if ray.is_initialized():
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:
        logger.info("no running Ray cluster found; starting a local one")
    ray.init(include_dashboard=False)
    return True


def reserve_placement_group(world_size: int, use_gpu: bool) -> PlacementGroup:
    """One bundle per rank ({"GPU": 1} on CUDA, {"CPU": 1} on CPU), packed on as few nodes as
    fit, so ranks share a node where they can.

    Raises:
        RuntimeError: the cluster lacks the resources, or they did not free up in time; the
            message says how much there is and how to get more.
    """
    resource = "GPU" if use_gpu else "CPU"
    total = ray.cluster_resources().get(resource, 0.0)
    if total < world_size:
        raise RuntimeError(_missing(world_size, resource, "the cluster has only", total))
    group = placement_group([{resource: 1.0}] * world_size, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        free = ray.available_resources().get(resource, 0.0)
        reason = f"after {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {total:g} {resource}, free"
        raise RuntimeError(_missing(world_size, resource, reason, free))
    return group


def _missing(world_size: int, resource: str, reason: str, amount: float) -> str:
    return (
        f"Ray could not reserve {world_size} x {{'{resource}': 1}} (one bundle per rank of "
        f"tensor_parallel_size={world_size}): {reason} {amount:g} {resource}; add nodes "
        "(`ray start --address=<head>:6379` on each), free resources, or lower "
        "tensor_parallel_size"
    )


def order_ranks(infos: list[NodeInfo], driver_node_id: str) -> list[int]:
    """Actor indices in rank order: the driver's node first (rank 0 shares the engine's node
    and its shared memory), then the other nodes in the order their first actor appears.
    """
    nodes = list(dict.fromkeys(info.node_id for info in infos))
    nodes.sort(key=lambda node: node != driver_node_id)  # stable: keeps the rest in order
    return [i for node in nodes for i, info in enumerate(infos) if info.node_id == node]


def local_ranks(infos: list[NodeInfo]) -> list[int]:
    """For ranks in order: the index of each among the ranks of its node."""
    seen: dict[str, int] = {}
    out = []
    for info in infos:
        out.append(seen.get(info.node_id, 0))
        seen[info.node_id] = out[-1] + 1
    return out


def cuda_visible_devices(infos: list[NodeInfo]) -> list[str | None]:
    """For ranks in order: the GPUs of every rank on the same node, in local-rank order, so
    `cuda:{local_rank}` is the rank's own GPU. None on CPU."""
    per_node: dict[str, list[str]] = {}
    for info in infos:
        per_node.setdefault(info.node_id, []).extend(info.gpu_ids)
    return [",".join(per_node[info.node_id]) if info.gpu_ids else None for info in infos]
