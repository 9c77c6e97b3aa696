"""Helpers for tests that watch processes from outside: an engine in a subprocess, workers that
must exit, leftovers named after the process that made them (see `make_ipc_dir`).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from tests.timeouts import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as dead."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], limit_s: float) -> float:
    """Seconds until every pid exited; after `limit_s` (scaled) kills the rest and fails the
    test."""
    limit_s = scaled(limit_s)
    start = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - start > limit_s:
            for pid in filter(alive, pids):
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"processes still running after {limit_s} s: {pids}")
        time.sleep(0.02)
    return time.monotonic() - start


def leftovers(pid: int) -> list[str]:
    """/dev/shm entries and ipc directories named after process `pid` (see make_ipc_dir)."""
    prefix = f"v1engine-{pid}-"
    return glob.glob(f"/dev/shm/{prefix}*") + glob.glob(f"{tempfile.gettempdir()}/{prefix}*")


def wait_no_leftovers(pid: int, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + scaled(limit_s)
    while leftovers(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leftovers(pid)


def start_json_script(module: str, mode: str) -> tuple[subprocess.Popen, dict]:
    """Runs `python -m module mode` from the repository root and returns it with the JSON object
    it prints on its first line (what it started: pids, paths)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=mode == "group",  # its own process group, for a signal to all of it
    )
    line = proc.stdout.readline()
    proc.stdout.close()
    if not line:
        proc.kill()
        proc.wait()
        pytest.fail(f"{module} {mode} exited before reporting what it started")
    return proc, json.loads(line)


def run_script(script: str, *args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """Runs `python script args...` as a user would, with the repository importable (the script
    may live in a temporary directory), and fails the test unless it exits 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done
