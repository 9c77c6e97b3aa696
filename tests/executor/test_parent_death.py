"""The engine process dies (SIGKILL) or exits without shutdown(): workers must follow within
about 2 s and take the shared memory and ipc files with them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(mode: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.executor.parent_script", mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        proc.wait()
        pytest.fail("the parent script did not start its executor")
    return proc, json.loads(line)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(info: dict, limit_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        leftovers = [p for p in info["pids"] if _alive(p)]
        leftovers += [n for n in info["shm"] if os.path.exists(f"/dev/shm/{n}")]
        if not leftovers and not os.path.exists(info["ipc_dir"]):
            return time.monotonic() - start
        time.sleep(0.05)
    for pid in info["pids"]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    pytest.fail(f"left behind after {limit_s} s: {leftovers}, ipc dir {info['ipc_dir']}")


def test_sigkill_of_the_engine_process_stops_workers_and_cleans_up():
    proc, info = _start("wait")
    assert len(info["pids"]) == 2 and info["shm"], info
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    elapsed = _wait_gone(info, limit_s=5.0)
    assert elapsed < 2.0, f"workers took {elapsed:.2f} s to exit"


def test_exit_without_shutdown_stops_workers_and_cleans_up():
    proc, info = _start("exit")
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()
    _wait_gone(info, limit_s=5.0)
