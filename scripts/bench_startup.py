"""Start-up time, each measure in a fresh interpreter: the `LLM` class constructed to ready, and
`python -m v1engine.serve` started to its first 200 from /health.

    python scripts/bench_startup.py --repeats 5 --baseline-ref f2993c0 --busy --json startup.json

Every time counts from the moment the process is launched, so imports are included. Each run
also reports the engine core's own phase table (its "Engine ready in ..." log line).
`--baseline-ref REF` measures a git worktree of REF the same way in the same run (the order of
the two alternates between repeats), so a before/after ratio never spans two machine states.
`--busy` repeats everything with one busy process (`yes > /dev/null`) per core competing, after
the quiet pass, and reports the busy/quiet ratio. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _bench_utils import REPO, busy_cores, checkout_env, cpu_machine_info, worktree
from _serve_utils import Server

_PHASES = re.compile(r"Engine ready in ([\d.]+) s \((.*)\)")
_LLM_SCRIPT = """
import sys, time
from v1engine import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]))
print("READY", flush=True)
llm.shutdown()
"""
_TIMEOUT_S = 600.0


def _phases(log: str) -> dict[str, float]:
    match = _PHASES.search(log)
    if match is None:
        return {}
    phases = {"engine ready": float(match.group(1))}
    for part in match.group(2).split(", "):
        name, _, seconds = part.rpartition(": ")
        phases[name] = float(seconds.rstrip(" s"))
    return phases


def measure_llm(root: str, model: str, tp: int) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _LLM_SCRIPT, model, str(tp)],
        cwd=root, env=checkout_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    ready_s = None
    for line in proc.stdout:
        if line.strip() == "READY":
            ready_s = time.perf_counter() - start
    _, log = proc.communicate(timeout=_TIMEOUT_S)
    if proc.returncode != 0 or ready_s is None:
        raise RuntimeError(f"LLM start-up failed in {root}:\n{log[-3000:]}")
    return {"ready_s": ready_s, "phases": _phases(log)}


def measure_serve(root: str, model: str, tp: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as log_dir:
        log_path = os.path.join(log_dir, "serve.log")
        server = Server(
            model, log_path, ["--tensor-parallel-size", str(tp)], _TIMEOUT_S,
            cwd=root, env=checkout_env(root), poll_s=0.05,
        )  # fmt: skip
        server.stop()
        with open(log_path) as f:
            return {"ready_s": server.ready_s, "phases": _phases(f.read())}


def run_pass(variants: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, dict[str, list]] = {v: {"llm": [], "serve": []} for v in variants}
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            root = variants[name]
            runs[name]["llm"].append(measure_llm(root, args.model, args.tp))
            runs[name]["serve"].append(measure_serve(root, args.model, args.tp))
    return {name: _summarize(measures) for name, measures in runs.items()}


def _summarize(measures: dict[str, list]) -> dict[str, Any]:
    summary = {}
    for kind, results in measures.items():
        phase_names = results[0]["phases"].keys()
        summary[kind] = {
            "ready_s": [r["ready_s"] for r in results],
            "median_ready_s": statistics.median(r["ready_s"] for r in results),
            "median_phases": {
                p: statistics.median(r["phases"].get(p, float("nan")) for r in results)
                for p in phase_names
            },
        }
    return summary


def print_table(title: str, summary: dict[str, Any]) -> None:
    print(f"\n{title}")
    for name, kinds in summary.items():
        for kind, result in kinds.items():
            phases = ", ".join(f"{p} {s:.2f}" for p, s in result["median_phases"].items())
            print(f"  {name:9s} {kind:5s} median {result['median_ready_s']:6.2f} s  [{phases}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-ref", default=None, help="git ref measured alongside")
    parser.add_argument("--busy", action="store_true", help="also measure with busy cores")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, REPO)
        from v1engine.model.hf_config import default_model_path

        args.model = default_model_path()
    result: dict[str, Any] = {"machine": cpu_machine_info(), "args": vars(args)}
    with worktree(args.baseline_ref) as baseline:
        variants = {"current": REPO} | ({"baseline": baseline} if baseline else {})
        result["quiet"] = run_pass(variants, args)
        print_table("quiet machine", result["quiet"])
        if args.busy:
            with busy_cores(True):
                result["busy"] = run_pass(variants, args)
            print_table("one busy process per core", result["busy"])
            for name in variants:
                for kind in ("llm", "serve"):
                    ratio = (
                        result["busy"][name][kind]["median_ready_s"]
                        / result["quiet"][name][kind]["median_ready_s"]
                    )
                    print(f"  busy/quiet {name} {kind}: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
