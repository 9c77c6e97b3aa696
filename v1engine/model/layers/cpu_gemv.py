"""The CPU matmul for decode-sized inputs (a few tokens): `cpu_gemv.c`, compiled on first use.

At one token oneDNN's linear reads the weights at 12-24 GB/s on the machine we measure on and this
kernel at 27-42 (`scripts/bench_gemm.py`); from about eight tokens on, oneDNN's GEMM is as fast or
faster, so `linear` sends only inputs of at most `MAX_TOKENS` rows here. The kernel is built with
the system C compiler for this CPU (`-march=native`) into
`~/.cache/v1engine/kernels/cpu_gemv-<hash>.so`, named by the source, the flags and the CPU's
feature flags, so every process and every later start loads the same file (building takes about
a second). Without a working compiler, or if the kernel disagrees with `F.linear` on a probe,
`gemv_available()` is False and the caller stays on oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import torch
import torch.nn.functional as F

from v1engine.logger import init_logger
from v1engine.utils import DEFAULT_CACHE_DIR

logger = init_logger(__name__)

MAX_TOKENS = 4
SOURCE = os.path.join(os.path.dirname(__file__), "cpu_gemv.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120
_FUNCTIONS = {torch.float32: "v1e_gemv_f32", torch.bfloat16: "v1e_gemv_bf16"}


def gemv_available() -> bool:
    """Whether the kernel built, loaded and agrees with `F.linear` in this process."""
    return _kernels() is not None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for contiguous CPU float32/bfloat16 tensors of one dtype, meant
    for x [..., K] of a few rows (`MAX_TOKENS`): the kernel keeps one sum per row on the stack."""
    kernels = _kernels()
    assert kernels is not None, "check gemv_available() first"
    return _run(kernels[x.dtype], x, weight, bias)


def _run(kernel: ctypes._CFuncPtr, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    kernel(
        rows.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        out_features,
        in_features,
    )
    return out.view(*x.shape[:-1], out_features)


@functools.cache
def _kernels() -> dict[torch.dtype, ctypes._CFuncPtr] | None:
    try:
        library = ctypes.CDLL(build_library())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU decode kernel unavailable, using oneDNN for every matmul: %s", e)
        return None
    kernels = {}
    for dtype, name in _FUNCTIONS.items():
        function = getattr(library, name)
        function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
        function.restype = None
        kernels[dtype] = function
    return kernels if _agrees_with_torch(kernels) else None


def build_library(cache_dir: str | None = None) -> str:
    """The path of the compiled kernel, compiling it unless this CPU already has one cached."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(CFLAGS).encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    root = os.path.join(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR), "kernels")
    path = os.path.join(root, f"cpu_gemv-{key}.so")
    if not os.path.exists(path):
        _compile(root, path)
    return path


def _compile(root: str, path: str) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc to get the faster decode kernel)")
    os.makedirs(root, exist_ok=True)
    # Build beside the target and rename: workers starting together each build, one rename wins,
    # and no process ever loads a half-written file.
    fd, temp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *CFLAGS, SOURCE, "-o", temp],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to build {SOURCE}:\n{result.stderr[-2000:]}")
        os.replace(temp, path)
        logger.info("Compiled the CPU decode kernel into %s", path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _cpu_identity() -> str:
    """What `-march=native` depends on: the architecture and, on Linux, the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags.strip()}"


def _agrees_with_torch(kernels: dict) -> bool:
    generator = torch.Generator().manual_seed(0)
    for dtype, function in kernels.items():
        for tokens in (1, MAX_TOKENS + 1):  # the single-row path and the four-row tiles
            x = torch.randn(tokens, 37, generator=generator).to(dtype)
            weight = torch.randn(5, 37, generator=generator).to(dtype)
            bias = torch.randn(5, generator=generator).to(dtype)
            out = _run(function, x, weight, bias)
            expected = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
            tolerance = 1e-4 if dtype == torch.float32 else 1e-2
            if not torch.allclose(out.float(), expected.float(), rtol=tolerance, atol=tolerance):
                logger.warning("CPU decode kernel disagrees with F.linear (%s); not used", dtype)
                return False
    return True
