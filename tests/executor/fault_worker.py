"""FailingStepWorker: the built-in Worker with a fault to inject on rank 1, for the end-to-end
fault tests (LLM, HTTP server, Ray executor).

A test arms the fault with `inject_fault(model_dir, action, after_steps)`, which writes a file
into the model directory: rank 1 then raises in (action "raise") or SIGKILLs itself at (action
"kill") each `execute_model` call after its `after_steps`-th. Rank 1 reads the file on every
step, so a test can also arm it while requests stream. Each engine gets a model directory of its
own (`private_model_dir`), so a fault reaches only that engine.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from v1engine.worker.gpu_worker import Worker

FAILING_STEP_WORKER = "tests.executor.fault_worker.FailingStepWorker"
FAULT_RANK = 1
_FAULT_FILE = "INJECT_FAULT"


class FailingStepWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_steps = 0

    def execute_model(self, scheduler_output: Any) -> Any:
        self.num_steps += 1
        if self.rank == FAULT_RANK:
            fault = _read_fault(self.config.model_config.model)
            if fault is not None and self.num_steps > fault[1]:
                if fault[0] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(
                    f"injected fault in execute_model on rank {self.rank} (step {self.num_steps})"
                )
        return super().execute_model(scheduler_output)


def inject_fault(model_dir: str, action: str, after_steps: int = 0) -> None:
    """Arms rank 1's fault in every engine serving `model_dir` (see the module doc)."""
    if action not in ("raise", "kill"):
        raise ValueError(f"action must be 'raise' or 'kill', got {action!r}")
    path = os.path.join(model_dir, _FAULT_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(f"{action} {after_steps}")
    os.replace(path + ".tmp", path)  # rank 1 never reads half a file


def _read_fault(model_dir: str) -> tuple[str, int] | None:
    try:
        with open(os.path.join(model_dir, _FAULT_FILE)) as f:
            action, after_steps = f.read().split()
    except FileNotFoundError:
        return None
    return action, int(after_steps)


def private_model_dir(source_dir: str, directory: str) -> str:
    """`directory` with a link to every file of the checkpoint `source_dir`: the same model,
    in a directory whose fault file is this engine's own."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(source_dir):
        os.symlink(os.path.join(source_dir, name), os.path.join(directory, name))
    return directory
