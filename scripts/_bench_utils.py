"""What the benchmarks share: the machine they ran on (their `--json` "machine"), its read
bandwidth, busy cores, and a git worktree of a baseline commit to measure beside the current code
in the same run."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager


def cpu_machine_info() -> dict:
    import torch

    return {
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "device": "cpu",
        "python": platform.python_version(),
    }


def cuda_machine_info() -> dict:
    import torch

    return {
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op pool at `threads` threads while inside, then as it was."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def best_seconds(call, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls of `call()`."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth_gb_s(threads: int) -> float:
    """GB/s that `threads` threads read at: summing 1 GiB of float32, best of 5."""
    import torch

    with torch_threads(threads):
        data = torch.ones(256 << 20)
        return data.numel() * 4 / best_seconds(data.sum) / 1e9


def onednn_linear(x, weight):
    """oneDNN's linear (what the engine runs prefills with on non-Intel CPUs)."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def matmul_peak_gflop_s(threads: int, dtype, in_features: int, out_features: int) -> float:
    """The fastest GFLOP/s `threads` threads reach on a prefill-sized matmul (2,048 rows of
    `in_features` times a weight [out_features, in_features]): best of 5 calls of MKL's `F.linear`
    and of oneDNN's linear, whichever is faster here (the engine takes the faster on each CPU)."""
    import torch
    import torch.nn.functional as F

    with torch_threads(threads), torch.inference_mode():
        x = torch.randn(2048, in_features).to(dtype)
        weight = torch.randn(out_features, in_features).to(dtype)
        best = float("inf")
        for matmul in (F.linear, onednn_linear):
            matmul(x, weight)  # warm-up: oneDNN builds its kernel on a shape's first call
            best = min(best, best_seconds(functools.partial(matmul, x, weight)))
        return 2 * x.shape[0] * in_features * out_features / best / 1e9


@contextmanager
def busy_cores(enabled: bool = True) -> Iterator[None]:
    """One busy process (`yes > /dev/null`) per core this process may use, while inside."""
    procs = []
    if enabled:
        for _ in range(len(os.sched_getaffinity(0))):
            procs.append(subprocess.Popen(["yes"], stdout=subprocess.DEVNULL))
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextmanager
def worktree(ref: str | None) -> Iterator[str | None]:
    """A detached git worktree of `ref` (None: no baseline), removed at the end."""
    if ref is None:
        yield None
        return
    path = tempfile.mkdtemp(prefix="v1e-baseline-")
    subprocess.run(["git", "worktree", "add", "--detach", path, ref], cwd=REPO, check=True,
                   capture_output=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO, check=True)


def checkout_env(root: str) -> dict[str, str]:
    """The environment that makes a child process import v1engine from the checkout at `root`.
    Run the child with cwd=root too: `python -m` puts the working directory ahead of PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": root}
