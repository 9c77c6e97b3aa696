"""Offline generation throughput: v1engine's `LLM.generate` against transformers' `generate`.

Both run the same requests in the same run: N prompts of random token ids with seeded random
prompt and output lengths, greedy, EOS ignored so every request produces exactly its output length.
transformers gets its best honest shape: requests sorted by output length and generated in
left-padded batches, so padding waste is small; only the requested output tokens count for either
system. Same weights (the default SmolLM2 GGUF, dequantized), same dtype, same thread count. The
prefix cache is emptied before each v1engine run, so no repeat reuses an earlier one's prefill.
`--device cuda` runs both systems on the first GPU (transformers with its default attention),
timing until the last token is on the host; `--eager-baseline` adds v1engine with
`enforce_eager=True` (no CUDA graphs) as a third system in the same alternating run.

On CPU it also prints the workload's floor: its arithmetic (every projection of every token fed to
the model, the LM head per output token, causal attention) at the fastest matmul rate this CPU
gives in the same run, as the most output tokens/s any engine doing that work could reach, each
system's share of it, and so the most any engine could beat transformers by on this machine.

    python scripts/bench_throughput.py --num-requests 64 --repeats 3 --json throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch
from _bench_utils import (
    cpu_machine_info,
    cuda_machine_info,
    matmul_peak_gflop_s,
    read_bandwidth_gb_s,
)


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_requests):
        prompt_len = rng.randint(args.min_prompt_len, args.max_prompt_len)
        output_len = rng.randint(args.min_output_len, args.max_output_len)
        # Skip the low ids, where SmolLM2 keeps its special tokens.
        requests.append(([rng.randrange(100, vocab_size) for _ in range(prompt_len)], output_len))
    return requests


def run_v1engine(llm: Any, requests: list[tuple[list[int], int]]) -> float:
    from v1engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    # Every repeat sends the same prompts: without this the prefix cache would skip their
    # prefill after the first repeat, and the two systems would no longer do the same work.
    if not llm.engine_core.reset_prefix_cache():
        raise RuntimeError("could not reset the prefix cache: requests are still running")
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(n for _, n in requests), "v1engine produced a wrong token count"
    return elapsed


def run_transformers(model: Any, requests: list[tuple[list[int], int]], batch_size: int) -> float:
    ordered = sorted(requests, key=lambda r: r[1])
    device = model.device
    start = time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        batch = ordered[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        max_new = max(n for _, n in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            out.cpu()  # the last token is on the host, as v1engine's are
    return time.perf_counter() - start


def workload_gflop(config: Any, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    """The arithmetic any engine does for `requests` on a Llama-style decoder (gated MLP), in
    GFLOP: the projections of every token fed to the model (the prompt, then each output but the
    last), the LM head on one row per output token, and causal attention (QK^T and PV) at each fed
    token's position, the prompts' and the decodes'. Embedding lookups, norms, activations and
    sampling are left out: they are memory-bound passes, a lower bound needs none of them."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    q_width = config.num_attention_heads * _head_dim(config)
    kv_width = config.num_key_value_heads * _head_dim(config)
    layer_weights = hidden * (2 * q_width + 2 * kv_width) + 3 * hidden * config.intermediate_size
    fed = sum(len(prompt) + n - 1 for prompt, n in requests)
    prompt_keys, decode_keys = _keys_attended(requests)
    return {
        "projections": 2 * layer_weights * layers * fed / 1e9,
        "lm_head": 2 * hidden * config.vocab_size * sum(n for _, n in requests) / 1e9,
        "prompt_attention": 4 * q_width * layers * prompt_keys / 1e9,
        "decode_attention": 4 * q_width * layers * decode_keys / 1e9,
    }


def decode_kv_gb(config: Any, requests: list[tuple[list[int], int]], itemsize: int) -> float:
    """GB of K/V the decode steps read: each output token fed back attends every position up to
    its own, whose keys and values no cache holds (at 64 requests of a few hundred tokens they are
    far larger than the last-level cache)."""
    per_key = config.num_hidden_layers * 2 * config.num_key_value_heads * _head_dim(config)
    return per_key * itemsize * _keys_attended(requests)[1] / 1e9


def _keys_attended(requests: list[tuple[list[int], int]]) -> tuple[int, int]:
    """(query, key) pairs of causal attention: the prompts' tokens (position i sees i + 1 keys),
    and the outputs fed back (all but the last, at positions len(prompt) .. len(prompt) + n - 2)."""
    prompts = sum(len(p) * (len(p) + 1) // 2 for p, _ in requests)
    decodes = sum(sum(range(len(p) + 1, len(p) + n)) for p, n in requests)
    return prompts, decodes


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def roofline(config: Any, requests, args: argparse.Namespace) -> dict[str, Any]:
    """The workload's floors on this CPU, measured in the same run: its GFLOP at the fastest
    matmul rate (the model's widest projection, gate_up, on 2,048 rows); and the decode steps'
    attention as the time to read their K/V at the read bandwidth of every thread, after the rest
    of the arithmetic (as an engine that attends and multiplies in turn does). Each as seconds and
    as output tokens/s."""
    dtype = getattr(torch, args.dtype)
    gflop = workload_gflop(config, requests)
    width = 2 * config.intermediate_size
    peak = matmul_peak_gflop_s(args.threads, dtype, config.hidden_size, width)
    kv_gb, bandwidth = (
        decode_kv_gb(config, requests, dtype.itemsize),
        read_bandwidth_gb_s(args.threads),
    )
    arithmetic_s = sum(gflop.values()) / peak
    in_turn_s = (sum(gflop.values()) - gflop["decode_attention"]) / peak + kv_gb / bandwidth
    output_tokens = sum(n for _, n in requests)
    return {
        "gflop": {name: round(value, 1) for name, value in gflop.items()},
        "matmul_peak_gflop_s": round(peak, 1),
        "arithmetic_s": round(arithmetic_s, 2),
        "decode_kv_gb": round(kv_gb, 1),
        "read_bandwidth_gb_s": round(bandwidth, 1),
        "in_turn_s": round(in_turn_s, 2),
        "ceiling_output_tokens_per_s": round(output_tokens / arithmetic_s, 1),
        "in_turn_ceiling_output_tokens_per_s": round(output_tokens / in_turn_s, 1),
    }


def load_transformers_model(checkpoint: str, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval().to(device)
    model.generation_config.eos_token_id = None  # every request runs to its length
    return model


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    from v1engine.entrypoints.llm import LLM
    from v1engine.model.hf_config import default_model_path, prepare_checkpoint

    model_path = args.model or default_model_path()
    checkpoint = prepare_checkpoint(model_path)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    engine_kwargs: dict[str, Any] = dict(
        device=args.device, dtype=args.dtype, max_model_len=args.max_model_len
    )
    if args.kv_cache_gib is not None:
        engine_kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    engines = {"v1engine": LLM(model_path, **engine_kwargs)}
    try:
        if args.eager_baseline:
            engines["v1engine-eager"] = LLM(model_path, enforce_eager=True, **engine_kwargs)
        hf_model = load_transformers_model(checkpoint, dtype, args.device)
        requests = make_requests(args, hf_model.config.vocab_size)
        systems = [*engines, "transformers"]
        times: dict[str, list[float]] = {system: [] for system in systems}
        for llm in engines.values():
            run_v1engine(llm, requests[:4])  # warm-up
        # transformers' first generate is slow too (on an H200 its first repeat took 2.5-3.5x
        # its others): warm it the same way, so its median is of warm runs, as v1engine's is.
        run_transformers(hf_model, requests[:4], args.hf_batch_size)
        for repeat in range(args.repeats):
            shift = repeat % len(systems)  # each system takes each place in turn
            for system in systems[shift:] + systems[:shift]:
                if system in engines:
                    times[system].append(run_v1engine(engines[system], requests))
                else:
                    times[system].append(run_transformers(hf_model, requests, args.hf_batch_size))
                print(f"repeat {repeat + 1}: {system} {times[system][-1]:.2f} s", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    output_tokens = sum(n for _, n in requests)
    results = [_record(system, s, output_tokens, args) for system, s in times.items()]
    floor = roofline(hf_model.config, requests, args) if args.device == "cpu" else None
    return results, floor


def _record(system: str, seconds: list[float], output_tokens: int, args) -> dict[str, Any]:
    median_s = statistics.median(seconds)
    return {
        "system": system,
        "num_requests": args.num_requests,
        "prompt_len_range": [args.min_prompt_len, args.max_prompt_len],
        "output_len_range": [args.min_output_len, args.max_output_len],
        "output_tokens": output_tokens,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "repeats": len(seconds),
        "median_s": round(median_s, 3),
        "output_tokens_per_s": round(output_tokens / median_s, 1),
        "all_s": [round(s, 3) for s in seconds],
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    # 32 was transformers' fastest of 16, 32 and 64 on the 2-core CPU box (54 s vs 57 s and 60 s).
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--eager-baseline", action="store_true", help="also v1engine with enforce_eager=True"
    )
    p.add_argument(
        "--kv-cache-gib", type=float, default=None, help="fixed KV cache size per engine"
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.eager_baseline and args.device == "cuda" and args.kv_cache_gib is None:
        args.kv_cache_gib = 4.0  # two engines on one GPU: neither may take 90% of it
    return args


def print_roofline(floor: dict[str, Any], by_system: dict[str, float]) -> None:
    gflop = floor["gflop"]
    ceiling, in_turn = (
        floor["ceiling_output_tokens_per_s"],
        floor["in_turn_ceiling_output_tokens_per_s"],
    )
    parts = ", ".join(f"{name} {value:.0f}" for name, value in gflop.items())
    print(
        f"floor: {sum(gflop.values()):.0f} GFLOP ({parts}) at the "
        f"{floor['matmul_peak_gflop_s']:.1f} GFLOP/s of this CPU's fastest matmul = "
        f"{floor['arithmetic_s']:.2f} s (at most {ceiling:.1f} output tokens/s); with the decode "
        f"attention as its {floor['decode_kv_gb']:.1f} GB of K/V read at "
        f"{floor['read_bandwidth_gb_s']:.1f} GB/s, {floor['in_turn_s']:.2f} s (at most "
        f"{in_turn:.1f} output tokens/s)"
    )
    reached = ", ".join(f"{s} {tok_s / in_turn:.0%}" for s, tok_s in by_system.items())
    base = by_system["transformers"]
    print(
        f"share of the second: {reached}; an engine at either floor beats transformers here by "
        f"{ceiling / base:.2f}x or {in_turn / base:.2f}x"
    )


def main() -> None:
    args = parse_args()
    results, floor = measure(args)
    by_system = {r["system"]: r["output_tokens_per_s"] for r in results}
    for r in results:
        print(
            f"{r['system']:>14}: {r['output_tokens_per_s']:8.1f} output tokens/s "
            f"(median of {r['repeats']}: {r['median_s']:.2f} s)"
        )
    ratio = by_system["v1engine"] / by_system["transformers"]
    print(f"v1engine / transformers = {ratio:.2f}x")
    ratios = {"v1engine/transformers": round(ratio, 3)}
    if "v1engine-eager" in by_system:
        eager_ratio = by_system["v1engine"] / by_system["v1engine-eager"]
        print(f"v1engine / v1engine-eager = {eager_ratio:.2f}x")
        ratios["v1engine/v1engine-eager"] = round(eager_ratio, 3)
    if floor is not None:
        print_roofline(floor, by_system)
    if args.json:
        machine = cpu_machine_info() if args.device == "cpu" else cuda_machine_info()
        with open(args.json, "w") as f:
            record = {"machine": machine, "results": results, "ratio": round(ratio, 3)}
            json.dump({**record, "ratios": ratios, "roofline": floor}, f, indent=2)


if __name__ == "__main__":
    main()
