"""Run as a subprocess by test_core_client.py: start a SyncMPClient, print what it created
as one JSON line, then either wait mid-generation to be killed or exit without shutdown().
"""

from __future__ import annotations

import json
import sys
import time

from tests.core.counting_worker import make_config
from tests.engine.sync_client import SyncMPClient
from tests.timeouts import scaled
from v1engine.request import EngineCoreRequest
from v1engine.sampling_params import SamplingParams


def main(mode: str) -> None:
    client = SyncMPClient(make_config())
    worker_pids = client.collective_rpc("get_pid")
    info = {"core_pid": client.core_pid, "worker_pids": worker_pids}
    info["ipc_dir"] = client.resources.ipc_dir
    if mode == "wait":
        client.collective_rpc("set_step_delay", args=(0.05,))
        client.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=50)))
        client.get_output(timeout=scaled(10))
    print(json.dumps(info), flush=True)
    if mode == "wait":
        time.sleep(120)  # killed here, mid-generation
    # mode == "exit": leave without shutdown(); the exit hook must stop the engine.


if __name__ == "__main__":
    main(sys.argv[1])
