"""RayExecutor: one Ray actor per rank instead of a spawned process, so tensor parallelism can
span the nodes of a Ray cluster.

Select it with `distributed_executor_backend="ray"` (`--distributed-executor-backend ray`). It
joins the running cluster (the one this process joined, RAY_ADDRESS, or one started with
`ray start` on this machine) or starts a local one. Each node needs v1engine and the worker
class importable. Everything about calls (ordering, timeouts, non_block, errors) is
GroupExecutor's, as for MultiprocExecutor; RayWorkerGroup owns the actors and the queues that
reach them.
"""

from __future__ import annotations

import ray  # noqa: F401  (an ImportError here makes Executor.get_class say how to install it)

from v1engine.executor.group_executor import GroupExecutor
from v1engine.executor.ray_worker_group import RayWorkerGroup


class RayExecutor(GroupExecutor):
    def _make_group(self) -> RayWorkerGroup:
        return RayWorkerGroup(self.config, self.world_size)
