"""Helpers shared by the scripts that drive `python -m v1engine.serve` (lm_eval_parity.py and
langchain_structured.py, whose clients live in their own venvs; bench_startup.py): the venv, and
the server process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx

SERVED_NAME = "v1e"
_LISTENING = re.compile(r"listening on (http://[^ ]+)")


def ensure_venv(venv: str, requirements: list[list[str]], check_import: str, label: str) -> str:
    """The venv's python, creating the venv and installing `requirements` there first unless
    `import check_import` already works in it. Each entry of `requirements` is one pip install,
    in order (so torch can be pinned before a package that would pull another build)."""
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(python) and _run_ok([python, "-c", f"import {check_import}"]):
        return python
    wanted = " ".join(" ".join(r) for r in requirements)
    print(f"{label}: installing {wanted} into {venv} (a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for requirement in requirements:
        subprocess.run(pip + requirement, check=True)
    return python


def _run_ok(args: list[str]) -> bool:
    return subprocess.run(args, capture_output=True).returncode == 0


class Server:
    """`python -m v1engine.serve` on a free port, logging to a file; stopped with SIGTERM."""

    def __init__(
        self,
        model: str,
        log_path: str,
        extra_args: list[str],
        timeout_s: float,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        """Returns once /health answers 200; `ready_s` is how long that took from the launch
        (to within `poll_s`). `cwd`/`env` run another checkout (bench_startup.py's baseline)."""
        args = [sys.executable, "-m", "v1engine.serve", "--model", model, "--port", "0"]
        args += ["--served-model-name", SERVED_NAME, "--dtype", "float32", *extra_args]
        self.log_path = log_path
        self.log = open(log_path, "w")
        start = time.perf_counter()
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd, env=env
        )
        self.url = self._wait_ready(timeout_s, poll_s)
        self.ready_s = time.perf_counter() - start

    def _wait_ready(self, timeout_s: float, poll_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode}; see {self.log_path}")
            with open(self.log_path) as f:
                match = _LISTENING.search(f.read())
            if match and httpx.get(f"{match.group(1)}/health", timeout=5).status_code == 200:
                return match.group(1)
            time.sleep(poll_s)
        self.stop()
        raise TimeoutError(f"the server was not ready in {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
