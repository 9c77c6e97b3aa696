"""The CPU matmul kernels built from two trees, for `bench_gemm.py --baseline-ref`: the working
tree's library (as every process loads it) and one compiled the same way from a git ref's C
sources into a temporary folder, both called through the same thin wrapper, so the two builds
differ in nothing but their sources."""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from collections.abc import Callable

import torch

from v1engine.model.layers import cpu_kernel_library

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


def _wrap(fn) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    fn.restype = ctypes.c_int

    def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        if fn(x.data_ptr(), weight.data_ptr(), None, y.data_ptr(), *y.shape, x.shape[1]):
            raise MemoryError("the kernel could not allocate its buffer")
        return y

    return matmul


def build(ref: str | None, dtype: torch.dtype, workdir: str) -> dict[str, Callable]:
    """{"cpu_gemv": ..., "cpu_gemm": ...} (gemm for float32 only) built from `ref`'s sources
    (None: the working tree's, the library every process already loads)."""
    if ref is None:
        library = cpu_kernel_library.build_library()
    else:
        folder = tempfile.mkdtemp(dir=workdir)
        library = os.path.join(folder, "kernels.so")
        cpu_kernel_library.compile_library(folder, library, tuple(_sources(ref, folder)))
    lib = ctypes.CDLL(library)
    gemv = lib.v1e_gemv_bf16 if dtype == torch.bfloat16 else lib.v1e_gemv_f32
    kernels = {"cpu_gemv": _wrap(gemv)}
    if dtype == torch.float32:
        kernels["cpu_gemm"] = _wrap(lib.v1e_gemm_f32)
    return kernels
