"""CPU matmul kernels on the projection shapes of the default model (SmolLM2-135M), in one run:
`F.linear` (MKL's sgemm), oneDNN's linear (`mkldnn._linear_pointwise`), our gemv (`cpu_gemv.c`),
our tiled gemm (`cpu_gemm.c`: float32, and bfloat16 where the CPU has AVX512-BF16) and our gemm
on packed weights (`cpu_gemm_packed.c`, float32), at decode-sized and prefill-sized token counts.
For float32 `linear` uses the packed gemm up to `cpu_kernels.max_gemm_packed_tokens` rows and the
tiled one up to `max_gemm_tokens`; for bfloat16 the gemv up to `max_gemv_tokens`, then the tiled
gemm up to `max_gemm_tokens`; then MKL (float32 on Intel CPUs) or oneDNN. After
each token count, one line sums a whole SmolLM2 step: 30 layers of the four projections plus the
LM head.

    python scripts/bench_gemm.py --repeats 5 --json gemm.json

A decode step reads every weight from memory, not from cache (the model is far larger than the
last-level cache), so each kernel cycles through copies of the weight that together exceed
`--weights-mb` (default 256 MB, several times any L3). Each (shape, tokens) is timed for every
kernel in alternating order, `--repeats` times `--calls` calls; the table gives the median time
per call, the weight bytes read per second (what bounds decode) and GFLOP/s (what bounds prefill).
The packed gemm's weights are packed before the timing, as the engine packs them at load time.
`cpu_gemv` runs only up to `--gemv-max-tokens` rows (default 16: it is built for a few),
both gemms up to `--gemm-max-tokens` (default 128).

`--baseline-ref REF` also builds our kernels from git REF's C sources and from the working
tree's, with the library's flags, and measures both builds in the same alternating rounds
(`cpu_gemv@tree` against `cpu_gemv@REF`, ...); each row then says whether the two builds gave
the same bits (a ref from before the packed gemm has none to compare). Every row also says
whether the packed and the tiled gemm gave the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from _bench_utils import onednn_linear
from _kernel_builds import Kernel, build

from v1engine.model.layers import cpu_kernels

# (name, in_features, out_features) of SmolLM2-135M's matmuls at tensor_parallel_size=1.
SHAPES = (
    ("qkv_proj", 576, 960),
    ("o_proj", 576, 576),
    ("gate_up_proj", 576, 3072),
    ("down_proj", 1536, 576),
    ("lm_head", 576, 49152),
)


# Ours are added by add_builds, called as the engine calls them (_kernel_builds.build).
KERNELS = {"F.linear": Kernel(F.linear), "oneDNN": Kernel(onednn_linear)}
NUM_LAYERS = 30  # SmolLM2-135M's, for the per-step sums


def kernels_for(args: argparse.Namespace, tokens: int) -> list[str]:
    """The kernels this row count and dtype are measured with."""
    gemm = args.gemm_max_tokens  # both gemms; a dtype's build lacks those it has no kernel for
    limits = {"cpu_gemv": args.gemv_max_tokens, "cpu_gemm": gemm, "cpu_gemm_packed": gemm}
    return [k for k in KERNELS if tokens <= limits.get(k.split("@")[0], tokens)]


def add_builds(args: argparse.Namespace, workdir: str) -> None:
    """Registers our kernels: the working tree's (the library every process loads) and, with
    `--baseline-ref`, the ref's, named `cpu_gemm@tree` and `cpu_gemm@REF`."""
    dtype = getattr(torch, args.dtype)
    ref = args.baseline_ref
    builds = [(None, "@tree" if ref else "")] + ([(ref, f"@{ref}")] if ref else [])
    for source, label in builds:
        for name, kernel in build(source, dtype, workdir).items():
            KERNELS[name + label] = kernel


def same_bits(row: dict, x: torch.Tensor, weight: torch.Tensor, kernels: list[str], ref) -> None:
    """row["same_bits"][pair]: whether two of our kernels agree bit for bit: the packed gemm and
    the tiled one, and with `ref` each of the tree's kernels and the same kernel of ref's build."""
    tree = "@tree" if ref else ""
    pairs = [(f"cpu_gemm_packed{tree}", f"cpu_gemm{tree}")]
    if ref:
        pairs += [(f"{name}@tree", f"{name}@{ref}") for name in ("cpu_gemv", "cpu_gemm")]
        pairs += [("cpu_gemm_packed@tree", f"cpu_gemm_packed@{ref}")]
    row["same_bits"] = {}
    with torch.inference_mode():
        for a, b in pairs:
            if a in kernels and b in kernels:
                outputs = [KERNELS[k].run(x, KERNELS[k].prepare(weight)) for k in (a, b)]
                row["same_bits"][f"{a} vs {b}"] = torch.equal(*outputs)


def time_calls(kernel: Kernel, x: torch.Tensor, weights: list, calls: int) -> float:
    """Seconds per call of `kernel` on x, cycling through `weights` (prepared for it)."""
    kernel.run(x, weights[0])  # warm-up: oneDNN builds its kernel on the first call of a shape
    start = time.perf_counter()
    for i in range(calls):
        kernel.run(x, weights[i % len(weights)])
    return (time.perf_counter() - start) / calls


def measure_shape(args, name: str, in_features: int, out_features: int, tokens: int) -> dict:
    dtype = getattr(torch, args.dtype)
    weight_bytes = in_features * out_features * dtype.itemsize
    copies = max(1, args.weights_mb * 2**20 // weight_bytes)
    weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(copies)]
    x = torch.randn(tokens, in_features).to(dtype)
    kernels = kernels_for(args, tokens)
    times: dict[str, list[float]] = {k: [] for k in kernels}
    with torch.inference_mode():
        prepared = {k: [KERNELS[k].prepare(w) for w in weights] for k in kernels}
        for repeat in range(args.repeats):
            for kernel in kernels[:: 1 if repeat % 2 == 0 else -1]:
                times[kernel].append(time_calls(KERNELS[kernel], x, prepared[kernel], args.calls))
        del prepared
    row = {"shape": name, "tokens": tokens, "in": in_features, "out": out_features}
    same_bits(row, x, weights[0], kernels, args.baseline_ref)
    for kernel, samples in times.items():
        median = statistics.median(samples)
        row[kernel] = {
            "median_us": round(median * 1e6, 1),
            "weight_gb_per_s": round(weight_bytes / median / 1e9, 1),
            "gflops": round(2 * tokens * in_features * out_features / median / 1e9, 1),
        }
    return row


def step_sum(rows: list[dict]) -> dict:
    """One decode or prefill step's matmuls: NUM_LAYERS x each layer shape + the LM head, per
    kernel measured on every shape."""
    kernels = [k for k in KERNELS if all(k in row for row in rows)]
    step: dict = {"shape": "smollm2_step", "tokens": rows[0]["tokens"]}
    for kernel in kernels:
        us = sum(
            r[kernel]["median_us"] * (1 if r["shape"] == "lm_head" else NUM_LAYERS) for r in rows
        )
        step[kernel] = {"median_ms": round(us / 1e3, 2)}
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 64, 2048])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--weights-mb", type=int, default=256)
    p.add_argument("--gemv-max-tokens", type=int, default=16)
    p.add_argument("--gemm-max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--baseline-ref", default=None, help="git ref whose kernels are measured too")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels did not build here (see the warning above)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_gemm-") as workdir:
        add_builds(args, workdir)
        rows = measure_all(args)
    if args.json:
        write_json(args, rows)


def measure_all(args: argparse.Namespace) -> list[dict]:
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
            same = " ".join(f"{k} same bits: {v}" for k, v in row["same_bits"].items())
            print(f"{name:>13} tokens={tokens:5d}: " + " | ".join(cells) + f" {same}", flush=True)
        step = step_sum(rows[-len(SHAPES) :])
        rows.append(step)
        cells = [f"{k} {v['median_ms']:8.1f} ms" for k, v in step.items() if k in KERNELS]
        print(f"{'SmolLM2 step':>13} tokens={tokens:5d}: " + " | ".join(cells), flush=True)
    return rows


def write_json(args: argparse.Namespace, rows: list[dict]) -> None:
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
