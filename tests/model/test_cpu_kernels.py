"""Our compiled CPU kernels (`cpu_kernels`): the matmuls and RMSNorm against torch and transformers,
the K/V write, routing from `linear`, the on-disk cache, and that their threads are torch's. (The
decode attention kernel is tested through its backend, test_attention_cpu.py.)"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from v1engine.model.layers import cpu_kernel_library, cpu_kernels
from v1engine.model.layers import linear as linear_module
from v1engine.model.layers.layernorm import RMSNorm
from v1engine.model.layers.linear import linear, max_kernel_tokens
from v1engine.model.layers.torch_attention import write_kv_cache

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C compiler to build the CPU decode kernel"
)


# Sums of up to 600 products of unit normals, added in another order than torch's.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])  # below, at and past one four-row tile
# in_features: no full vector, some, whole groups of the gemv's four sums (192), groups and tail.
@pytest.mark.parametrize("in_features", [1, 37, 192, 600])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_f_linear(dtype, tol, rows, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(33, in_features, generator=generator).to(dtype)
    bias = torch.randn(33, generator=generator).to(dtype) if with_bias else None
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    out = cpu_kernels.gemv(x, weight, bias)
    assert out.shape == (rows, 33) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


# Token panels of 1-3 vectors (16 lanes with AVX-512, 8 otherwise) and partial ones, and with
# AVX-512 the 6-row tiles of 4 vectors past 48 rows (49, 64, 100: 64 + 36); tiles of weight rows
# with a partial last one (33 outputs); k with and without a vector tail.
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 40, 48, 49, 64, 100])
@pytest.mark.parametrize("in_features", [1, 37, 600])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_f_linear(rows, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(33, in_features, generator=generator)
    bias = torch.randn(33, generator=generator) if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    out = cpu_kernels.gemm(x, weight, bias)
    assert out.shape == (rows, 33) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected.float(), atol=1e-4, rtol=1e-4)


needs_bf16_gemm = pytest.mark.skipif(
    not cpu_kernels.max_gemm_tokens(torch.bfloat16), reason="no AVX512-BF16 on this CPU"
)


def _dot_pairs_in_order(x, weight, bias):
    """The bfloat16 gemm's arithmetic written out in float32: per output one sum over the pairs
    of k in order, adding the odd k's exact product, then the even one's, rounding each sum."""
    xs, ws = x.float().numpy(), weight.float().numpy()
    acc = np.zeros((x.shape[0], weight.shape[0]), dtype=np.float32)
    for k in range(0, x.shape[1], 2):
        for j in (k + 1, k):
            acc = (acc + np.outer(xs[:, j], ws[:, j])).astype(np.float32)
    if bias is not None:
        acc = (acc + bias.float().numpy()).astype(np.float32)
    return torch.from_numpy(acc).to(torch.bfloat16)


# The float32 gemm's panels and tiles (above) with bfloat16 pairs along k: even K only.
@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 48, 49, 64, 100])
@pytest.mark.parametrize("in_features", [2, 38, 600])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_gemm_sums_each_output_in_pairs_of_k_in_order(rows, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(33, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(33, generator=generator).to(torch.bfloat16) if with_bias else None
    out = cpu_kernels.gemm(x, weight, bias)
    assert out.shape == (rows, 33) and out.dtype == torch.bfloat16
    assert torch.equal(out, _dot_pairs_in_order(x, weight, bias))
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@needs_bf16_gemm
def test_bfloat16_gemm_nan_stays_nan_and_odd_k_is_not_its_to_take():
    x = torch.tensor([[float("nan"), 1.0]] * 7, dtype=torch.bfloat16)
    assert torch.isnan(cpu_kernels.gemm(x, torch.ones(3, 2, dtype=torch.bfloat16))).all()
    assert cpu_kernels.max_gemm_tokens(torch.bfloat16, 37) == 0
    odd = torch.ones(7, 37, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in_features must be even, got 37"):
        cpu_kernels.gemm(odd, torch.ones(3, 37, dtype=torch.bfloat16))
    assert max_kernel_tokens(torch.bfloat16, 37) == cpu_kernels.max_gemv_tokens(torch.bfloat16)
    assert max_kernel_tokens(torch.bfloat16, 576, 37) == max_kernel_tokens(torch.bfloat16, 37)


# Blocks of 8 tokens with AVX-512 (4 otherwise): below, at and past one, and many; panels of 48
# outputs (24 otherwise): a partial one alone (33) and after full ones (97, and 48 + 24 without
# AVX-512); k with and without a vector tail.
@pytest.mark.parametrize("rows", [1, 4, 7, 8, 9, 17, 64, 100])
@pytest.mark.parametrize("in_features", [1, 37, 600])
@pytest.mark.parametrize("out_features", [33, 97])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_on_packed_weights_matches_f_linear_and_the_tiled_gemm(
    rows, in_features, out_features, with_bias
):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    packed = cpu_kernels.pack_weight(weight)
    out = cpu_kernels.gemm_packed(x, packed, out_features, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected.float(), atol=1e-4, rtol=1e-4)
    # The same multiply-add chains as the tiled gemm: linear may switch between them by rows.
    assert torch.equal(out, cpu_kernels.gemm(x, weight, bias))


def test_gemm_rows_do_not_depend_on_the_batch():
    # One multiply-add chain per output: a row's bits are the same alone or among 63 others.
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(64, 96, generator=generator), torch.randn(40, 96, generator=generator)
    packed = cpu_kernels.pack_weight(weight)
    for gemm, w in ((cpu_kernels.gemm, weight), (cpu_kernels.gemm_packed, packed)):
        batched = gemm(x, w, 40) if w is packed else gemm(x, w)
        for row in (0, 17, 63):
            alone = gemm(x[row : row + 1], w, 40) if w is packed else gemm(x[row : row + 1], w)
            assert torch.equal(alone[0], batched[row])
    if cpu_kernels.max_gemm_tokens(torch.bfloat16):
        x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        batched = cpu_kernels.gemm(x, weight)
        for row in (0, 17, 63):
            assert torch.equal(cpu_kernels.gemm(x[row : row + 1], weight)[0], batched[row])


def test_packed_weights_are_panels_of_outputs_k_major_zero_padded():
    width = cpu_kernels.kernel("gemm_panel_width")()
    weight = torch.randn(width + 5, 7)
    panels = cpu_kernels.pack_weight(weight).view(2, 7, width)
    assert torch.equal(panels[0], weight[:width].T)
    assert torch.equal(panels[1, :, :5], weight[width:].T)
    assert not panels[1, :, 5:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rows_have_the_same_bits_alone_and_in_a_tile(dtype):
    # 9 rows: two four-row tiles and one row alone; each row's sums are taken in one order.
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(9, 600, generator=generator).to(dtype)
    weight = torch.randn(33, 600, generator=generator).to(dtype)
    together = cpu_kernels.gemv(x, weight)
    for row in range(9):
        assert torch.equal(together[row], cpu_kernels.gemv(x[row : row + 1], weight)[0])


def test_gemv_keeps_leading_dimensions():
    x = torch.randn(2, 1, 16)
    weight = torch.randn(8, 16)
    out = cpu_kernels.gemv(x, weight)
    assert out.shape == (2, 1, 8)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_bfloat16_nan_stays_nan():
    x = torch.tensor([[float("nan"), 1.0]], dtype=torch.bfloat16)
    out = cpu_kernels.gemv(x, torch.ones(3, 2, dtype=torch.bfloat16))
    assert torch.isnan(out).all()


def test_linear_sends_decode_sized_inputs_to_the_kernels_and_larger_ones_elsewhere():
    weight = torch.randn(24, 40)
    packed = cpu_kernels.pack_weight(weight)
    with torch.inference_mode():
        # float32: the gemv up to max_gemv_tokens, the gemm on the packed weight up to
        # max_gemm_packed_tokens, then the tiled one (which a layer without a packed weight takes
        # past the gemv) up to max_gemm_tokens.
        most_gemv = cpu_kernels.max_gemv_tokens(torch.float32)
        most_packed = cpu_kernels.max_gemm_packed_tokens(torch.float32)
        most = cpu_kernels.max_gemm_tokens(torch.float32)
        assert 0 < most_gemv < most_packed < most
        for rows in (1, most_gemv, most_gemv + 1, 9, most_packed, most_packed + 1, most):
            x = torch.randn(rows, 40)
            out = linear(x, weight, packed=packed)
            if rows <= most_gemv:
                assert torch.equal(out, cpu_kernels.gemv(x, weight))
                assert torch.equal(linear(x, weight), out)
                continue
            if rows <= most_packed:
                assert torch.equal(out, cpu_kernels.gemm_packed(x, packed, 24))
            assert torch.equal(out, cpu_kernels.gemm(x, weight))
            assert torch.equal(linear(x, weight), out)
        # bfloat16: the gemv up to max_gemv_tokens, then the gemm (AVX512-BF16) up to its limit.
        w = weight.to(torch.bfloat16)
        most_gemv = cpu_kernels.max_gemv_tokens(torch.bfloat16)
        for rows in (1, most_gemv):
            x = torch.randn(rows, 40).to(torch.bfloat16)
            assert torch.equal(linear(x, w), cpu_kernels.gemv(x, w))
        most_bf16 = cpu_kernels.max_gemm_tokens(torch.bfloat16)
        for rows in (most_gemv + 1, most_bf16) if most_bf16 else ():
            x = torch.randn(rows, 40).to(torch.bfloat16)
            assert torch.equal(linear(x, w), cpu_kernels.gemm(x, w))
        # Past the kernels: MKL (F.linear) for float32 on Intel CPUs, else oneDNN; and bfloat16
        # rows of odd K past the gemv, which the gemm's pairs do not take.
        past = max_kernel_tokens(torch.bfloat16) + 1
        cases = (
            (torch.randn(most + 1, 40), weight, packed),
            (torch.randn(past, 40).to(torch.bfloat16), w, None),
            (torch.randn(most_gemv + 1, 39).to(torch.bfloat16), w[:, :39].contiguous(), None),
        )
        for x, w, p in cases:
            out = linear(x, w, packed=p)
            if w.dtype == torch.float32 and linear_module._mkl_is_faster():
                assert torch.equal(out, F.linear(x, w))
            elif linear_module._onednn_linear_works():
                onednn = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                assert torch.equal(out, onednn)
    # The kernels have no backward: inputs that autograd records take torch's path.
    for rows in (1, most):
        grad_input = torch.randn(rows, 40, requires_grad=True)
        linear(grad_input, weight, packed=packed).sum().backward()
        torch.testing.assert_close(grad_input.grad, weight.sum(0).expand(rows, 40))


def test_built_once_per_cache_then_loaded(tmp_path, monkeypatch):
    # The real compiler and cache on a one-line source: every other test here loads the real
    # library (from the shared cache), which a second full build would only repeat for 10 s.
    probe = tmp_path / "probe.c"
    probe.write_text("int v1e_probe(void) { return 7; }\n")
    compile_library = cpu_kernel_library.compile_library
    monkeypatch.setattr(
        cpu_kernel_library,
        "compile_library",
        lambda root, path: compile_library(root, path, (str(probe),)),
    )
    path = cpu_kernel_library.build_library(str(tmp_path))
    assert path.startswith(str(tmp_path)) and os.path.exists(path)
    assert ctypes.CDLL(path).v1e_probe() == 7
    built_at = os.stat(path).st_mtime_ns
    assert cpu_kernel_library.build_library(str(tmp_path)) == path
    assert os.stat(path).st_mtime_ns == built_at
    assert not [name for name in os.listdir(os.path.dirname(path)) if name.endswith(".tmp")]


def test_without_a_compiler_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernel_library.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler found.*install gcc"):
        cpu_kernel_library.build_library(str(tmp_path))
    assert not (tmp_path / "kernels").exists()


@pytest.mark.parametrize(
    ("vendor", "flags", "most", "most_bf16"),
    [
        ("GenuineIntel", {"avx512f", "avx2"}, 64, 0),  # measured against MKL on a Xeon
        ("GenuineIntel", {"avx512f", "avx512_bf16"}, 64, 0),  # oneDNN's (AMX), not measured
        ("AuthenticAMD", {"avx512f", "avx2"}, 128, 0),  # measured against oneDNN on Zen 5
        ("AuthenticAMD", {"avx512f", "avx512_bf16"}, 128, 128),  # Zen 5's bfloat16 dot product
        ("AuthenticAMD", {"avx2"}, 64, 0),  # measured on neither: the Xeon's limit
        ("", frozenset(), 64, 0),  # /proc/cpuinfo unreadable (or not Linux)
    ],
)
def test_gemm_row_limit_follows_the_cpu_it_was_measured_on(
    monkeypatch, vendor, flags, most, most_bf16
):
    fields = {"vendor_id": vendor, "flags": " ".join(flags)} if vendor else {}
    monkeypatch.setattr(cpu_kernels, "cpuinfo", lambda: fields)
    cpu_kernels._row_limits.cache_clear()  # chosen once per process
    try:
        assert cpu_kernels.max_gemm_tokens(torch.float32) == most
        built = ("gemm", torch.bfloat16) in cpu_kernel_library.load_kernels()  # by this compiler
        assert cpu_kernels.max_gemm_tokens(torch.bfloat16) == (most_bf16 if built else 0)
        assert max_kernel_tokens(torch.float32) == most
    finally:
        cpu_kernels._row_limits.cache_clear()  # the real CPU's, next time


def _mapped_file(address: int) -> str:
    """The file mapped at `address` in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return rest[-1]
    raise AssertionError(f"nothing is mapped at {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_kernel_threads_are_torchs_openmp_runtime():
    # A second OpenMP runtime would bring its own thread pool: twice the threads on the cores.
    # Other packages may carry private copies (scikit-learn's libgomp-<hash>.so, which
    # transformers loads where it is installed); what matters is the runtime our library binds.
    cpu_kernels.gemv(torch.randn(1, 8), torch.randn(4, 8))
    ours = ctypes.CDLL(cpu_kernel_library.build_library())  # the loaded library, looked up again
    libtorch = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))

    def runtime(library: ctypes.CDLL) -> str:
        # dlsym through a library's handle finds the symbol its dependencies provide.
        return _mapped_file(ctypes.cast(library.omp_get_max_threads, ctypes.c_void_p).value)

    assert runtime(ours) == runtime(libtorch)
    assert "gomp" in runtime(ours) or "iomp" in runtime(ours)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_strided_rows_at_their_slots(cache_dtype):
    # K and V as the model makes them: column slices of one fused projection output.
    fused = torch.randn(3, 4 * 8 + 2 * 2 * 8)
    key = fused[:, 32:48].view(3, 2, 8)
    value = fused[:, 48:].view(3, 2, 8)
    caches = [torch.zeros(5, 4, 2, 8, dtype=cache_dtype) for _ in range(4)]
    slots = torch.tensor([7, 0, 19])
    cpu_kernels.write_kv(key, value, caches[0], caches[1], slots)
    write_kv_cache(key, value, caches[2], caches[3], slots)
    assert all(torch.equal(ours, torch_s) for ours, torch_s in zip(caches[:2], caches[2:]))
    assert caches[0].flatten(0, 1)[7].float().abs().sum() > 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 3, 70])  # 70: the kernel's multi-threaded path
def test_rms_norm_matches_transformers(dtype, tol, rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(rows)
    reference = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    reference.weight.data = (torch.rand(48, generator=generator) + 0.5).to(dtype)
    norm = RMSNorm(48, eps=1e-5).to(dtype)
    norm.weight.data = reference.weight.data.clone()
    x, residual = (torch.randn(rows, 48, generator=generator).to(dtype) for _ in range(2))
    with torch.inference_mode():
        assert cpu_kernels.applies(x, residual, norm.weight)
        out, total = norm(x, residual)
        torch.testing.assert_close(total, x + residual)
        torch.testing.assert_close(out, reference(x + residual), atol=tol, rtol=tol)
        torch.testing.assert_close(norm(x), reference(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tokens", [1, 70])
def test_rotary_matches_transformers_on_views_of_the_fused_qkv(dtype, tol, tokens):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (4 + 2 + 2) * 16, generator=generator).to(dtype)
    query, key = qkv[:, :64].view(tokens, 4, 16), qkv[:, 64:96].view(tokens, 2, 16)
    angles = torch.rand(tokens, 1, 8, generator=generator) * 100
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    with torch.inference_mode():
        assert cpu_kernels.applies(query, key, cos, sin)
        out = cpu_kernels.rotary(query, key, cos, sin)
    # transformers: [batch, heads, tokens, D] with cos/sin [batch, tokens, D].
    expected = apply_rotary_pos_emb(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        cos.transpose(0, 1),
        sin.transpose(0, 1),
    )
    for ours, theirs in zip(out, expected):
        torch.testing.assert_close(ours, theirs[0].transpose(0, 1), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tokens", [1, 70])
def test_silu_and_mul_matches_torch(dtype, tol, tokens):
    gate_up = (torch.randn(tokens, 2 * 40, generator=torch.Generator().manual_seed(0)) * 4).to(
        dtype
    )
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.inference_mode():
        out = cpu_kernels.silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_at_the_edges_of_exp(dtype):
    # The kernel's own vectorizable exp (cpu_kernels.h) must saturate and keep NaN as torch does.
    edges = [float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 88.5, -88.5, 87.5, -87.5]
    gate = torch.tensor(edges + torch.linspace(-20, 20, 23).tolist())
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None].to(dtype)
    expected = F.silu(gate_up[:, : gate.numel()]) * 1.5
    out = cpu_kernels.silu_and_mul(gate_up)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-2, equal_nan=True)
