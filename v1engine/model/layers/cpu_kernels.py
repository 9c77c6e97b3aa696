"""Our compiled CPU kernels for decode steps: the matmul of a few tokens (`cpu_gemv.c`) and paged
decode attention (`cpu_decode_attention.c`), each of which torch and oneDNN run several times slower
at these sizes (`scripts/bench_gemm.py`, `scripts/profile_steps.py`).

They are built on first use with the system C compiler for this CPU (`-march=native`) into
`~/.cache/v1engine/kernels/cpu_kernels-<hash>.so`, named by the sources, the flags and the CPU's
feature flags, so every process and every later start loads the same file (building takes about a
second). Without a working compiler, or if a kernel disagrees with torch on a probe, `available()`
is False and callers stay on oneDNN and the torch attention backend.
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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from v1engine.logger import init_logger
from v1engine.utils import DEFAULT_CACHE_DIR

logger = init_logger(__name__)

# From about eight tokens on oneDNN's GEMM is as fast or faster (scripts/bench_gemm.py).
MAX_GEMV_TOKENS = 4
_HERE = os.path.dirname(__file__)
SOURCES = tuple(
    os.path.join(_HERE, f) for f in ("cpu_gemv.c", "cpu_decode_attention.c", "cpu_rms_norm.c")
)
HEADERS = (os.path.join(_HERE, "cpu_kernels.h"),)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class _Kernels:
    gemv: dict[torch.dtype, ctypes._CFuncPtr]
    decode_attention: dict[torch.dtype, ctypes._CFuncPtr]
    rms_norm: dict[torch.dtype, ctypes._CFuncPtr]
    write_kv: ctypes._CFuncPtr | None = None


def available() -> bool:
    """Whether the kernels built, loaded and agree with torch in this process."""
    return _kernels() is not None


def applies(*tensors: torch.Tensor | None) -> bool:
    """Whether a kernel may take these inputs: CPU tensors of one dtype the kernels read, none
    that autograd records (the kernels have no backward), and the kernels available."""
    present = [t for t in tensors if t is not None]
    dtype = present[0].dtype
    return (
        dtype in _SUFFIXES
        and all(t.device.type == "cpu" and t.dtype == dtype for t in present)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in present))
        and available()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for contiguous CPU float32/bfloat16 tensors of one dtype, meant
    for x [..., K] of a few rows (`MAX_GEMV_TOKENS`): the kernel keeps one sum per row on the
    stack."""
    return _gemv(_loaded().gemv[x.dtype], x, weight, bias)


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query token per sequence over its paged keys (attention_backend.py's layout).

    query [num_seqs, num_heads, head_size]; key_cache/value_cache [num_blocks, block_size,
    num_kv_heads, head_size] of query's dtype; block_table [num_seqs, stride] int32 (rows may be
    longer than needed); seq_lens [num_seqs] int32, each >= 1. All contiguous, on the CPU.
    Returns [num_seqs, num_heads, head_size].
    """
    return _decode_attention(
        _loaded().decode_attention[query.dtype],
        query,
        (key_cache, value_cache),
        block_table,
        seq_lens,
        scale,
        sliding_window,
    )


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x + residual) * weight, x + residual), or (RMSNorm(x) * weight, None) without a
    residual, as layernorm.py computes them; x, residual [..., hidden] of weight's dtype."""
    return _rms_norm(_loaded().rms_norm[x.dtype], x, residual, weight, eps)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Stores key/value [num_tokens, num_kv_heads, head_size] at `slots` ([num_tokens] int64,
    contiguous, none -1) of the caches. Rows may be strided (views into the fused QKV output)."""
    num_tokens, num_kv_heads, head_size = key.shape
    key, value = (_with_contiguous_rows(t, key_cache.dtype) for t in (key, value))
    itemsize = key.element_size()
    _loaded().write_kv(
        key.data_ptr(),
        value.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slots.data_ptr(),
        num_tokens,
        key.stride(0) * itemsize,
        value.stride(0) * itemsize,
        num_kv_heads * head_size * itemsize,
    )


def _with_contiguous_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.to(dtype)
    return t if t.stride()[1:] == (t.shape[2], 1) else t.contiguous()


def _rms_norm(kernel, x, residual, weight, eps):
    hidden = x.shape[-1]
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    kernel(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.contiguous().data_ptr(),
        None if total is None else total.data_ptr(),
        out.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
    )
    return out, total


def _gemv(kernel: ctypes._CFuncPtr, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
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


def _decode_attention(kernel, query, kv_cache, block_table, seq_lens, scale, sliding_window):
    key_cache, value_cache = kv_cache
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    failed = kernel(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        block_table.stride(0),
        sliding_window or 0,
        scale,
    )
    if failed:
        raise MemoryError("decode attention could not allocate its score buffers")
    return out


def _loaded() -> _Kernels:
    kernels = _kernels()
    assert kernels is not None, "check cpu_kernels.available() first"
    return kernels


@functools.cache
def _kernels() -> _Kernels | None:
    try:
        library = ctypes.CDLL(build_library())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU decode kernels unavailable; using oneDNN and torch attention: %s", e)
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_long
    kernels = _Kernels({}, {}, {}, _function(library, "v1e_write_kv", [pointer] * 5 + [size] * 4))
    for dtype, suffix in _SUFFIXES.items():
        kernels.gemv[dtype] = _function(library, f"v1e_gemv_{suffix}", [pointer] * 4 + [size] * 3)
        kernels.decode_attention[dtype] = _function(
            library,
            f"v1e_decode_attention_{suffix}",
            [pointer] * 6 + [size] * 7 + [ctypes.c_float],
            ctypes.c_int,
        )
        kernels.rms_norm[dtype] = _function(
            library, f"v1e_rms_norm_{suffix}", [pointer] * 5 + [size] * 2 + [ctypes.c_float]
        )
    return kernels if _agrees_with_torch(kernels) else None


def _function(library: ctypes.CDLL, name: str, argtypes: list, restype=None) -> ctypes._CFuncPtr:
    function = getattr(library, name)
    function.argtypes = argtypes
    function.restype = restype
    return function


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
        _compile(root, path)
    return path


def _compile(root: str, path: str) -> None:
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
            [compiler, *CFLAGS, *SOURCES, "-lm", "-o", temp],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to build {SOURCES}:\n{result.stderr[-2000:]}")
        os.replace(temp, path)
        logger.info("Compiled the CPU decode kernels into %s", path)
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


# -- the probe: each kernel against torch on small inputs, once per process ----------------------


def _agrees_with_torch(kernels: _Kernels) -> bool:
    generator = torch.Generator().manual_seed(0)
    for dtype in _SUFFIXES:
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        for tokens in (1, MAX_GEMV_TOKENS + 1):  # the single-row path and the four-row tiles
            x = torch.randn(tokens, 37, generator=generator)
            weight = torch.randn(5, 37, generator=generator)
            bias = torch.randn(5, generator=generator)
            out = _gemv(kernels.gemv[dtype], x.to(dtype), weight.to(dtype), bias.to(dtype))
            if not _close(out, F.linear(x, weight, bias), tolerance, "gemv", dtype):
                return False
        x, residual = torch.randn(2, 2, 37, generator=generator)
        weight = torch.rand(37, generator=generator) + 0.5
        out, total = _rms_norm(
            kernels.rms_norm[dtype], x.to(dtype), residual.to(dtype), weight.to(dtype), 1e-5
        )
        expected = _reference_rms_norm((x + residual).to(dtype), weight.to(dtype), 1e-5)
        if not _close(out, expected, tolerance, "RMSNorm", dtype):
            return False
        for window in (None, 3):
            case = _attention_probe(generator, dtype)
            out = _decode_attention(kernels.decode_attention[dtype], *case, 0.3, window)
            expected = _reference_decode_attention(*case, 0.3, window)
            if not _close(out, expected, tolerance, "decode attention", dtype):
                return False
    return True


def _close(out: torch.Tensor, expected: torch.Tensor, tolerance: float, name: str, dtype) -> bool:
    if torch.allclose(out.float(), expected.float(), rtol=tolerance, atol=tolerance):
        return True
    logger.warning("CPU %s kernel disagrees with torch (%s); the kernels are not used", name, dtype)
    return False


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _attention_probe(generator: torch.Generator, dtype: torch.dtype) -> tuple:
    """Two sequences (5 and 3 keys), 4 query heads over 2 KV heads, blocks of 2, shuffled."""
    key_cache = torch.randn(6, 2, 2, 8, generator=generator).to(dtype)
    value_cache = torch.randn(6, 2, 2, 8, generator=generator).to(dtype)
    query = torch.randn(2, 4, 8, generator=generator).to(dtype)
    block_table = torch.tensor([[4, 0, 5, 1], [2, 3, 1, 1]], dtype=torch.int32)
    return query, (key_cache, value_cache), block_table, torch.tensor([5, 3], dtype=torch.int32)


def _reference_decode_attention(query, kv_cache, block_table, seq_lens, scale, window):
    out = torch.empty_like(query, dtype=torch.float32)
    block_size, num_kv_heads = kv_cache[0].shape[1], kv_cache[0].shape[2]
    group = query.shape[1] // num_kv_heads
    for s, seq_len in enumerate(seq_lens.tolist()):
        first = 0 if window is None else max(0, seq_len - window)
        positions = torch.arange(first, seq_len)
        slots = block_table[s].long()[positions // block_size] * block_size + positions % block_size
        key, value = (c.flatten(0, 1)[slots].float().repeat_interleave(group, 1) for c in kv_cache)
        weights = torch.softmax(torch.einsum("hd,khd->hk", query[s].float(), key) * scale, -1)
        out[s] = torch.einsum("hk,khd->hd", weights, value)
    return out
