"""The CPU kernels built from two trees, for the `--baseline-ref` of bench_gemm.py and
bench_attention.py: the working tree's library (as every process loads it) and one compiled the
same way from a git ref's C sources into a temporary folder, both bound as the engine binds them
(`cpu_kernel_library.bind_kernels`), so that the builds differ in nothing but their sources."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import subprocess
import tempfile
from collections.abc import Callable

import torch

from v1engine.model.layers import cpu_kernel_library
from v1engine.model.layers.cpu_kernels import linear_with, pack_weight

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAYERS = os.path.relpath(os.path.dirname(cpu_kernel_library.__file__), _REPO)


def _sources(ref: str, into: str) -> list[str]:
    """The library's files at git `ref` (every cpu_*.c and .h beside cpu_kernel_library.py there),
    written into `into`; returns the C sources' paths."""
    listed = _git("ls-tree", "--name-only", ref, f"{_LAYERS}/").decode().split()
    names = [os.path.basename(p) for p in listed if os.path.basename(p).startswith("cpu_")]
    names = [n for n in names if n.endswith((".c", ".h"))]
    if not any(n.endswith(".c") for n in names):
        raise SystemExit(f"--baseline-ref {ref}: no CPU kernel sources in {_LAYERS} there")
    for name in names:
        with open(os.path.join(into, name), "wb") as f:
            f.write(_git("show", f"{ref}:{_LAYERS}/{name}"))
    return [os.path.join(into, n) for n in names if n.endswith(".c")]


def _git(*args: str) -> bytes:
    shown = subprocess.run(["git", "-C", _REPO, *args], capture_output=True, timeout=60)
    if shown.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {shown.stderr.decode().strip()}")
    return shown.stdout


def library(
    ref: str | None, workdir: str, march: str | None = None
) -> dict[tuple[str, torch.dtype | None], Callable]:
    """`cpu_kernel_library.load_kernels()`'s table, for the library built from `ref`'s sources
    (None: the working tree's, the library every process already loads), with `-march=<march>`
    for another CPU than this one (e.g. x86-64-v3: AVX2 without AVX-512) where given."""
    if ref is None and march is None:
        return cpu_kernel_library.load_kernels()
    folder = tempfile.mkdtemp(dir=workdir)
    path = os.path.join(folder, "kernels.so")
    sources = cpu_kernel_library.SOURCES if ref is None else tuple(_sources(ref, folder))
    flags = cpu_kernel_library.CFLAGS
    if march is not None:
        flags = tuple(f"-march={march}" if f == "-march=native" else f for f in flags)
    cpu_kernel_library.compile_library(folder, path, sources, flags)
    kernels = cpu_kernel_library.bind_kernels(ctypes.CDLL(path))
    if ref is None:
        return kernels
    with open(os.path.join(folder, "cpu_kernels.h")) as f:
        if "void v1e_gemv_##S" in f.read():  # until 2026-11-28 the gemv returned nothing
            for dtype in cpu_kernel_library.KERNEL_DTYPES:
                kernels["gemv", dtype].restype = None
    return kernels


def build(ref: str | None, dtype: torch.dtype, workdir: str) -> dict[str, Kernel]:
    """{"cpu_gemv": ..., "cpu_gemm": ..., "cpu_gemm_packed": ...} (each gemm where the build has
    it for `dtype`: the tiled one in bfloat16 with AVX512-BF16 since 2026-11-28, the packed one
    in float32) from `library(ref, ...)`, called as the engine calls them
    (`cpu_kernels.linear_with`)."""
    kernels = library(ref, workdir)
    names = [n for n in ("gemv", "gemm") if (n, dtype) in kernels]
    built = {f"cpu_{n}": Kernel(functools.partial(linear_with, kernels[n, dtype])) for n in names}
    if ("gemm_packed", dtype) in kernels:  # since 2026-11-27
        gemm = functools.partial(linear_with, kernels["gemm_packed", dtype])
        built["cpu_gemm_packed"] = Kernel(
            lambda x, packed: gemm(x, packed[0], None, packed[1]),
            lambda weight: (pack_weight(weight, kernels), weight.shape[0]),
        )
    return built


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A matmul as a benchmark times it: `run(x, prepare(weight))`, where `prepare` does once
    per weight what the engine does at load time (packing it, for the float32 gemm)."""

    run: Callable
    prepare: Callable = lambda weight: weight
