"""Online serving benchmark: drives `python -m v1engine.serve` over HTTP.

For each request rate (Poisson arrivals, no concurrency cap) and each concurrency cap (all
requests at once, at most that many in flight) it sends the same seeded random prompts as
streaming `/v1/completions` with EOS ignored, so every request produces exactly `--output-len`
tokens, and reports throughput, time to first token (TTFT), inter-token latency (ITL: the gaps
between streamed chunks after the first) and end-to-end latency, p50 and p99.

    python scripts/bench_serve.py --json serve.json                  # starts the default model
    python scripts/bench_serve.py --base-url http://127.0.0.1:8000  # an already running server
    python scripts/bench_serve.py -- --tensor-parallel-size 2 --device cpu   # server flags

Unless `--base-url` is given the script starts the server itself (flags after `--` go to it) on a
free port and stops it with SIGTERM at the end. `--baseline-ref REF` also serves a git worktree of
REF in the same run, and `--repeats N` sweeps each system N times, the order of the systems
alternating; every figure reported is the median over the repeats:

    python scripts/bench_serve.py --baseline-ref 3f118f4 --repeats 3 --concurrencies 1,16 \
        --request-rates "" --json serve.json

`--busy` runs every sweep, the server's start-up included, with one busy process per core
competing, as on a machine whose cores are shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
from _bench_utils import REPO, busy_cores, checkout_env, worktree

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
).split()
_LISTENING = re.compile(r"listening on (http://[^ ]+)")


@dataclass
class RequestResult:
    ok: bool = False
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    num_output_tokens: int = 0
    error: str = ""


def make_prompts(num_requests: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(num_requests)]


async def send_one(
    http: httpx.AsyncClient, model: str, prompt: str, output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result, start = RequestResult(), time.perf_counter()
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.ok = result.num_output_tokens == output_len
    if not result.ok:
        result.error = f"got {result.num_output_tokens} tokens, wanted {output_len}"
    return result


async def run_load(
    base_url: str, model: str, prompts: list[str], args: argparse.Namespace, rate: float, cap: int
) -> tuple[list[RequestResult], float]:
    """Sends every prompt, arrivals `rate`/s (inf: all at once), at most `cap` in flight."""
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(cap)
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:

        async def limited(prompt: str) -> RequestResult:
            async with limit:
                return await send_one(http, model, prompt, args.output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        if len(values) == 1:
            return round(values[0] * 1e3, 3)
        return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3, 3)

    ttft = [r.ttft_s for r in ok]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    return {
        "num_completed": len(ok),
        "num_failed": len(results) - len(ok),
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "output_tokens_per_s": round(sum(r.num_output_tokens for r in ok) / duration_s, 2),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        "e2e_p50_ms": pct(e2e, 50),
        "e2e_p99_ms": pct(e2e, 99),
    }


def start_server(
    server_args: list[str], log_path: str, root: str = REPO
) -> tuple[subprocess.Popen, str]:
    """`python -m v1engine.serve` of the checkout at `root`; (process, base URL)."""
    log = open(log_path, "w")
    command = [sys.executable, "-m", "v1engine.serve", "--port", "0", *server_args]
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=checkout_env(root)
    )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log_path) as f:
            match = _LISTENING.search(f.read())
        if match:
            return proc, match.group(1)
        time.sleep(0.2)
    proc.kill()
    with open(log_path) as f:
        raise RuntimeError(f"the server did not start; its log:\n{f.read()[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server; else start one")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64, help="words per prompt")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request")
    parser.add_argument("--request-rates", default="4,16", help="requests/s, comma-separated")
    parser.add_argument("--concurrencies", default="1,16,64", help="caps, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-ref", default=None, help="git ref served alongside")
    parser.add_argument("--repeats", type=int, default=1, help="sweeps per system (medians)")
    parser.add_argument("--busy", action="store_true", help="one busy process per core")
    parser.add_argument("--json", default=None, help="write the results here")
    args, server_args = parser.parse_known_args()
    if args.base_url and args.baseline_ref:
        parser.error("--baseline-ref starts its own servers; it cannot be used with --base-url")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args, [a for a in server_args if a != "--"]


def run_sweep(args: argparse.Namespace, base_url: str, system: str) -> list[dict]:
    model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
    prompts = make_prompts(args.num_requests, args.input_len, args.seed)
    asyncio.run(run_load(base_url, model, prompts[:2], args, math.inf, 2))  # warm-up
    loads = [(float(r), args.num_requests) for r in args.request_rates.split(",") if r]
    loads += [(math.inf, int(c)) for c in args.concurrencies.split(",") if c]
    records = []
    for rate, cap in loads:
        results, duration_s = asyncio.run(run_load(base_url, model, prompts, args, rate, cap))
        record = {
            "system": system,
            "request_rate": "inf" if math.isinf(rate) else rate,
            "max_concurrency": cap,
            "num_requests": args.num_requests,
            "input_words": args.input_len,
            "output_tokens": args.output_len,
            **summarize(results, duration_s),
        }
        records.append(record)
        print(json.dumps(record), flush=True)
        errors = {r.error for r in results if r.error}
        if errors:
            print(f"  errors: {sorted(errors)[:3]}", flush=True)
    return records


def sweep_system(
    args: argparse.Namespace, server_args: list[str], system: str, root: str | None
) -> list[dict]:
    """One sweep of the server at `args.base_url`, or of one started from the checkout `root`."""
    if root is None:
        return run_sweep(args, args.base_url.rstrip("/"), system)
    log_path = os.path.join(tempfile.gettempdir(), f"bench_serve-{os.getpid()}-{system}.log")
    proc, base_url = start_server(server_args, log_path, root)
    print(f"{system}: started the server at {base_url} (log: {log_path})", flush=True)
    try:
        return run_sweep(args, base_url.rstrip("/"), system)
    finally:
        stop_server(proc)


def medians(runs: list[list[dict]]) -> list[dict]:
    """Per load of a sweep, each numeric figure's median over the sweeps `runs`."""
    merged = []
    for records in zip(*runs):
        record = dict(records[0])
        for key, value in record.items():
            values = [r[key] for r in records if r[key] is not None]
            if isinstance(value, float) and key != "request_rate" and values:
                record[key] = round(statistics.median(values), 3)
        merged.append(record)
    return merged


def main() -> None:
    args, server_args = parse_args()
    with worktree(args.baseline_ref) as baseline:
        systems = {"v1engine": None if args.base_url else REPO}
        if baseline:
            systems = {"current": REPO, "baseline": baseline}
        runs: dict[str, list[list[dict]]] = {name: [] for name in systems}
        for repeat in range(args.repeats):
            for name in list(systems) if repeat % 2 == 0 else list(systems)[::-1]:
                with busy_cores(args.busy):
                    runs[name].append(sweep_system(args, server_args, name, systems[name]))
    results = [record for sweeps in runs.values() for record in medians(sweeps)]
    if args.repeats > 1 or baseline:
        print(f"medians over {args.repeats} sweep(s) per system:")
        for record in results:
            print(json.dumps(record), flush=True)
    if args.json:
        machine = {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "server_args": server_args,
            "base_url": args.base_url,
            "baseline_ref": args.baseline_ref,
            "repeats": args.repeats,
            "busy": args.busy,
        }
        try:
            import torch

            machine.update(torch=torch.__version__, cuda=torch.cuda.is_available())
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "results": results, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
