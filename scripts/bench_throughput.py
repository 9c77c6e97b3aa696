"""Offline generation throughput: v1engine's `LLM.generate` against transformers' `generate`.

Both run the same requests in the same run: N prompts of random token ids with seeded random
prompt and output lengths, greedy, EOS ignored so every request produces exactly its output length.
transformers gets its best honest shape: requests sorted by output length and generated in
left-padded batches, so padding waste is small; only the requested output tokens count for either
system. Same weights (the default SmolLM2 GGUF, dequantized), same dtype, same thread count. The
prefix cache is emptied before each v1engine run, so no repeat reuses an earlier one's prefill.
`--device cuda` runs both systems on the first GPU (v1engine eager, transformers' default
attention), timing until the last token is on the host.

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
from _bench_utils import cpu_machine_info, cuda_machine_info


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


def load_transformers_model(checkpoint: str, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval().to(device)
    model.generation_config.eos_token_id = None  # every request runs to its length
    return model


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from v1engine.entrypoints.llm import LLM
    from v1engine.model.hf_config import default_model_path, prepare_checkpoint

    model_path = args.model or default_model_path()
    checkpoint = prepare_checkpoint(model_path)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    llm = LLM(model_path, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    hf_model = load_transformers_model(checkpoint, dtype, args.device)
    requests = make_requests(args, hf_model.config.vocab_size)
    output_tokens = sum(n for _, n in requests)
    times: dict[str, list[float]] = {"v1engine": [], "transformers": []}
    try:
        run_v1engine(llm, requests[:4])  # warm-up
        for repeat in range(args.repeats):
            order = ["v1engine", "transformers"][:: 1 if repeat % 2 == 0 else -1]
            for system in order:
                if system == "v1engine":
                    times[system].append(run_v1engine(llm, requests))
                else:
                    times[system].append(run_transformers(hf_model, requests, args.hf_batch_size))
                print(f"repeat {repeat + 1}: {system} {times[system][-1]:.2f} s", flush=True)
    finally:
        llm.shutdown()
    return [_record(system, s, output_tokens, args) for system, s in times.items()]


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
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    results = measure(args)
    ours, theirs = results
    ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    for r in results:
        print(
            f"{r['system']:>12}: {r['output_tokens_per_s']:8.1f} output tokens/s "
            f"(median of {r['repeats']}: {r['median_s']:.2f} s)"
        )
    print(f"v1engine / transformers = {ratio:.2f}x")
    if args.json:
        machine = cpu_machine_info() if args.device == "cpu" else cuda_machine_info()
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine, "results": results, "ratio": round(ratio, 3)}, f, indent=2
            )


if __name__ == "__main__":
    main()
