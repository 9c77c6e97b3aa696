"""RPC latency: v1engine's `MultiprocExecutor.collective_rpc` against `multiprocessing.Pipe` and
plain ZeroMQ, in the same run.

One parent broadcasts a numpy uint8 payload to N worker processes and gathers every worker's tiny
reply (the payload's length): the pattern of the engine's per-step RPC. Each round runs every system
in rotated order, and each system is started fresh for its turn and shut down after it, so idle
workers of one system never share the cores while another is measured.

Per (system, payload): median and p99 latency over every sequential call of every round; sequential
and pipelined (`--pipeline-depth` calls in flight) calls/s; parent + worker CPU time per sequential
call; and idle CPU, the busiest worker's CPU % over `--idle-window-s` starting 0.1 s after the
size's last call, worst round reported. The JSON also lists v1engine's median over each baseline's.

    python scripts/bench_rpc.py --sizes 100,100K,1M,8M,20M --rounds 5 --json rpc.json

`--backend ray` adds, in the same run, `RayExecutor.collective_rpc` (`v1engine-ray`) and bare Ray
actor calls (`ray-call`) on a Ray cluster: `--ray-address`, or a simulated one started here with
one one-CPU node per worker (bench_ray_systems.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import numpy as np
import psutil
from bench_worker import SYSTEM_CLASSES, System

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_IDLE_SETTLE_S = 0.1


# ---- measurement ----


@dataclass(frozen=True)
class Plan:
    num_workers: int
    sizes: list[int]
    calls_per_size: dict[int, int]
    warmup_calls: int
    pipeline_depth: int
    idle_window_s: float


@dataclass
class Totals:
    """One (system, payload size), summed over rounds."""

    latencies_ns: list[int] = field(default_factory=list)
    seq_s: float = 0.0
    pipelined_s: float = 0.0
    pipelined_calls: int = 0
    cpu_s: float = 0.0
    idle_cpu_pct: float = 0.0  # the worst round

    def record(self, system: str, payload_bytes: int, num_workers: int) -> dict[str, Any]:
        lat_us = np.asarray(self.latencies_ns) / 1e3
        return {
            "system": system,
            "payload_bytes": payload_bytes,
            "num_workers": num_workers,
            "median_us": float(np.median(lat_us)),
            "p99_us": float(np.percentile(lat_us, 99)),
            "seq_calls_per_s": len(lat_us) / self.seq_s,
            "pipelined_calls_per_s": self.pipelined_calls / self.pipelined_s,
            "cpu_us_per_call": self.cpu_s / len(lat_us) * 1e6,
            "idle_cpu_pct": self.idle_cpu_pct,
        }


def _cpu_s(pids: list[int]) -> list[float]:
    """CPU seconds (user + system, all threads, exited ones too) of each process.

    On Linux this reads each process's CPU clock (the clock_getcpuclockid(3) id, ~pid << 3 | 2),
    which counts nanoseconds; psutil's cpu_times count 10 ms ticks, a whole 1% of a 1 s idle window
    and more than many small calls take, so they are only the fallback.
    """
    if sys.platform == "linux":
        try:
            return [time.clock_gettime_ns((~pid << 3) | 2) / 1e9 for pid in pids]
        except OSError:
            pass
    return [sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids]


def _idle_cpu_pct(workers: list[int], window_s: float) -> float:
    """Max over workers of CPU % over `window_s`, starting shortly after the last call."""
    time.sleep(_IDLE_SETTLE_S)
    before, start = _cpu_s(workers), time.perf_counter()
    time.sleep(window_s)
    after, elapsed = _cpu_s(workers), time.perf_counter() - start
    return max(100.0 * (a - b) / elapsed for a, b in zip(after, before))


def _expect(replies: list[int], expected: list[int], system: str) -> None:
    if replies != expected:
        raise RuntimeError(f"{system}: expected replies {expected[:4]}..., got {replies[:4]}...")


def _measure(system: System, payload: np.ndarray, plan: Plan, totals: Totals) -> None:
    num_calls, depth = plan.calls_per_size[payload.nbytes], plan.pipeline_depth
    one = [payload.nbytes] * plan.num_workers
    for _ in range(plan.warmup_calls):
        _expect(system.call(payload), one, system.name)
    _expect(system.call_pipelined(payload, depth), one * depth, system.name)

    workers = system.worker_pids()
    procs = [os.getpid(), *workers]
    cpu_before = _cpu_s(procs)
    seq_start = time.perf_counter_ns()
    for _ in range(num_calls):
        start = time.perf_counter_ns()
        replies = system.call(payload)
        totals.latencies_ns.append(time.perf_counter_ns() - start)
        _expect(replies, one, system.name)
    totals.seq_s += (time.perf_counter_ns() - seq_start) / 1e9
    totals.cpu_s += sum(_cpu_s(procs)) - sum(cpu_before)

    num_batches = math.ceil(num_calls / depth)
    start = time.perf_counter_ns()
    for _ in range(num_batches):
        _expect(system.call_pipelined(payload, depth), one * depth, system.name)
    totals.pipelined_s += (time.perf_counter_ns() - start) / 1e9
    totals.pipelined_calls += num_batches * depth

    idle_pct = _idle_cpu_pct(workers, plan.idle_window_s)
    totals.idle_cpu_pct = max(totals.idle_cpu_pct, idle_pct)


def run_rounds(
    systems: list[str], classes: dict[str, type[System]], plan: Plan, rounds: int
) -> dict[tuple[str, int], Totals]:
    """Round i runs the systems starting at i mod S; each is started fresh for its turn."""
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8) for size in plan.sizes]
    totals = {(name, size): Totals() for name in systems for size in plan.sizes}
    for round_idx in range(rounds):
        shift = round_idx % len(systems)
        for name in systems[shift:] + systems[:shift]:
            print(f"round {round_idx + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
            system = classes[name]()
            try:
                system.start(plan.num_workers)
                for payload in payloads:
                    _measure(system, payload, plan, totals[name, payload.nbytes])
            finally:
                system.close()
    return totals


# ---- command line and report ----


def parse_size(text: str) -> int:
    """'100', '100K', '1M', '8MB', '20MiB' -> bytes (K, M, G are powers of 1024)."""
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = body[-1] if body[-1:] in ("K", "M", "G") else ""
    try:
        num_bytes = int(float(body[: len(body) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 100, 100K, 1M") from None
    if num_bytes < 1:
        raise argparse.ArgumentTypeError(f"size must be >= 1 byte, got {text!r}")
    return num_bytes


def format_size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes} B"


def _size_list(text: str) -> list[int]:
    return list(dict.fromkeys(parse_size(part) for part in text.split(",") if part.strip()))


def _name_list(text: str) -> list[str]:
    return list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-workers", type=int, default=2, help="worker processes per system")
    p.add_argument("--sizes", type=_size_list, default="100,100K,1M,8M,20M", help="K/M: KiB/MiB")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each in rotated system order")
    p.add_argument("--systems", type=_name_list, help="which to run (default: all of the backend)")
    p.add_argument("--pipeline-depth", type=int, default=8, help="calls in flight when pipelined")
    p.add_argument("--calls", type=int, default=200, help="timed calls per size and round, at most")
    p.add_argument("--min-calls", type=int, default=20, help="timed calls for the largest sizes")
    p.add_argument("--byte-budget", type=parse_size, default="400M", help="calls = budget / size")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per size and round")
    p.add_argument("--idle-window-s", type=float, default=1.0, help="idle CPU measuring window")
    p.add_argument("--backend", choices=("mp", "ray"), default="mp", help="ray: add Ray systems")
    p.add_argument("--ray-address", help="with --backend ray: join this cluster, not a local one")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def _system_classes(backend: str) -> dict[str, type[System]]:
    if backend != "ray":
        return dict(SYSTEM_CLASSES)
    if not _has_module("ray"):
        sys.exit("error: --backend ray needs Ray: pip install 'v1engine[ray]'")
    from bench_ray_systems import RAY_SYSTEM_CLASSES

    return {**SYSTEM_CLASSES, **RAY_SYSTEM_CLASSES}


def _check_args(p: argparse.Namespace, names: list[str]) -> None:
    p.systems = p.systems or names
    unknown = [name for name in p.systems if name not in names]
    if unknown or not p.systems:
        sys.exit(f"error: --systems must be a subset of {','.join(names)}, got {unknown}")
    if "v1engine" in p.systems and not _has_module("v1engine.executor.multiproc_executor"):
        sys.exit("error: v1engine.executor.multiproc_executor is missing; use --systems pipe,zmq")
    for flag in ("num_workers", "rounds", "pipeline_depth", "calls", "min_calls"):
        if getattr(p, flag) < 1:
            sys.exit(f"error: --{flag.replace('_', '-')} must be >= 1, got {getattr(p, flag)}")
    if p.warmup < 0 or p.idle_window_s <= 0 or p.min_calls > p.calls:
        sys.exit("error: need --warmup >= 0, --idle-window-s > 0 and --min-calls <= --calls")


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _machine() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "torch": metadata.version("torch"),
        "device": "cpu",
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# (system, its baseline): the ratio of their medians is reported per payload size.
_RATIO_PAIRS = (("v1engine", "pipe"), ("v1engine", "zmq"), ("v1engine-ray", "ray-call"))


def _ratio_key(system: str, base: str) -> str:
    return f"{system.replace('-', '_')}_over_{base.replace('-', '_')}_median"


def _ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    median = {(r["system"], r["payload_bytes"]): r["median_us"] for r in records}
    out = []
    for size in sorted({r["payload_bytes"] for r in records}):
        row: dict[str, Any] = {"payload_bytes": size}
        for system, base in _RATIO_PAIRS:
            if (system, size) in median and (base, size) in median:
                row[_ratio_key(system, base)] = median[system, size] / median[base, size]
        if len(row) > 1:
            out.append(row)
    return out


def _print_report(records: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> None:
    head = ("system", "payload", "median_us", "p99_us", "seq_calls/s", "pipe_calls/s")
    row_format = "{:<12} {:>9}" + " {:>11}" * 4 + " {:>12} {:>10}"
    print(row_format.format(*head, "cpu_us/call", "idle_cpu%"))
    for r in sorted(records, key=lambda r: (r["payload_bytes"], r["system"])):
        print(
            f"{r['system']:<12} {format_size(r['payload_bytes']):>9} {r['median_us']:>11.1f} "
            f"{r['p99_us']:>11.1f} {r['seq_calls_per_s']:>11.1f} "
            f"{r['pipelined_calls_per_s']:>11.1f} {r['cpu_us_per_call']:>12.1f} "
            f"{r['idle_cpu_pct']:>10.2f}"
        )
    for row in ratios:
        parts = [
            f"{system}/{base} = {row[_ratio_key(system, base)]:.2f}"
            for system, base in _RATIO_PAIRS
            if _ratio_key(system, base) in row
        ]
        print(f"median ratio at {format_size(row['payload_bytes'])}: " + ", ".join(parts))


def _list_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _warn_leftovers(shm_before: set[str]) -> None:
    """Everything must shut down cleanly; say so loudly when it did not. The /dev/shm check sees
    the whole host, so an entry may belong to another program that ran at the same time."""
    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(proc.cmdline()):
                pids.append(proc.pid)
        except psutil.NoSuchProcess:
            pass  # exited while we looked
    if pids:
        print(f"warning: child processes left behind: {pids}", file=sys.stderr)
    new_shm = sorted(_list_shm() - shm_before)
    if new_shm:
        print(f"warning: new /dev/shm entries since start: {new_shm}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    classes = _system_classes(args.backend)
    _check_args(args, list(classes))
    sizes, budget = args.sizes, args.byte_budget
    plan = Plan(
        num_workers=args.num_workers,
        sizes=sizes,
        calls_per_size={s: min(args.calls, max(args.min_calls, budget // s)) for s in sizes},
        warmup_calls=args.warmup,
        pipeline_depth=args.pipeline_depth,
        idle_window_s=args.idle_window_s,
    )
    shm_before = _list_shm()
    cluster = None
    if args.backend == "ray":
        from bench_ray_systems import RayCluster

        cluster = RayCluster(args.ray_address, num_nodes=args.num_workers)
    try:
        totals = run_rounds(args.systems, classes, plan, args.rounds)
    finally:
        if cluster is not None:
            cluster.close()
        _warn_leftovers(shm_before)
    records = [t.record(name, size, plan.num_workers) for (name, size), t in totals.items()]
    ratios = _ratios(records)
    _print_report(records, ratios)
    if args.json:
        config = {**vars(args), "calls_per_size": plan.calls_per_size}
        doc = {"machine": _machine(), "config": config, "results": records, "ratios": ratios}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
