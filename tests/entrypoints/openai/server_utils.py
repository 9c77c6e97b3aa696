"""A real `python -m v1engine.serve` subprocess for tests, and the tiny checkpoint it serves.

The server listens on port 0 and its start-up line (logged to a file, so no pipe can fill up)
says which port it got. Its engine core and workers are named after their own pids, so the
leak fixture cannot see their resources: `assert_gone` checks them by pid and name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import psutil

from tests.model.checkpoints import make_checkpoint
from tests.process_utils import alive, leftovers
from tests.timeouts import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STARTUP_TIMEOUT_S = 180.0
_LISTENING = re.compile(r"listening on (https?)://([^ ]+):(\d+)")


def make_tiny_checkpoint(directory: str, tokenizer: Any = None, **checkpoint_args: Any) -> str:
    """A random 2-layer llama with SmolLM2's vocabulary, and SmolLM2's tokenizer (and chat
    template) beside it, so the server has real text in and out (`tokenizer`: another one, the
    vocabulary its size; `checkpoint_args`: more of `make_checkpoint`'s). Nothing downloads."""
    from transformers import AutoTokenizer

    from v1engine.model.hf_config import default_model_path, prepare_checkpoint

    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(prepare_checkpoint(default_model_path()))
    path = make_checkpoint(
        directory,
        "llama",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **checkpoint_args,
    )
    tokenizer.save_pretrained(path)
    return path


def serve_module(
    model: str,
    tmp_path_factory: Any,
    *extra_args: str,
    tp: int = 2,
    env: dict[str, str] | None = None,
    verify: ssl.SSLContext | bool = True,
) -> Iterator[RemoteServer]:
    """The body of a module-scoped server fixture (`yield from` it): the server, started; after
    the module, it must stop with exit status 0 and leave nothing behind. `verify`: as httpx's,
    for an HTTPS server (a context trusting its certificate)."""
    log_dir = str(tmp_path_factory.mktemp("server_logs"))
    remote = RemoteServer(model, log_dir, *extra_args, tp=tp, env=env, verify=verify)
    try:
        remote.wait_ready()
        yield remote
        assert remote.stop() == 0, remote.log_text()[-3000:]
        remote.assert_gone()
    finally:
        remote.kill()


class RemoteServer:
    """Starts the server (its environment: this one's, updated with `env`); `url`, `port`,
    `proc` once `wait_ready()` returned."""

    def __init__(
        self,
        model: str,
        log_dir: str,
        *extra_args: str,
        tp: int = 2,
        env: dict[str, str] | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.verify = verify
        self.scheme = "http"
        self.log_path = os.path.join(log_dir, f"server-{time.monotonic_ns()}.log")
        args = [sys.executable, "-m", "v1engine.serve", "--model", model, "--port", "0"]
        args += ["--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", str(tp)]
        args += ["--max-model-len", "256", "--kv-cache-memory-bytes", str(8 << 20)]
        args += list(extra_args)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.port: int | None = None
        self.descendants: list[int] = []

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self) -> RemoteServer:
        deadline = time.monotonic() + scaled(STARTUP_TIMEOUT_S)
        while self.port is None:
            match = _LISTENING.search(self.log_text())
            if match:
                self.scheme, self.port = match.group(1), int(match.group(3))
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server did not start:\n{self.log_text()[-5000:]}")
            else:
                time.sleep(0.2)
        while httpx.get(self.url + "/health", verify=self.verify).status_code != 200:
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"/health never answered 200:\n{self.log_text()[-5000:]}")
            time.sleep(0.1)
        self.descendants = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        return self

    def worker_pids(self) -> list[int]:
        """The engine core's children: one worker per rank."""
        core = [p for p in psutil.Process(self.proc.pid).children() if _is_core(p)]
        assert len(core) == 1, core
        return [p.pid for p in core[0].children()]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Sends `sig`, waits for the exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(scaled(timeout_s))
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.descendants:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()

    def assert_gone(self, limit_s: float = 15.0) -> None:
        """Every process the server started has exited, and nothing named after them is left
        in /dev/shm or the temp directory."""
        pids = [self.proc.pid, *self.descendants]
        deadline = time.monotonic() + scaled(limit_s)
        while time.monotonic() < deadline and (
            any(alive(p) for p in pids) or any(leftovers(p) for p in pids)
        ):
            time.sleep(0.1)
        running = [p for p in pids if alive(p)]
        left = [path for p in pids for path in leftovers(p)]
        assert not running, f"processes left running: {running}"
        assert not left, f"resources left behind: {left}"


def _is_core(proc: psutil.Process) -> bool:
    try:
        return "resource_tracker" not in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def openai_client(server: RemoteServer, api_key: str = "none") -> openai.OpenAI:
    """The official client for `server`: no retries (a test sees every error), a scaled time-out."""
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=scaled(60)
    )


def metric(server: RemoteServer, name: str) -> float:
    """The value of one sample on the server's /metrics, by its full name and labels."""
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def hang_up_once(
    server: RemoteServer,
    path: str,
    body: dict,
    started: Callable[[], bool],
    headers: dict[str, str] | None = None,
) -> None:
    """Posts a non-streamed `body` and closes the connection as soon as `started()` (e.g. a
    request shows as running on /metrics): a client that gives up waiting. Hanging up on that
    event, not after a read time-out, keeps the test independent of how fast the machine is.

    Raises:
        AssertionError: the response arrived first, or nothing started within the time limit.
    """
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}"]
    head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    deadline = time.monotonic() + scaled(30)
    with socket.create_connection(("127.0.0.1", server.port), timeout=scaled(30)) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + payload)
        while not started():
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        sock.setblocking(False)
        try:
            answer = sock.recv(4096)
        except BlockingIOError:
            answer = b""
        assert not answer, f"the response came before the client hung up: {answer[:200]!r}"
