"""Greedy decode speed at a few batch sizes, the working tree against a git ref in the same run.

    python scripts/bench_decode.py --dtype bfloat16 --batch-sizes 1,4,5 --baseline-ref 7e78e16 \
        --pairs 3 --json decode.json

Each variant runs in its own interpreter, importing v1engine from its own checkout: one `LLM`
(the default model, or `--model`: a checkpoint directory whose vocabulary has over 40,000
tokens; TP=1), then per batch size one warm-up and `--repeats` timed `generate` calls of
that many requests at once (token-id prompts of `--prompt-len`, `--output-len` greedy tokens, EOS
ignored; tokens per second of the whole call, prefill included). A pair runs both variants, in
alternating order from pair to pair. On these shared VMs the memory's read speed changes state
within minutes, so the figure to compare is the median over pairs of each pair's ratio (current
/ baseline); every run also records the read bandwidth on every core right after it, and whether
both variants gave the same tokens. `--busy` runs every variant (its start-up included) with one
busy process per core competing, as on a machine whose cores are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from _bench_utils import (
    REPO,
    busy_cores,
    checkout_env,
    cpu_machine_info,
    read_bandwidth_gb_s,
    worktree,
)

_TIMEOUT_S = 1800

# The child: prints one JSON line {batch size: {"tok_s": [...], "tokens": [...]}}.
_CHILD = """
import json, sys, time
from v1engine import LLM, SamplingParams

def main(model, dtype, batch_sizes, prompt_len, output_len, repeats):
    longest = prompt_len + output_len + 16
    model = {"model": model} if model else {}
    llm = LLM(**model, dtype=dtype, max_model_len=longest, max_num_seqs=max(batch_sizes))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    results = {}
    try:
        for batch in batch_sizes:
            prompts = [
                {"prompt_token_ids": [1 + (7919 * r + 31 * i) % 40000 for i in range(prompt_len)]}
                for r in range(batch)
            ]
            llm.generate(prompts, params, use_tqdm=False)
            rates = []
            for _ in range(repeats):
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                rates.append(batch * output_len / (time.perf_counter() - start))
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            results[batch] = {"tok_s": rates, "tokens": tokens}
    finally:
        llm.shutdown()
    print(json.dumps(results))

if __name__ == "__main__":
    batch_sizes = [int(b) for b in sys.argv[3].split(",")]
    main(sys.argv[1], sys.argv[2], batch_sizes, *map(int, sys.argv[4:7]))
"""


def run_variant(root: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-c", _CHILD, args.model, args.dtype, args.batch_sizes]
    command += [str(args.prompt_len), str(args.output_len), str(args.repeats)]
    with busy_cores(args.busy):
        done = subprocess.run(
            command, cwd=root, env=checkout_env(root), capture_output=True, text=True,
            timeout=_TIMEOUT_S,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the decode run in {root} failed:\n{done.stderr[-3000:]}")
    results = json.loads(done.stdout.strip().splitlines()[-1])
    bandwidth = read_bandwidth_gb_s(len(os.sched_getaffinity(0)))
    return {"batches": results, "read_bandwidth_gb_s": bandwidth}


def run_pairs(variants: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    pairs = []
    for pair in range(args.pairs):
        order = list(variants) if pair % 2 == 0 else list(reversed(variants))
        runs = {name: run_variant(variants[name], args) for name in order}
        pairs.append(runs)
        for name in variants:
            rates = {b: statistics.median(r["tok_s"]) for b, r in runs[name]["batches"].items()}
            shown = ", ".join(f"batch {b}: {rate:.1f}" for b, rate in rates.items())
            bandwidth = runs[name]["read_bandwidth_gb_s"]
            print(f"pair {pair + 1} {name:9s} tok/s {shown}  (read {bandwidth:.1f} GB/s after)")
    return pairs


def summarize(pairs: list[dict[str, Any]], variants: dict[str, str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for batch in pairs[0]["current"]["batches"]:
        rates = {
            name: [statistics.median(p[name]["batches"][batch]["tok_s"]) for p in pairs]
            for name in variants
        }
        entry: dict[str, Any] = {f"{n}_median_tok_s": statistics.median(rates[n]) for n in rates}
        if "baseline" in variants:
            ratios = [c / b for c, b in zip(rates["current"], rates["baseline"], strict=True)]
            entry["pair_ratios"] = ratios
            entry["median_ratio"] = statistics.median(ratios)
            tokens = [[p[n]["batches"][batch]["tokens"] for n in variants] for p in pairs]
            entry["same_tokens"] = all(current == base for current, base in tokens)
        summary[batch] = entry
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    print()
    for batch, entry in summary.items():
        line = f"batch {batch}: current {entry['current_median_tok_s']:.1f} tok/s"
        if "median_ratio" in entry:
            ratios = ", ".join(f"{r:.2f}" for r in entry["pair_ratios"])
            line += f", baseline {entry['baseline_median_tok_s']:.1f}"
            line += f"; current/baseline {entry['median_ratio']:.2f}x (pairs {ratios})"
            line += f"; same tokens: {entry['same_tokens']}"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="a checkpoint directory (default: default model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per run")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--baseline-ref", default=None, help="git ref measured alongside")
    p.add_argument("--busy", action="store_true", help="one busy process per core in every run")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    with worktree(args.baseline_ref) as baseline:
        variants = {"current": REPO} | ({"baseline": baseline} if baseline else {})
        pairs = run_pairs(variants, args)
    summary = summarize(pairs, variants)
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            record = {"args": vars(args), "machine": cpu_machine_info()}
            json.dump(record | {"pairs": pairs, "summary": summary}, f)


if __name__ == "__main__":
    main()
