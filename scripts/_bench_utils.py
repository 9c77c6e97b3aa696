"""What the CPU benchmarks record about the machine they ran on (their `--json` "machine")."""

from __future__ import annotations

import os
import platform
import subprocess
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
