"""A simulated multi-node Ray cluster on this machine, for the Ray executor tests.

`start_cluster(num_nodes)` starts a head and num_nodes - 1 worker nodes (one CPU each) with
`ray.cluster_utils.Cluster`, all of Ray's files in a private temp dir, and joins it. Ray's
daemons (GCS, raylets, ...) start and reap worker processes on their own schedule, so the
suite's leak check leaves the descendants of a live cluster's daemons alone (`owned_by_cluster`);
in exchange, `stop_cluster` fails unless every process of the cluster is gone, and the tests check
after each executor's shutdown that Ray holds no live actor and no placement group.

Ray is imported only inside the functions: conftest imports this module for every test run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

_cluster_daemon_pids: set[int] = set()
_GONE_TIMEOUT_S = 15.0


def owned_by_cluster(proc: psutil.Process) -> bool:
    """True for a process of a live test cluster: a daemon, or one a daemon started."""
    if not _cluster_daemon_pids:
        return False
    try:
        return proc.pid in _cluster_daemon_pids or any(
            p.pid in _cluster_daemon_pids for p in proc.parents()
        )
    except psutil.Error:
        return False


@dataclass
class TestCluster:
    cluster: Any
    temp_dir: str
    saved_env: dict[str, str | None] = field(default_factory=dict)


def start_cluster(num_nodes: int) -> TestCluster:
    import ray
    from ray.cluster_utils import Cluster

    me = psutil.Process()
    before = {p.pid for p in me.children()}
    # Short path: Ray's unix sockets live under it. RAY_TMPDIR also keeps Ray's address file
    # (normally /tmp/ray/ray_current_cluster) private to this cluster.
    temp_dir = tempfile.mkdtemp(prefix="v1e-ray-")
    saved = {"RAY_TMPDIR": os.environ.get("RAY_TMPDIR")}
    os.environ["RAY_TMPDIR"] = temp_dir
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    test_cluster = TestCluster(cluster, temp_dir, saved)
    _cluster_daemon_pids.update(p.pid for p in me.children() if p.pid not in before)
    for _ in range(num_nodes - 1):
        cluster.add_node(num_cpus=1)
    _cluster_daemon_pids.update(p.pid for p in me.children() if p.pid not in before)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return test_cluster


def stop_cluster(test_cluster: TestCluster) -> list[str]:
    """Stops Ray and returns what is still running or left on disk (empty when clean)."""
    import ray

    procs = [p for p in psutil.Process().children(recursive=True) if owned_by_cluster(p)]
    ray.shutdown()
    test_cluster.cluster.shutdown()
    _, alive = psutil.wait_procs(procs, timeout=_GONE_TIMEOUT_S)
    _cluster_daemon_pids.clear()
    left = [f"process {p.pid}: {' '.join(_cmdline(p))[:160]}" for p in alive]
    for p in alive:
        p.kill()
    shutil.rmtree(test_cluster.temp_dir, ignore_errors=True)
    for key, value in test_cluster.saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return left


def ray_leftovers(timeout_s: float = 10.0) -> list[str]:
    """Actors not DEAD and placement groups not REMOVED, after waiting up to `timeout_s` for
    Ray to finish what a shutdown started (ray.kill and group removal are asynchronous)."""
    import ray
    from ray._private import state

    deadline = time.monotonic() + timeout_s
    while True:
        left = [
            f"actor {a['ActorID']} ({a['ActorClassName']}): {a['State']}"
            for a in state.actors().values()
            if a["State"] != "DEAD"
        ]
        left += [
            f"placement group {g['placement_group_id']}: {g['state']}"
            for g in ray.util.placement_group_table().values()
            if g["state"] != "REMOVED"
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return ["?"]
