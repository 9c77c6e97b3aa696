"""Building and loading the CPU kernels' shared library (the C files next to this module).

The library is compiled on first use with the system C compiler for this CPU (`-march=native`)
into `~/.cache/v1engine/kernels/cpu_kernels-<hash>.so`, named by the sources, the flags and the
CPU's feature flags, so every process and every later start loads the same file (building takes
about a second). OpenMP in the kernels resolves to the libgomp torch has already loaded (same
soname), so their threads are torch's intra-op threads and `torch.set_num_threads` sizes them.
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

from v1engine.logger import init_logger
from v1engine.utils import DEFAULT_CACHE_DIR

logger = init_logger(__name__)

_HERE = os.path.dirname(__file__)
SOURCES = tuple(
    os.path.join(_HERE, name)
    for name in (
        "cpu_gemv.c",
        "cpu_gemm.c",
        "cpu_gemm_packed.c",
        "cpu_paged_attention.c",
        "cpu_attention_blocked.c",
        "cpu_rms_norm.c",
        "cpu_elementwise.c",
        "cpu_decoder_stack.c",
    )
)
HEADERS = tuple(
    os.path.join(_HERE, name) for name in ("cpu_kernels.h", "cpu_vectors.h", "cpu_attention.h")
)
# GCC vectorizes loops 256 bits wide on AVX-512 CPUs unless told otherwise; the loops it vectorizes
# here (softmax's exponentials, norms, SiLU) ran faster 512 wide (no effect on other ISAs).
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120

# The dtypes every typed kernel exists for, and the suffix of its C name (v1e_<name>_<suffix>).
KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _N, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
# name -> (argument types, return type), as the C files declare them.
_TYPED = {
    "gemv": ([_P] * 4 + [_N] * 3, ctypes.c_int),
    "paged_attention": ([_P] * 7 + [_N] * 7 + [_F, _F], ctypes.c_int),
    "rms_norm": ([_P] * 5 + [_N] * 2 + [_F], None),
    "rotary": ([_P] * 6 + [_N] * 6, None),
    "silu_and_mul": ([_P] * 2 + [_N] * 2, None),
    "decoder_stack": ([_P, _N] + [_P] * 5, ctypes.c_int),
    # bfloat16 only where the CPU has AVX512-BF16's dot product (cpu_gemm.c)
    "gemm": ([_P] * 4 + [_N] * 3, ctypes.c_int),
}
_UNTYPED = {
    "write_kv": ([_P] * 5 + [_N] * 4, None),
    "gemm_panel_width": ([], ctypes.c_long),
    "attention_prefill_passes": ([_N] * 3, ctypes.c_int),
}
# Kernels that exist for float32 only (v1e_<name>_f32).
_FLOAT32 = {
    "gemm_packed": ([_P] * 4 + [_N] * 3, None),
    "pack_weight": ([_P] * 2 + [_N] * 2, None),
}


@functools.cache
def load_kernels() -> dict[tuple[str, torch.dtype | None], ctypes._CFuncPtr] | None:
    """(name, dtype) -> the C function `v1e_<name>[_<dtype suffix>]` (dtype None for the untyped
    ones); None, with a warning, if the library cannot be built or loaded."""
    try:
        library = ctypes.CDLL(build_library())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU decode kernels unavailable; using torch and oneDNN: %s", e)
        return None
    return bind_kernels(library)


def bind_kernels(library: ctypes.CDLL) -> dict[tuple[str, torch.dtype | None], ctypes._CFuncPtr]:
    """`load_kernels`' table for a loaded library (also one built from other sources, as
    `scripts/bench_gemm.py --baseline-ref` does): each function with its C signature."""
    symbols = {(name, None): (f"v1e_{name}", sig) for name, sig in _UNTYPED.items()}
    for name, signature in _TYPED.items():
        for dtype, suffix in KERNEL_DTYPES.items():
            symbols[name, dtype] = (f"v1e_{name}_{suffix}", signature)
    for name, signature in _FLOAT32.items():
        symbols[name, torch.float32] = (f"v1e_{name}_f32", signature)
    kernels = {}
    for key, (symbol, (argtypes, restype)) in symbols.items():
        function = getattr(library, symbol, None)
        if function is None:  # a build of older sources (bench --baseline-ref) lacks newer ones
            continue
        function.argtypes, function.restype = argtypes, restype
        kernels[key] = function
    return kernels


def build_library(cache_dir: str | None = None) -> str:
    """The path of the compiled kernels, compiling them unless this CPU already has them cached."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read() + b"\0")
    digest.update(f"{' '.join(CFLAGS)}\0{_cpu_identity()}".encode())
    root = os.path.join(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR), "kernels")
    path = os.path.join(root, f"cpu_kernels-{digest.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        compile_library(root, path)
    return path


def compile_library(
    root: str, path: str, sources: tuple[str, ...] = SOURCES, cflags: tuple[str, ...] = CFLAGS
) -> None:
    """Compiles `sources` (by default this package's) with `cflags` into `path`, inside `root`
    (benchmarks pass other flags to build for another CPU than this one)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc to get the faster decode kernels)")
    os.makedirs(root, exist_ok=True)
    # Build beside the target and rename: workers starting together each build, one rename wins,
    # and no process ever loads a half-written file.
    fd, temp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *cflags, *sources, "-lm", "-o", temp],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to build {sources}:\n{result.stderr[-2000:]}")
        os.replace(temp, path)
        logger.info("Compiled the CPU decode kernels into %s", path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _cpu_identity() -> str:
    """What `-march=native` depends on: the architecture and, on Linux, the CPU's feature flags."""
    info = cpuinfo()
    return f"{platform.machine()} {info.get('flags', info.get('Features', ''))}"


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo (`vendor_id`, `flags`, Arm's `Features`, ...);
    empty where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields
