"""The CPU attention backend (our C paged-attention kernel) against the torch backend, through
the backend protocol: metadata, K/V write, attention; decode-only steps, prefills (fresh, over a
cached prefix, longer than a block of rows, past a window) and mixes of both, with padding."""

from __future__ import annotations

import pytest
import torch

from tests.model.paged_batch import BlockAllocator, attention_spec, build_metadata
from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.cpu_attention_backend import (
    LONG_PREFILL_ATTENTIONS,
    CpuAttentionBackend,
    CpuAttentionMetadata,
)
from v1engine.model.layers.cpu_kernel_library import cpuinfo
from v1engine.model.layers.torch_attention import TorchAttentionBackend, TorchAttentionMetadata

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C compiler to build the CPU kernels"
)

NUM_BLOCKS = 64


def _attend(
    backend,
    steps,
    num_heads,
    num_kv_heads,
    head_size,
    block_size,
    window,
    dtype,
    pad=0,
    num_blocks=NUM_BLOCKS,
    soft_cap=None,
):
    """One layer's step over caches pre-filled with noise (where a request's prefix would be):
    returns (metadata, out, kv_cache)."""
    common = build_metadata(BlockAllocator(num_blocks, block_size, seed=1), steps, pad)
    generator = torch.Generator().manual_seed(7)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = tuple(torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    key, value = torch.randn(2, common.num_tokens, num_kv_heads, head_size, generator=generator)
    query = torch.randn(common.num_tokens, num_heads, head_size, generator=generator).to(dtype)
    metadata = backend.build_metadata(common, attention_spec(kv_cache[0], window))
    backend.write_kv_cache(key.to(dtype), value.to(dtype), kv_cache, metadata)
    out = backend.forward(query, kv_cache, metadata, head_size**-0.5, window, soft_cap)
    return metadata, out, kv_cache


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [4, 16])
# The kernel's vector path takes head sizes of whole vectors (16 floats with AVX-512, 8 without):
# 8 is plain or one vector, 48 three or six, 64 SmolLM2's, 256 Gemma's (16 vectors with AVX-512,
# plain without); 12 is plain everywhere.
@pytest.mark.parametrize("head_size", [8, 12, 48, 64, 256])
def test_decode_steps_match_the_torch_backend(
    dtype, tol, num_heads, num_kv_heads, window, block_size, head_size
):
    # Decodes of many lengths: one key, within one block, across blocks, past the window, and
    # more keys than the kernel takes at once (16), with and without a partial group at the end.
    steps = [(r, n, 1) for r, n in enumerate([0, 3, 4, 17, 40, 2, 9, 31, 47])]
    args = (steps, num_heads, num_kv_heads, head_size, block_size, window, dtype)
    metadata, out, kv_cache = _attend(CpuAttentionBackend(), *args)
    assert isinstance(metadata, CpuAttentionMetadata) and metadata.decodes_only
    _, expected, expected_kv_cache = _attend(TorchAttentionBackend(), *args)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert all(torch.equal(a, b) for a, b in zip(kv_cache, expected_kv_cache))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_size", [8, 64, 256])
@pytest.mark.parametrize(
    "steps,pad",
    [
        ([(0, 0, 6), (1, 2, 3)], 0),
        ([(0, 0, 6), (1, 3, 1)], 0),
        ([(0, 9, 1), (1, 4, 5), (2, 17, 1), (3, 0, 3), (4, 1, 1)], 0),
        ([(0, 3, 1), (1, 5, 1)], 2),
        ([(0, 0, 37), (1, 20, 19), (2, 5, 1)], 3),
    ],
    ids=[
        "prefills",
        "a-prefill-and-a-decode",
        "decodes-between-prefills",
        "decodes-and-padding",
        "prompts-past-a-block-of-rows-and-padding",
    ],
)
def test_steps_with_prefills_and_padding_match_the_torch_backend(
    steps, pad, window, head_size, dtype, tol
):
    # (request, cached prefix, new tokens): prefills from scratch and over a cached prefix, rows
    # past the kernel's block of 8, a window shorter than the prompts.
    args = (steps, 9, 3, head_size, 4, window, dtype)
    metadata, out, kv_cache = _attend(CpuAttentionBackend(), *args, pad=pad)
    assert isinstance(metadata, CpuAttentionMetadata)
    assert metadata.decodes_only == all(query_len == 1 for _, _, query_len in steps)
    assert metadata.num_rows == sum(query_len for _, _, query_len in steps)
    _, expected, expected_kv_cache = _attend(TorchAttentionBackend(), *args, pad=pad)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert all(torch.equal(a, b) for a, b in zip(kv_cache, expected_kv_cache))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 4), (16, 2), (4, 4)])
def test_prefills_through_the_blocked_passes_match_the_torch_backend(
    num_heads, num_kv_heads, head_size, window, dtype, tol
):
    # Units of 8 rows with 1, 2, 3 and 8 query heads per KV head take cpu_attention_blocked.c (on
    # AVX-512 CPUs; the per-key passes elsewhere): blocks of query vectors that do not divide
    # their number, keys past a window, chunks over a cached prefix, a decode beside them.
    steps = [(0, 0, 37), (1, 20, 19), (2, 5, 1)]
    args = (steps, num_heads, num_kv_heads, head_size, 4, window, dtype)
    _, out, _ = _attend(CpuAttentionBackend(), *args)
    _, expected, _ = _attend(TorchAttentionBackend(), *args)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 5])
# 12: the plain passes; 64 with two query heads per KV head: the vector and blocked passes;
# 256: the vector passes of 16 vectors (AVX-512).
@pytest.mark.parametrize("head_size", [12, 64, 256])
def test_soft_capped_scores_match_the_torch_backend(head_size, window, dtype, tol):
    """Gemma 2's cap * tanh(score / cap) in every pass (decodes, prefills over a prefix, rows
    past a block of 8); a cap of 1 bends these scores (about unit spread) past the tolerance."""
    steps = [(0, 0, 37), (1, 20, 19), (2, 5, 1), (3, 30, 1)]
    args = (steps, 8, 4, head_size, 4, window, dtype)
    _, out, _ = _attend(CpuAttentionBackend(), *args, soft_cap=1.0)
    _, expected, _ = _attend(TorchAttentionBackend(), *args, soft_cap=1.0)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    _, uncapped, _ = _attend(CpuAttentionBackend(), *args)
    assert (out.float() - uncapped.float()).abs().max() > 10 * tol


def test_a_long_prefill_carries_the_torch_plan_and_a_longer_one_takes_it():
    # Past the shortest LONG_PREFILL_ATTENTIONS the metadata also carries the torch backend's
    # plan (for the layers whose heads' limit the request passes); past the longest the whole
    # step is the torch backend's. One decode beside it goes along.
    shortest = int(min(LONG_PREFILL_ATTENTIONS.values()) ** 0.5)
    longest = int(max(LONG_PREFILL_ATTENTIONS.values()) ** 0.5)
    for query_len, long_prefill, expected in (
        (shortest, False, CpuAttentionMetadata),
        (shortest + 1, True, CpuAttentionMetadata),
        (longest, True, CpuAttentionMetadata),
        (longest + 1, None, TorchAttentionMetadata),
    ):
        num_blocks = query_len // 16 + 4
        common = build_metadata(BlockAllocator(num_blocks, 16), [(0, 0, query_len), (1, 5, 1)])
        kv_cache = torch.randn(num_blocks, 16, 2, 8)
        metadata = CpuAttentionBackend().build_metadata(common, attention_spec(kv_cache))
        assert isinstance(metadata, expected), query_len
        if expected is CpuAttentionMetadata:
            assert metadata.longest_prefill == query_len * query_len
            assert isinstance(metadata.long_prefill, TorchAttentionMetadata) == long_prefill


def test_the_prefill_passes_follow_the_heads_and_the_cpu():
    avx512 = "avx512f" in cpuinfo().get("flags", "").split()
    cases = {
        "blocked": [(9, 3, 64), (8, 4, 128), (16, 2, 64)],  # query heads share KV heads
        "blocked, partial": [(4, 4, 64), (12, 12, 128)],  # one query head per KV head
        "blocked, heads of 256": [(4, 1, 256)],  # Gemma's, with their own limits
        "blocked, partial, heads of 256": [(8, 8, 256)],
        "per-key": [(9, 3, 8), (9, 3, 48), (4, 4, 96)],  # head sizes the blocks are not built for
    }
    for passes, shapes in cases.items():
        for heads in shapes:
            expected = passes if avx512 else "per-key"
            assert cpu_kernels.prefill_passes(*heads) == expected, heads


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,query_len",
    [
        (9, 3, 64, 520),
        (4, 4, 64, 520),
        (4, 4, 64, 1030),
        (6, 2, 8, 520),
        (4, 1, 256, 520),  # Gemma's heads: the kernel's up to 1024, SDPA's past it
        (4, 1, 256, 1030),
        (4, 4, 256, 520),
    ],
)
def test_a_long_prefill_is_the_kernels_up_to_its_passes_limit(
    monkeypatch, num_heads, num_kv_heads, head_size, query_len
):
    # New tokens over 8 cached ones, past the shortest limit (512 x 512 pairs); 1030 new ones
    # also past the partial blocked passes' (1024 x 1024). The kernel attends up to the limit of
    # the passes it runs these heads through, SDPA past it; either way the torch backend's result.
    torch_calls = []
    forward = TorchAttentionBackend.forward

    def counting_forward(self, *args, **kwargs):
        torch_calls.append(1)
        return forward(self, *args, **kwargs)

    steps = [(0, 8, query_len), (1, 5, 1)]
    args = (steps, num_heads, num_kv_heads, head_size, 16, None, torch.float32)
    _, expected, _ = _attend(TorchAttentionBackend(), *args, num_blocks=80)
    monkeypatch.setattr(TorchAttentionBackend, "forward", counting_forward)
    metadata, out, _ = _attend(CpuAttentionBackend(), *args, num_blocks=80)
    assert metadata.long_prefill is not None
    passes = cpu_kernels.prefill_passes(num_heads, num_kv_heads, head_size)
    limit = LONG_PREFILL_ATTENTIONS[passes]
    assert torch_calls == ([] if query_len * (query_len + 8) <= limit else [1])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_float16_cache_takes_the_torch_backends_path():
    common = build_metadata(BlockAllocator(NUM_BLOCKS, 4), [(0, 0, 6), (1, 2, 1)])
    kv_cache = tuple(torch.randn(NUM_BLOCKS, 4, 2, 8).half() for _ in range(2))
    metadata = CpuAttentionBackend().build_metadata(common, attention_spec(kv_cache[0]))
    assert isinstance(metadata, TorchAttentionMetadata)


def test_a_float32_query_over_a_bfloat16_cache():
    common = build_metadata(BlockAllocator(NUM_BLOCKS, 4), [(0, 6, 1), (1, 2, 1)])
    kv_cache = tuple(torch.randn(NUM_BLOCKS, 4, 2, 8).bfloat16() for _ in range(2))
    query = torch.randn(2, 4, 8)
    results = []
    for backend in (CpuAttentionBackend(), TorchAttentionBackend()):
        metadata = backend.build_metadata(common, attention_spec(kv_cache[0]))
        results.append(backend.forward(query, kv_cache, metadata, 0.3, None))
    assert results[0].dtype == torch.float32
    torch.testing.assert_close(results[0], results[1], atol=2e-2, rtol=2e-2)
