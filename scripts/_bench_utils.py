"""What the CPU benchmarks record about the machine they ran on (their `--json` "machine")."""

from __future__ import annotations

import os
import platform


def cpu_machine_info() -> dict:
    import torch

    return {
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "device": "cpu",
        "python": platform.python_version(),
    }
