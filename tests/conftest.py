"""Suite-wide fixtures. The leak check is autouse: a test that leaves a child process, a /dev/shm
segment or an ipc directory behind fails, and the leftovers are cleaned so later tests start clean.
Subprocess-driven tests (an engine in another process) check their own leftovers by name.
"""

from __future__ import annotations

import os

import torch  # it does not import triton

from tests.timeouts import scaled

# Triton runs CPU tensors only under its interpreter, which must be set before triton loads. With
# a GPU the compiled kernels are what to test: the interpreter is then off unless asked for, and
# the tests that give Triton CPU tensors skip (tests/model/test_triton_attention.py).
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
# pytest-timeout's per-test limit, scaled with every other limit (an explicit --timeout wins).
os.environ.setdefault("PYTEST_TIMEOUT", str(scaled(300)))

import gc  # noqa: E402
import glob  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402

from tests.ray_cluster import owned_by_cluster  # noqa: E402

_SHM_DIR = "/dev/shm"
_GRACE_S = 5.0


def _children() -> dict[int, str]:
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        # multiprocessing's resource tracker lives as long as the test session by design; a
        # live Ray test cluster runs its own worker pool and checks it is gone at its teardown.
        if "resource_tracker" in cmdline or owned_by_cluster(proc):
            continue
        found[proc.pid] = cmdline[:200]
    return found


# Engine resources are named after the process that created them (`make_ipc_dir`), so concurrent
# test runs on one machine never blame or delete each other's segments.
_OURS = f"v1engine-{os.getpid()}-"


def _shm_entries() -> set[str]:
    if not os.path.isdir(_SHM_DIR):
        return set()
    return {name for name in os.listdir(_SHM_DIR) if name.startswith(_OURS)}


def _ipc_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), _OURS + "*")))


def _snapshot() -> tuple[dict[int, str], set[str], set[str]]:
    return _children(), _shm_entries(), _ipc_dirs()


def _leaks(before) -> list[str]:
    procs0, shm0, ipc0 = before
    procs1, shm1, ipc1 = _snapshot()
    leaks = [f"process {pid}: {cmd}" for pid, cmd in procs1.items() if pid not in procs0]
    leaks += [f"/dev/shm/{name}" for name in sorted(shm1 - shm0)]
    leaks += [f"ipc dir {path}" for path in sorted(ipc1 - ipc0)]
    return leaks


def _clean_up(before) -> None:
    procs0, shm0, ipc0 = before
    for pid in set(_children()) - set(procs0):
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    for name in _shm_entries() - shm0:
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
        except OSError:
            pass
    for path in _ipc_dirs() - ipc0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fails the test that leaves processes, shared memory or ipc files behind."""
    before = _snapshot()
    yield
    leaks = _leaks(before)
    if leaks:
        # Objects the test dropped in reference cycles release their resources at collection:
        # collect now, not at random in a later test. Only when needed: with torch and
        # transformers loaded a full collection takes ~0.1 s, a minute or two over the suite.
        gc.collect()
        leaks = _leaks(before)
    deadline = time.monotonic() + scaled(_GRACE_S)
    while leaks and time.monotonic() < deadline:
        time.sleep(0.05)
        leaks = _leaks(before)
    if leaks:
        _clean_up(before)
        pytest.fail("test left resources behind:\n  " + "\n  ".join(leaks), pytrace=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_xdist_auto_num_workers(config):
    """How many test files run at once under `-n auto` (pyproject's default). Two where torch
    sees no GPU and at least two cores are ours: most of a test's time is spent starting
    processes, importing and waiting on sockets, so a second file fills the idle core (the
    suite on 2 cores: 672 s one at a time, 471 s two at a time). One at a time, in this process,
    where a GPU is visible (every engine sizes its KV cache from the memory it sees free, so two
    at once would take each other's) or on one core. PYTEST_XDIST_AUTO_NUM_WORKERS (xdist's own)
    still wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    if torch.cuda.is_available():
        return 0
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 0
