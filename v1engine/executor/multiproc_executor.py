"""MultiprocExecutor: one spawned WorkerProc per rank on this node, driven over shared-memory
queues. Start-up and shut-down are WorkerGroup's (worker_group.py); calls are GroupExecutor's
(group_executor.py).
"""

from __future__ import annotations

from v1engine.executor.group_executor import GroupExecutor
from v1engine.executor.worker_group import WorkerGroup
from v1engine.process import get_distributed_init_method


class MultiprocExecutor(GroupExecutor):
    def _make_group(self) -> WorkerGroup:
        return WorkerGroup(self.config, self.world_size, get_distributed_init_method())
