"""The engine process dies (SIGKILL, or SIGTERM with its whole process group) or exits without
shutdown(): workers must follow within about 2 s and take the shared memory and ipc files with
them.
"""

from __future__ import annotations

import os
import signal
import time

from tests.process_utils import start_json_script, wait_gone, wait_no_leftovers
from tests.timeouts import scaled


def _wait_gone(proc, info: dict, limit_s: float) -> float:
    """Seconds until the workers exited and the engine's shm rings and ipc dir (named after the
    engine process, see make_ipc_dir) were removed."""
    start = time.monotonic()
    wait_gone(info["pids"], limit_s)
    wait_no_leftovers(proc.pid, max(0.0, limit_s - (time.monotonic() - start)))
    assert not os.path.exists(info["ipc_dir"])
    return time.monotonic() - start


def test_sigkill_of_the_engine_process_stops_workers_and_cleans_up():
    proc, info = start_json_script("tests.executor.parent_script", "wait")
    assert len(info["pids"]) == 2 and info["shm"], info
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    elapsed = _wait_gone(proc, info, limit_s=5.0)
    assert elapsed < scaled(2.0), f"workers took {elapsed:.2f} s to exit"


def test_exit_without_shutdown_stops_workers_and_cleans_up():
    proc, info = start_json_script("tests.executor.parent_script", "exit")
    assert proc.wait(timeout=scaled(60)) == 0
    _wait_gone(proc, info, limit_s=5.0)


def test_sigterm_to_the_whole_process_group_leaves_nothing_behind():
    """`kill -- -PGID` (a supervisor, a shell's job control): the engine process has no SIGTERM
    handler and dies at once; its workers, which get the signal too, remove its queues."""
    proc, info = start_json_script("tests.executor.parent_script", "group")
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=scaled(60))
    _wait_gone(proc, info, limit_s=scaled(10.0))
