"""Which v1engine files one chat request crosses, in every process, in the order it reaches them.

    .venv/bin/python scripts/trace_request_files.py [--model PATH] [--functions] [--json out.json]

Starts `python -m v1engine.serve` (default model, TP=1 unless `--tensor-parallel-size`) with a
profiler installed in every process it starts (a `sitecustomize` on PYTHONPATH, which spawned
engine-core and worker processes inherit), sends one warm-up chat request, then one traced chat
request. A function call counts when it starts inside the traced window; a file counts once, at
its first call (`--functions` also prints, per file, the functions the request entered).
Start-up and the warm-up request are excluded, so what is listed is the request's own path:
HTTP -> processor -> engine-core client -> core -> executor -> worker -> model -> back.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs at start-up of every Python process under PYTHONPATH: records first calls into v1engine/
# while MARK_DIR/start exists and MARK_DIR/stop does not, and writes them out at stop.
_SITECUSTOMIZE = r"""
import os, sys, threading, time, json
_dir = os.environ.get("V1ENGINE_TRACE_DIR")
if _dir:
    _pkg = os.path.join(os.environ["V1ENGINE_TRACE_REPO"], "v1engine") + os.sep
    _first = {}
    _functions = {}
    _on = [False]

    def _profile(frame, event, arg):
        if event == "call" and _on[0]:
            code = frame.f_code
            name = code.co_filename
            if name.startswith(_pkg):
                if name not in _first:
                    _first[name] = time.time()
                    _functions[name] = []
                if code.co_qualname not in _functions[name]:
                    _functions[name].append(code.co_qualname)
        return None

    def _watch():
        start, stop = os.path.join(_dir, "start"), os.path.join(_dir, "stop")
        while not os.path.exists(start):
            time.sleep(0.005)
        _on[0] = True
        while not os.path.exists(stop):
            time.sleep(0.005)
        _on[0] = False
        with open(os.path.join(_dir, f"{os.getpid()}.json"), "w") as f:
            json.dump({"first": _first, "functions": _functions}, f)

    sys.setprofile(_profile)
    threading.setprofile(_profile)
    threading.Thread(target=_watch, daemon=True).start()
"""


def _chat(port: int, content: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the server was not healthy within {timeout_s:.0f} s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trace(args: argparse.Namespace, trace_dir: str) -> list[tuple[float, str, list[str]]]:
    with open(os.path.join(trace_dir, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)
    marks = os.path.join(trace_dir, "marks")
    os.mkdir(marks)
    env = dict(os.environ, V1ENGINE_TRACE_DIR=marks, V1ENGINE_TRACE_REPO=_REPO)
    env["PYTHONPATH"] = os.pathsep.join([trace_dir, _REPO, env.get("PYTHONPATH", "")])
    port = _free_port()
    command = [sys.executable, "-m", "v1engine.serve", "--port", str(port)]
    command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.model:
        command += ["--model", args.model]
    proc = subprocess.Popen(command, env=env, cwd=_REPO)
    try:
        _wait_healthy(port, proc, args.startup_timeout_s)
        _chat(port, "Say hello.", 4)  # warm-up: lazy imports and first-call paths
        open(os.path.join(marks, "start"), "w").close()
        time.sleep(0.2)  # every process's watcher sees the mark
        _chat(port, "What is the capital of France?", args.max_tokens)
        time.sleep(0.2)  # the last outputs' bookkeeping in the core and workers
        open(os.path.join(marks, "stop"), "w").close()
        time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    first: dict[str, float] = {}
    functions: dict[str, list[str]] = {}
    for name in os.listdir(marks):
        if name.endswith(".json"):
            with open(os.path.join(marks, name)) as f:
                recorded = json.load(f)
            for path, t in recorded["first"].items():
                first[path] = min(t, first.get(path, t))
                seen = functions.setdefault(path, [])
                seen += [q for q in recorded["functions"][path] if q not in seen]
    return sorted((t, path, functions[path]) for path, t in first.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--json", default=None, help="write the file list here")
    parser.add_argument(
        "--functions", action="store_true", help="also print the functions entered in each file"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="v1engine-trace-") as trace_dir:
        calls = trace(args, trace_dir)
    rows = []
    for _, path, functions in calls:
        with open(path) as f:
            num_lines = sum(1 for _ in f)
        rows.append(
            {"file": os.path.relpath(path, _REPO), "lines": num_lines, "functions": functions}
        )
    for i, row in enumerate(rows, 1):
        print(f"{i:3d}  {row['lines']:4d}  {row['file']}")
        if args.functions:
            print("           " + ", ".join(row["functions"]))
    total = sum(row["lines"] for row in rows)
    print(f"{len(rows)} files, {total} lines")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_files": len(rows), "num_lines": total, "files": rows}, f, indent=1)


if __name__ == "__main__":
    main()
