"""CPU attention for prefills: our kernel (cpu_paged_attention.c, the CPU backend's) against the
torch backend (keys gathered from the paged cache, then SDPA), one layer of the default model's
shape (9 query heads over 3 KV heads, head size 64; `--shape H,KVH,D` for another model's),
blocks of 16, in one run.

    python scripts/bench_attention.py --repeats 7 --json attention.json
    python scripts/bench_attention.py --baseline-ref HEAD~1   # also the kernel built at HEAD~1

A case is `CACHED+NEW`x`COUNT`: COUNT requests, each computing NEW tokens after CACHED ones (0:
a prompt from scratch; more: a chunk over a cached prefix). Each system runs every case
`--repeats` times in alternating order; the table gives the median ms per layer, GFLOP/s (the
causal QK^T and PV products, 4 * rows * keys seen * head size per head) and the fastest system.
"picks" says which one the CPU backend takes for the case (`cpu_attention_backend.kernel_attends`):
its kernel up to `LONG_PREFILL_ATTENTIONS[passes]` row-key pairs in one request (the passes it
runs the prompt's rows through, `cpu_kernels.prefill_passes`), SDPA past them: limits this
benchmark is the measure for. Every kernel's output is also compared with the torch
backend's (the JSON's max_abs_diff_vs_torch).

`--march ARCH` builds both kernels (the working tree's and the baseline's) for another CPU than
this one, e.g. `x86-64-v3` (AVX2 without AVX-512; LANES 8), run here as that code would run
there; the torch backend runs as it is.

`--cold [MB]` reads a buffer several times the last-level cache (256 MB unless given) before every
timed call, so that the keys and values come from memory, as in the engine, where a layer's cache
rows leave the cache while the other layers' weights and caches stream through. Without it, a
case whose caches fit in the last-level cache (64 decodes over 192 keys: 19 MB) is measured from
there. Decode cases (`191+1x64`) are where it matters:

    python scripts/bench_attention.py --cold --cases 95+1x64 191+1x64 511+1x64 --baseline-ref HEAD
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch
from _bench_utils import cpu_machine_info

from v1engine.kv_cache_interface import FullAttentionSpec
from v1engine.model.layers import cpu_attention_backend, cpu_kernels
from v1engine.model.layers.torch_attention import TorchAttentionBackend
from v1engine.worker.model_inputs import build_common_attn_metadata, step_layout
from v1engine.worker.request_states import BlockTable

BLOCK_SIZE = 16
DEFAULT_CASES = ["0+144x13", "0+256x4", "0+512x1", "0+1024x1", "0+2048x1", "1024+512x1"]


def parse_case(case: str) -> tuple[int, int, int]:
    try:
        lengths, count = case.split("x")
        cached, new = lengths.split("+")
        return int(cached), int(new), int(count)
    except ValueError:
        raise SystemExit(f"bad case {case!r}: write CACHED+NEWxCOUNT, e.g. 0+512x1") from None


def parse_shape(shape: str) -> tuple[int, int, int]:
    try:
        num_heads, num_kv_heads, head_size = (int(v) for v in shape.split(","))
    except ValueError:
        raise SystemExit(f"bad --shape {shape!r}: write H,KVH,D, e.g. 9,3,64") from None
    if num_heads % num_kv_heads:
        raise SystemExit(f"--shape {shape}: H must be a multiple of KVH")
    return num_heads, num_kv_heads, head_size


def make_step(cached: int, new: int, count: int, dtype: torch.dtype, shape: tuple):
    """A step of `count` requests over caches of random keys and values, heads as `shape`
    (H, KVH, D): (query, caches, CommonAttentionMetadata)."""
    num_heads, num_kv_heads, head_size = shape
    blocks_each = -(-(cached + new) // BLOCK_SIZE)
    size = (blocks_each * count, BLOCK_SIZE, num_kv_heads, head_size)
    caches = (torch.randn(size).to(dtype), torch.randn(size).to(dtype))
    layout = step_layout(np.full(count, cached), np.full(count, new))
    table = BlockTable(count, cached + new, BLOCK_SIZE)
    for row in range(count):
        table.set_row(row, list(range(row * blocks_each, (row + 1) * blocks_each)))
    query_start_loc = torch.from_numpy(layout.query_start_loc).to(torch.int32)
    [common] = build_common_attn_metadata([table], layout, query_start_loc, torch.device("cpu"))
    query = torch.randn(count * new, num_heads, head_size).to(dtype)
    return query, caches, common


def systems(common, caches, baseline: dict | None, current=None) -> dict:
    """name -> a call computing the step's attention (`current`: the kernel to time, None: this
    process's)."""
    _, _, num_kv_heads, head_size = caches[0].shape
    spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads, head_size, caches[0].dtype)
    torch_backend = TorchAttentionBackend()
    torch_metadata = torch_backend.build_metadata(common, spec)
    scale = head_size**-0.5
    table = common.block_table[: common.num_reqs].to(torch.int32).contiguous()
    seq_lens = common.seq_lens.to(torch.int32).contiguous()
    starts = common.query_start_loc.to(torch.int32).contiguous()

    def kernel(function=None):
        return lambda q: cpu_kernels.paged_attention(
            q, *caches, table, seq_lens, scale, None, starts, function=function
        )

    calls = {
        "kernel": kernel(current),
        "torch": lambda q: torch_backend.forward(q, caches, torch_metadata, scale, None),
    }
    if baseline is not None:
        calls[f"kernel@{baseline['ref']}"] = kernel(baseline["function"])
    return calls


def evict_caches(buffer: torch.Tensor | None) -> None:
    """Reads `buffer` (several times the last-level cache), pushing the step's caches out of it."""
    if buffer is not None:
        buffer.sum()


def measure_case(case: str, args, baseline: dict | None, current=None) -> dict:
    cached, new, count = parse_case(case)
    dtype = getattr(torch, args.dtype)
    shape = parse_shape(args.shape)
    query, caches, common = make_step(cached, new, count, dtype, shape)
    calls = systems(common, caches, baseline, current)
    times: dict[str, list[float]] = {name: [] for name in calls}
    flush = torch.ones(args.cold << 18) if args.cold else None  # MB of 4-byte floats
    with torch.inference_mode():
        outputs = {name: call(query) for name, call in calls.items()}  # warm-up
        for repeat in range(args.repeats):
            for name in list(calls)[:: 1 if repeat % 2 == 0 else -1]:
                evict_caches(flush)
                start = time.perf_counter()
                calls[name](query)
                times[name].append(time.perf_counter() - start)
    # rows x keys seen: row i of a request sees cached + i + 1 keys.
    pairs = count * (new * cached + new * (new + 1) // 2)
    flops = 4 * pairs * shape[0] * shape[2]
    row: dict = {"case": case, "row_key_pairs": pairs}
    for name, samples in times.items():
        median = statistics.median(samples)
        row[name] = {"median_ms": round(median * 1e3, 3), "gflops": round(flops / median / 1e9, 1)}
        if name != "torch":
            diff = (outputs[name].float() - outputs["torch"].float()).abs().max().item()
            row[name]["max_abs_diff_vs_torch"] = float(f"{diff:.2e}")
    longest = new * (cached + new)
    kernel = cpu_attention_backend.kernel_attends(longest, *shape)
    row["pick"] = "kernel" if kernel else "torch"
    return row


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--shape", default="9,3,64", help="query heads, KV heads, head size")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--baseline-ref", default=None, help="git ref whose kernel is measured too")
    p.add_argument("--march", default=None, help="build the kernels for this -march instead")
    p.add_argument(
        "--cold",
        type=int,
        nargs="?",
        const=256,
        default=0,
        metavar="MB",
        help="evict the caches before every call by reading MB megabytes (default 256)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def print_row(case: str, row: dict) -> None:
    systems = [k for k, v in row.items() if isinstance(v, dict)]
    cells = [f"{k} {row[k]['median_ms']:8.2f} ({row[k]['gflops']:5.1f})" for k in systems]
    fastest = min(systems, key=lambda k: row[k]["median_ms"])
    print(
        f"{case:>12}: " + " | ".join(cells) + f" | fastest {fastest}, backend picks {row['pick']}",
        flush=True,
    )


def main() -> None:
    args = parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels did not build here (see the warning above)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_attention-") as workdir:
        from _kernel_builds import library

        key = "paged_attention", getattr(torch, args.dtype)
        baseline = current = None
        if args.baseline_ref:
            built = library(args.baseline_ref, workdir, args.march)
            baseline = {"ref": args.baseline_ref, "function": built[key]}
        if args.march:
            current = library(None, workdir, args.march)[key]
        built_for = f"kernels built for -march={args.march}" if args.march else "native kernels"
        print(f"{args.dtype}, {args.threads} threads, {built_for}; ms per layer (GFLOP/s)")
        rows = []
        for case in args.cases:
            rows.append(measure_case(case, args, baseline, current))
            print_row(case, rows[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": cpu_machine_info(), "args": vars(args), "results": rows}, f, indent=2
            )


if __name__ == "__main__":
    main()
