"""What serving a LoRA adapter costs: greedy generation with no adapter (the baseline), with one
adapter for every request, and with half the requests on an adapter (a mixed batch), in the same
run on the same engine.

    python scripts/bench_lora.py --dtype float32 --batch-sizes 1,16 --repeats 5 --json lora.json

One `LLM` (the default model, TP=1, `enable_lora=True`) and a random rank-`--rank` adapter on
every projection (as the tests write one). Per batch size, one warm-up of each variant, then
`--repeats` rounds that time each variant once, in an order that rotates from round to round;
each figure is the median tokens per second of a whole `generate` call (prefill included), and
each ratio that median over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from _bench_utils import REPO, cpu_machine_info

VARIANTS = ("base", "one adapter", "mixed")


def tok_s(llm, prompts: list[list[int]], params, lora) -> float:
    """Tokens per second of one `generate` call (prefill included)."""
    llm.reset_prefix_cache()  # every call computes its prompts
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    return len(prompts) * params.max_tokens / (time.perf_counter() - start)


def bench_batch(llm, batch: int, args: argparse.Namespace, lora, params) -> dict:
    prompts = [[100 + (i + j) % 1000 for j in range(args.prompt_len)] for i in range(batch)]
    loras = {
        "base": None,
        "one adapter": lora,
        "mixed": [lora if i % 2 else None for i in range(batch)],
    }
    variants = VARIANTS if batch > 1 else VARIANTS[:2]  # one request cannot mix
    for variant in variants:
        tok_s(llm, prompts, params, loras[variant])  # warm-up
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(args.repeats):
        shift = round_ % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            runs[variant].append(tok_s(llm, prompts, params, loras[variant]))
    medians = {v: statistics.median(r) for v, r in runs.items()}
    line = ", ".join(f"{v} {medians[v]:.1f} tok/s" for v in variants)
    print(f"batch {batch}: {line}", flush=True)
    ratios = {v: medians[v] / medians["base"] for v in variants}
    return {"tok_s": runs, "median_tok_s": medians, "ratio_to_base": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sys.path.insert(0, REPO)  # the tests' adapter writer
    from transformers import AutoConfig

    from tests.lora.adapters import make_adapter
    from v1engine import LLM, LoRARequest, SamplingParams
    from v1engine.model.hf_config import default_model_path, prepare_checkpoint

    model = prepare_checkpoint(default_model_path())
    folder = os.path.join(tempfile.mkdtemp(prefix="bench_lora_"), "adapter")
    config = AutoConfig.from_pretrained(model)
    lora = LoRARequest("bench", 1, make_adapter(folder, config, rank=args.rank, alpha=args.rank))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm = LLM(model, dtype=args.dtype, enable_lora=True, max_lora_rank=max(16, args.rank))
    try:
        results = {
            batch: bench_batch(llm, batch, args, lora, params)
            for batch in (int(b) for b in args.batch_sizes.split(","))
        }
    finally:
        llm.shutdown()
    if args.json:
        record = {"machine": cpu_machine_info(), "args": vars(args), "results": results}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
