"""The CPU matmul kernels built from two trees, for `bench_gemm.py --baseline-ref`: the working
tree's library (as every process loads it) and one compiled the same way from a git ref's C
sources into a temporary folder, both bound and called as the engine does
(`cpu_kernel_library.bind_kernels`, `cpu_kernels.linear_with`), so that the builds differ in
nothing but their sources."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import tempfile
from collections.abc import Callable

import torch

from v1engine.model.layers import cpu_kernel_library
from v1engine.model.layers.cpu_kernels import linear_with

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAYERS = os.path.relpath(os.path.dirname(cpu_kernel_library.__file__), _REPO)


def _sources(ref: str, into: str) -> list[str]:
    """The library's files at git `ref`, written into `into`; returns the C sources' paths."""
    names = [
        os.path.basename(p) for p in (*cpu_kernel_library.SOURCES, *cpu_kernel_library.HEADERS)
    ]
    for name in names:
        shown = subprocess.run(
            ["git", "-C", _REPO, "show", f"{ref}:{_LAYERS}/{name}"], capture_output=True, timeout=60
        )
        if shown.returncode != 0:
            raise SystemExit(f"--baseline-ref {ref}: no {_LAYERS}/{name} there ({shown.stderr!r})")
        with open(os.path.join(into, name), "wb") as f:
            f.write(shown.stdout)
    return [os.path.join(into, n) for n in names if n.endswith(".c")]


def build(ref: str | None, dtype: torch.dtype, workdir: str) -> dict[str, Callable]:
    """{"cpu_gemv": ..., "cpu_gemm": ...} (gemm for float32 only) built from `ref`'s sources
    (None: the working tree's, the library every process already loads)."""
    if ref is None:
        kernels = cpu_kernel_library.load_kernels()
    else:
        folder = tempfile.mkdtemp(dir=workdir)
        library = os.path.join(folder, "kernels.so")
        cpu_kernel_library.compile_library(folder, library, tuple(_sources(ref, folder)))
        kernels = cpu_kernel_library.bind_kernels(ctypes.CDLL(library))
    names = ("gemv", "gemm") if dtype == torch.float32 else ("gemv",)
    return {f"cpu_{name}": functools.partial(linear_with, kernels[name, dtype]) for name in names}
