"""Our compiled CPU kernels for decode steps, as torch ops: the matmul of up to a few dozen
tokens (float32: `cpu_gemv.c` for one, `cpu_gemm_packed.c` on weights packed at load time, then
the tiled `cpu_gemm.c`; bfloat16: `cpu_gemv.c`, then `cpu_gemm.c` on CPUs with AVX512-BF16),
paged attention and its K/V write (`cpu_paged_attention.c`), RMSNorm with its residual add
(`cpu_rms_norm.c`), rotary embedding and SiLU-and-mul (`cpu_elementwise.c`). At decode sizes
torch and oneDNN run each of these several times slower: the matmuls read the weights at half
the memory bandwidth or less (or, at a few dozen tokens, reach half their prefill GFLOP/s), the
small ops are several dispatches each (`scripts/bench_gemm.py`, `scripts/profile_steps.py`).

The library is built on first use (`cpu_kernel_library.py`) and checked against torch once per
process (`cpu_kernel_probe.py`); callers ask `applies(...)` and otherwise stay on torch/oneDNN.
Every op takes CPU tensors of one dtype, float32 or bfloat16, and computes in float32.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from v1engine.logger import init_logger
from v1engine.model.layers.cpu_kernel_library import KERNEL_DTYPES, cpuinfo, load_kernels
from v1engine.utils import cdiv

logger = init_logger(__name__)

# Up to this many rows our gemv beats the other kernels. bfloat16 (scripts/bench_gemm.py, the
# SmolLM2 step's matmuls and LM head, 2-core Zen 5, three runs): 9.2 vs 12.0 ms for oneDNN at 4
# rows, 11.6-12.6 vs 14.6-15.2 at 5; at 6 no faster (14.5-15.2 vs 12.2-15.0), as the gemv's
# second pass over each weight row (a four-row tile, then the rest) costs more than it saves.
# float32: one row (2-core AVX-512 Xeon), where the engine's decode step took 31.2-32.1 ms against
# 32.1-32.6 with the packed gemm (scripts/profile_steps.py, three alternating runs); from two rows
# the packed gemm wins (bench_gemm: 32 vs 34-48 ms for the step's matmuls at 2 to 8 rows).
# Where the CPU has the bfloat16 gemm (AVX512-BF16, below) the gemv keeps 1-2 rows only: at 3 the
# gemm took 8.4 ms against 9.9, at 4 8.1-8.6 against 7.9-8.6, at 5 8.3 against 11.4, and at 1
# and 2 it was slower (8.2 vs 5.0, 8.3 vs 7.0; bench_gemm.py, Zen 5).
_MAX_GEMV_TOKENS = {torch.float32: 1, torch.bfloat16: 5}
_MAX_GEMV_TOKENS_BESIDE_BF16_GEMM = 2


# Up to this many rows our matmuls beat the library that takes the rows past them
# (scripts/bench_gemm.py, the SmolLM2 step's matmuls, weights from memory). float32: the gemm on
# packed weights up to _MAX_GEMM_PACKED_TOKENS, the tiled gemm past it, where the packed one falls
# behind (cpu_gemm_packed.c has the decode steps' times). Where that is depends on the CPU:
# - Intel, against MKL and oneDNN (2-core Xeon with AVX-512): 48 vs 71 ms at 16 rows, 58 vs 90 at
#   32, 90 vs 134 at 48, 105-110 vs 128-132 at 64; level at 80, behind from 96.
# - Other CPUs with AVX-512, against oneDNN (2-core AMD EPYC, Zen 5; two runs): 59 vs 73-74 ms at
#   96 rows, 83 vs 90-93 at 128; 137 vs 141 at 192 (one run), behind at 256 (185 vs 178).
# CPUs measured on neither (AVX2 only, Arm) keep the Xeon's limit.
# bfloat16: the tiled gemm on AVX512-BF16's dot product (cpu_gemm.c), past the gemv, measured on
# the Zen 5 only (where it is built: non-Intel CPUs with AVX-512 and that flag) against oneDNN:
# the step's matmuls and LM head took 9.5 vs 18.2 ms at 16 rows, 25.0 vs 39.6 at 64, 49.1 vs 58.6
# at 128, 62.5 vs 69.2 at 160 and 73.5 vs 77.1 at 192; a second run had 128 level (45.6 vs 46.5)
# and 160 and 192 behind (57.0 vs 54.5, 67.0 vs 62.1), so the limit is 128. Intel CPUs with that
# flag, not measured, keep oneDNN, which has AMX kernels for many of them.
_MAX_GEMM_TOKENS = {torch.float32: 64}
_MAX_GEMM_TOKENS_NON_INTEL_AVX512 = {torch.float32: 128}
_MAX_GEMM_TOKENS_BF16_DOT = {torch.bfloat16: 128}
_MAX_GEMM_PACKED_TOKENS = {torch.float32: 32}


def is_intel_cpu() -> bool:
    """Whether this is an Intel CPU (where MKL and our limits were measured against each other)."""
    return cpuinfo().get("vendor_id") == "GenuineIntel"


@functools.cache
def _row_limits() -> dict[tuple[str, torch.dtype], int]:
    """(kernel, dtype) -> the most rows it takes, as measured on this kind of CPU; chosen once
    (`linear` asks every call)."""
    info = cpuinfo()  # empty where unreadable: a CPU measured on neither
    flags = info.get("flags", "").split()
    gemv, gemm = dict(_MAX_GEMV_TOKENS), _MAX_GEMM_TOKENS
    if info.get("vendor_id") and not is_intel_cpu() and "avx512f" in flags:
        gemm = dict(_MAX_GEMM_TOKENS_NON_INTEL_AVX512)
        # (a compiler too old for the flag leaves the kernel out of the library)
        if "avx512_bf16" in flags and ("gemm", torch.bfloat16) in (load_kernels() or {}):
            gemm.update(_MAX_GEMM_TOKENS_BF16_DOT)
            gemv[torch.bfloat16] = _MAX_GEMV_TOKENS_BESIDE_BF16_GEMM
    limits = {("gemv", dtype): n for dtype, n in gemv.items()}
    return limits | {("gemm", dtype): n for dtype, n in gemm.items()}


def max_gemv_tokens(dtype: torch.dtype) -> int:
    """The most rows `gemv` takes for `dtype` inputs (0 for dtypes it has no kernel for)."""
    return _row_limits().get(("gemv", dtype), 0)


def _gemm_width_ok(dtype: torch.dtype, in_features: int) -> bool:
    """The bfloat16 gemm reads pairs along k, so it takes an even width only."""
    return dtype != torch.bfloat16 or in_features % 2 == 0


def max_gemm_tokens(dtype: torch.dtype, in_features: int = 0) -> int:
    """The most rows `gemm` is meant for with `dtype` inputs of `in_features` (0: no kernel for
    them, or a width it cannot take)."""
    if not _gemm_width_ok(dtype, in_features):
        return 0
    return _row_limits().get(("gemm", dtype), 0)


def max_gemm_packed_tokens(dtype: torch.dtype) -> int:
    """The most rows `gemm_packed` is meant for with `dtype` inputs (0: no kernel for this dtype);
    past them, up to `max_gemm_tokens`, `gemm`."""
    return _MAX_GEMM_PACKED_TOKENS.get(dtype, 0)


@functools.cache
def available() -> bool:
    """Whether the kernels built, loaded and agree with torch in this process."""
    if load_kernels() is None:
        return False
    from v1engine.model.layers.cpu_kernel_probe import agrees_with_torch

    return agrees_with_torch()


def cpu_inputs(*tensors: torch.Tensor | None) -> bool:
    """Whether these are inputs a CPU kernel reads: CPU tensors of one dtype it has (float32 or
    bfloat16), none that autograd records (the kernels have no backward). None entries are
    skipped; the first must be a tensor."""
    present = [t for t in tensors if t is not None]
    dtype = present[0].dtype
    return (
        dtype in KERNEL_DTYPES
        and all(t.device.type == "cpu" and t.dtype == dtype for t in present)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in present))
    )


def applies(*tensors: torch.Tensor | None) -> bool:
    """Whether a kernel may take these inputs: `cpu_inputs`, and the kernels available."""
    return cpu_inputs(*tensors) and available()


def kernel(name: str, dtype: torch.dtype | None = None):
    """The C function `name` for `dtype` (None for the untyped ones); needs `available()`."""
    kernels = load_kernels()
    assert kernels is not None, "check cpu_kernels.available() first"
    return kernels[name, dtype]


def data_pointer(t: torch.Tensor | None) -> int | None:
    """t's address for a C pointer argument; None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, meant for x [..., K] of a few rows (`max_gemv_tokens`): the
    kernel keeps one sum per row on the stack. weight and bias contiguous."""
    return linear_with(kernel("gemv", x.dtype), x, weight, bias)


def pack_weight(weight: torch.Tensor, kernels: dict | None = None) -> torch.Tensor:
    """float32 weight [N, K] (contiguous) as `gemm_packed` reads it: panels of
    `v1e_gemm_panel_width()` outputs, k-major, zero padded (cpu_gemm_packed.c), in a flat tensor.
    `kernels`: another build's table (`cpu_kernel_library.bind_kernels`), for benchmarks."""
    kernels = load_kernels() if kernels is None else kernels
    out_features, in_features = weight.shape
    width = kernels["gemm_panel_width", None]()
    panels = cdiv(out_features, width)
    packed = torch.empty(panels * in_features * width, dtype=torch.float32)
    kernels["pack_weight", torch.float32](
        weight.data_ptr(), packed.data_ptr(), out_features, in_features
    )
    return packed


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K] of any number of rows (meant for a few dozen:
    `max_gemm_tokens`, which also says whether there is a kernel for x's dtype and K); weight and
    bias contiguous. Each output row depends only on its own input row."""
    if not _gemm_width_ok(x.dtype, x.shape[-1]):
        raise ValueError(
            f"the bfloat16 gemm reads pairs along k, so in_features must be even, got "
            f"{x.shape[-1]}; call linear(), which sends odd widths to oneDNN"
        )
    return linear_with(kernel("gemm", x.dtype), x, weight, bias)


def gemm_packed(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`gemm(x, weight, bias)`, the same bits, with `packed = pack_weight(weight)`: faster up to
    `max_gemm_packed_tokens` rows (cpu_gemm_packed.c)."""
    return linear_with(kernel("gemm_packed", x.dtype), x, packed, bias, out_features)


def linear_with(
    function,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_features: int | None = None,
) -> torch.Tensor:
    """`F.linear` through `function`, a bound gemv or gemm (`kernel(...)`, or
    `cpu_kernel_library.bind_kernels` of another build); weight [N, K], or packed with
    `out_features` N."""
    in_features = x.shape[-1]
    out_features = weight.shape[0] if out_features is None else out_features
    rows = x.reshape(-1, in_features).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    failed = function(
        rows.data_ptr(),
        weight.data_ptr(),
        data_pointer(bias),
        out.data_ptr(),
        rows.shape[0],
        out_features,
        in_features,
    )
    if failed:  # the tiled gemm packs x, the bfloat16 gemv widens it; the packed gemm returns None
        raise MemoryError("the CPU matmul kernel could not allocate its copy of the input rows")
    return out.view(*x.shape[:-1], out_features)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x + residual) * weight, x + residual), or (RMSNorm(x) * weight, None) without a
    residual, as layernorm.py computes them; x, residual [..., hidden], weight [hidden]."""
    hidden = x.shape[-1]
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    kernel("rms_norm", x.dtype)(
        x.data_ptr(),
        data_pointer(residual),
        weight.contiguous().data_ptr(),
        data_pointer(total),
        out.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
    )
    return out, total


def rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding as rotary_embedding.py computes it: query [tokens, heads, D],
    key [tokens, kv_heads, D] (each head contiguous, tokens may be strided: views into the fused
    QKV output), cos/sin [tokens, 1, D] -> new contiguous query and key."""
    tokens, num_heads, head_size = query.shape
    query, key = _with_contiguous_heads(query), _with_contiguous_heads(key)
    cos, sin = cos.contiguous(), sin.contiguous()
    query_out, key_out = torch.empty(query.shape, dtype=query.dtype), torch.empty_like(key)
    kernel("rotary", query.dtype)(
        query.data_ptr(),
        key.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        query_out.data_ptr(),
        key_out.data_ptr(),
        tokens,
        num_heads,
        key.shape[1],
        head_size,
        query.stride(0),
        key.stride(0),
    )
    return query_out, key_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * d] (gate | up) -> [tokens, d] = silu(gate) * up, as activation.py computes."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    kernel("silu_and_mul", x.dtype)(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d)
    return out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    query_start_loc: torch.Tensor | None = None,
    function: ctypes._CFuncPtr | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Each request's query rows over its paged keys (attention_backend.py's layout and batch
    contract), by `function` (default: this library's kernel; `scripts/bench_attention.py`
    passes another build's), each score s capped to soft_cap * tanh(s / soft_cap) if given.

    query [num_rows, num_heads, head_size]; key_cache/value_cache [num_blocks, block_size,
    num_kv_heads, head_size] of query's dtype; block_table [num_reqs, stride] int32 (rows may be
    longer than needed); seq_lens [num_reqs] int32; query_start_loc [num_reqs + 1] int32 whose
    last entry is num_rows, or None for one row per request (decodes). All contiguous.
    Returns [num_rows, num_heads, head_size].
    """
    _, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    failed = (function or kernel("paged_attention", query.dtype))(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        data_pointer(query_start_loc),
        out.data_ptr(),
        seq_lens.shape[0],
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        block_table.stride(0),
        sliding_window or 0,
        scale,
        soft_cap or 0.0,
    )
    if failed:
        raise MemoryError("paged attention could not allocate its score buffers")
    return out


PREFILL_PASSES = ("per-key", "blocked, partial", "blocked")


@functools.cache  # a model's layers ask it on every long prefill; the answer never changes
def prefill_passes(num_heads: int, num_kv_heads: int, head_size: int) -> str:
    """Which passes `paged_attention` runs a prompt's rows of these heads through: "blocked"
    (small matrix products, cpu_attention_blocked.c: AVX-512, head sizes 64, 128 and 256, their
    blocks filled by two or more query heads per KV head), "blocked, partial" (the same with one
    query head per KV head: 8 of a block's 12 query vectors) or "per-key"; the blocked passes
    over heads of 256 (Gemma's) are named apart, ", heads of 256": SDPA overtakes them sooner."""
    passes = PREFILL_PASSES[kernel("attention_prefill_passes")(num_heads, num_kv_heads, head_size)]
    return f"{passes}, heads of 256" if passes != "per-key" and head_size == 256 else passes


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
    key = _with_contiguous_heads(key.to(key_cache.dtype))
    value = _with_contiguous_heads(value.to(value_cache.dtype))
    itemsize = key.element_size()
    kernel("write_kv")(
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


def _with_contiguous_heads(t: torch.Tensor) -> torch.Tensor:
    """t [tokens, heads, D] whose heads are contiguous within a token (tokens may be strided)."""
    return t if t.stride()[1:] == (t.shape[2], 1) else t.contiguous()
