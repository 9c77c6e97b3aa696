"""Run as a subprocess by test_parent_death.py: start an executor, report what it created on
stdout as one JSON line, then either wait to be killed ("wait"; "group": the same, in a process
group of its own with its workers) or exit without calling shutdown() ("exit").
"""

from __future__ import annotations

import json
import os
import sys
import time

from v1engine.config import EngineConfig, ParallelConfig
from v1engine.executor.multiproc_executor import MultiprocExecutor


def main(mode: str) -> None:
    config = EngineConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=2, worker_cls="tests.executor.rpc_worker.RPCTestWorker"
        )
    )
    executor = MultiprocExecutor(config)
    pids = executor.collective_rpc("get_pid")
    ipc_dir = executor._group.ipc_dir
    shm = sorted(n for n in os.listdir("/dev/shm") if n.startswith(os.path.basename(ipc_dir)))
    print(json.dumps({"pids": pids, "ipc_dir": ipc_dir, "shm": shm}), flush=True)
    if mode in ("wait", "group"):
        executor.collective_rpc("sleep", args=(60.0,), non_block=True)  # killed mid-call
        time.sleep(120)
    # mode == "exit": leave without shutdown(); the finalizer must clean up.


if __name__ == "__main__":
    main(sys.argv[1])
