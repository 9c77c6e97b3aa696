"""CPU matmul kernels on the projection shapes of the default model (SmolLM2-135M), in one run:
`F.linear` (MKL's sgemm), oneDNN's linear (`mkldnn._linear_pointwise`, what `linear` uses above
`cpu_kernels.max_gemv_tokens` rows) and our decode kernel (`cpu_gemv.c`, what `linear` uses up to
it), at decode-sized and prefill-sized token counts.

    python scripts/bench_gemm.py --repeats 5 --json gemm.json

A decode step reads every weight from memory, not from cache (the model is far larger than the
last-level cache), so each kernel cycles through copies of the weight that together exceed
`--weights-mb` (default 256 MB, several times any L3). Each (shape, tokens) is timed for every
kernel in alternating order, `--repeats` times `--calls` calls; the table gives the median time
per call, the weight bytes read per second (what bounds decode) and GFLOP/s (what bounds prefill).
`cpu_gemv` runs only up to `--gemv-max-tokens` rows (default 16: it is built for a few).
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

from v1engine.model.layers import cpu_kernels

# (name, in_features, out_features) of SmolLM2-135M's matmuls at tensor_parallel_size=1.
SHAPES = (
    ("qkv_proj", 576, 960),
    ("o_proj", 576, 576),
    ("gate_up_proj", 576, 3072),
    ("down_proj", 1536, 576),
    ("lm_head", 576, 49152),
)


def onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


KERNELS = {"F.linear": F.linear, "oneDNN": onednn, "cpu_gemv": cpu_kernels.gemv}


def time_calls(fn, x: torch.Tensor, weights: list[torch.Tensor], calls: int) -> float:
    fn(x, weights[0])  # warm-up: oneDNN builds its kernel on the first call of a shape
    start = time.perf_counter()
    for i in range(calls):
        fn(x, weights[i % len(weights)])
    return (time.perf_counter() - start) / calls


def measure_shape(args, name: str, in_features: int, out_features: int, tokens: int) -> dict:
    dtype = getattr(torch, args.dtype)
    weight_bytes = in_features * out_features * dtype.itemsize
    copies = max(1, args.weights_mb * 2**20 // weight_bytes)
    weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(copies)]
    x = torch.randn(tokens, in_features).to(dtype)
    kernels = [k for k in KERNELS if k != "cpu_gemv" or tokens <= args.gemv_max_tokens]
    times: dict[str, list[float]] = {k: [] for k in kernels}
    with torch.inference_mode():
        for repeat in range(args.repeats):
            for kernel in kernels[:: 1 if repeat % 2 == 0 else -1]:
                times[kernel].append(time_calls(KERNELS[kernel], x, weights, args.calls))
    row = {"shape": name, "tokens": tokens, "in": in_features, "out": out_features}
    for kernel, samples in times.items():
        median = statistics.median(samples)
        row[kernel] = {
            "median_us": round(median * 1e6, 1),
            "weight_gb_per_s": round(weight_bytes / median / 1e9, 1),
            "gflops": round(2 * tokens * in_features * out_features / median / 1e9, 1),
        }
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 64, 2048])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--weights-mb", type=int, default=256)
    p.add_argument("--gemv-max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels did not build here (see the warning above)")
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{args.dtype}, {args.threads} threads; per kernel: us per call, weight GB/s, GFLOP/s")
    for tokens in args.tokens:
        for name, in_features, out_features in SHAPES:
            row = measure_shape(args, name, in_features, out_features, tokens)
            rows.append(row)
            cells = [
                f"{k} {v['median_us']:8.1f} us {v['weight_gb_per_s']:5.1f} GB/s {v['gflops']:6.1f}"
                for k, v in row.items()
                if k in KERNELS
            ]
            print(f"{name:>13} tokens={tokens:5d}: " + " | ".join(cells), flush=True)
    if args.json:
        machine = {
            "cores": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine, "dtype": args.dtype, "threads": args.threads, "results": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
