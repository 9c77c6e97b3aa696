"""CPU matmul: `F.linear` (MKL sgemm) against oneDNN's linear (`v1engine.model.layers.gemm`), in
the same run, on the projection shapes of the default model (SmolLM2-135M) at decode-sized and
prefill-sized token counts.

Each (shape, tokens) is timed for both kernels in alternating order, `--repeats` times `--calls`
calls; the table gives the median time per call and GFLOP/s, and the speedup.

    python scripts/bench_gemm.py --repeats 5 --json gemm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from v1engine.model.layers.linear import linear

# (name, in_features, out_features) of SmolLM2-135M's matmuls at tensor_parallel_size=1.
SHAPES = (
    ("qkv_proj", 576, 960),
    ("o_proj", 576, 576),
    ("gate_up_proj", 576, 3072),
    ("down_proj", 1536, 576),
    ("lm_head", 576, 49152),
)
KERNELS = {"F.linear": F.linear, "v1engine": linear}


def time_calls(fn, x: torch.Tensor, weight: torch.Tensor, calls: int) -> float:
    fn(x, weight)  # warm-up: oneDNN builds its kernel on the first call of a shape
    start = time.perf_counter()
    for _ in range(calls):
        fn(x, weight)
    return (time.perf_counter() - start) / calls


def measure(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    rows = []
    for tokens in args.tokens:
        for name, in_features, out_features in SHAPES:
            x = torch.randn(tokens, in_features)
            weight = torch.randn(out_features, in_features)
            times: dict[str, list[float]] = {k: [] for k in KERNELS}
            with torch.inference_mode():
                for repeat in range(args.repeats):
                    order = list(KERNELS)[:: 1 if repeat % 2 == 0 else -1]
                    for kernel in order:
                        times[kernel].append(time_calls(KERNELS[kernel], x, weight, args.calls))
            flops = 2 * tokens * in_features * out_features
            row = {"shape": name, "tokens": tokens, "in": in_features, "out": out_features}
            for kernel, samples in times.items():
                median = statistics.median(samples)
                row[kernel] = {
                    "median_us": round(median * 1e6, 1),
                    "gflops": round(flops / median / 1e9, 1),
                }
            row["speedup"] = round(row["F.linear"]["median_us"] / row["v1engine"]["median_us"], 2)
            rows.append(row)
            print(
                f"{name:>13} tokens={tokens:5d}: F.linear {row['F.linear']['gflops']:6.1f} GF/s, "
                f"v1engine {row['v1engine']['gflops']:6.1f} GF/s, speedup {row['speedup']:.2f}x",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    rows = measure(args)
    if args.json:
        machine = {
            "cores": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "threads": args.threads, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
