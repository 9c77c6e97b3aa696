"""Helpers for the engine-process tests: requests, collecting outputs, and checking that
processes and their named resources are gone.
"""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import time

import pytest

from v1engine.request import EngineCoreRequest
from v1engine.sampling_params import SamplingParams


def core_request(request_id: str, prompt: list[int], max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens))


def collect(client, request_ids: set[str], timeout_s: float = 10.0) -> dict:
    """Outputs until every request in `request_ids` finished: id -> (tokens, finish reason)."""
    results: dict[str, tuple[list[int], str | None]] = {}
    deadline = time.monotonic() + timeout_s
    while not all(results.get(r, ([], None))[1] for r in request_ids):
        for out in client.get_output(timeout=max(0.0, deadline - time.monotonic())).outputs:
            tokens = results.get(out.request_id, ([], None))[0] + out.new_token_ids
            results[out.request_id] = (tokens, out.finish_reason and str(out.finish_reason))
    return results


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], limit_s: float) -> float:
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
    deadline = time.monotonic() + limit_s
    while leftovers(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leftovers(pid)
