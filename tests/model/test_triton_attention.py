"""Triton paged attention against two oracles: a naive dense attention over each request's
unpaged K/V (defined here) and the torch backend over the same paged cache.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest where there is no GPU), so
shapes stay tiny; with the interpreter off (a GPU machine) the tests on CPU tensors skip. The
`gpu` test repeats the comparison at model-like shapes on a real device.

Tolerances (max |triton - oracle| per element, inputs ~ N(0, 1), outputs are convex combinations
of V rows): fp32 1e-5 (same math, different summation order); fp16 2e-3 (P is rounded to fp16
before the P @ V dot, plus the fp16 output rounding); bf16 1.6e-2 (bf16 output rounding, 2**-8
relative). Against the torch backend, which also rounds in the input dtype, the bound is doubled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from tests.model.paged_batch import (
    BlockAllocator,
    attention_spec,
    build_metadata,
    torch_paged_attention,
)
from v1engine.model.layers import torch_attention
from v1engine.model.layers import triton_attention as ta
from v1engine.model.layers.attention_backend import CommonAttentionMetadata, get_attention_backend

# Compiled Triton cannot read CPU tensors: these tests need the interpreter.
on_cpu_tensors = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton runs CPU tensors only with TRITON_INTERPRET=1 (the gpu tests cover the GPU)",
)

_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class _Batch:
    metadata: CommonAttentionMetadata
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    keys: list[torch.Tensor]  # per request: [seq_len, num_kv_heads, head_size], unpaged
    values: list[torch.Tensor]


def _build_batch(
    steps: list[tuple[int, int]],
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    num_padding_tokens: int = 0,
    device: str = "cpu",
) -> _Batch:
    """steps: (num_computed_tokens, num_new_tokens) per request. Every request's K/V (cached
    prefix and new tokens) is written with the Triton `write_kv_cache` into shuffled blocks of a
    cache pre-filled with noise; block-table entries past a request's last block are garbage."""
    seed = len(steps) * 1000 + head_size
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in steps) + 3
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    keys = [torch.randn(c + n, num_kv_heads, head_size, generator=gen).to(dtype) for c, n in steps]
    values = [
        torch.randn(c + n, num_kv_heads, head_size, generator=gen).to(dtype) for c, n in steps
    ]
    allocator = BlockAllocator(num_blocks, block_size, seed)
    step = [(r, c, n) for r, (c, n) in enumerate(steps)]
    metadata = build_metadata(allocator, step, num_padding_tokens, device)
    # The same requests' blocks, every position: where the whole K/V goes.
    all_slots = build_metadata(allocator, [(r, 0, c + n) for r, c, n in step]).slot_mapping
    key_cache, value_cache = key_cache.to(device), value_cache.to(device)
    ta.write_kv_cache(
        torch.cat(keys).to(device), torch.cat(values).to(device), key_cache, value_cache,
        all_slots.to(device),
    )  # fmt: skip
    return _Batch(metadata, key_cache, value_cache, keys, values)


def _dense_reference(
    query: torch.Tensor,
    batch: _Batch,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Naive fp32 attention per request over its unpaged K/V; padding rows stay zero."""
    out = torch.zeros(query.shape, dtype=torch.float32)
    bounds = batch.metadata.query_start_loc.tolist()
    for r, (key, value) in enumerate(zip(batch.keys, batch.values)):
        q = query[bounds[r] : bounds[r + 1]].float().cpu()  # [query_len, num_heads, head_size]
        group = q.shape[1] // key.shape[1]
        k = key.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_size]
        v = value.float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
        k_pos = torch.arange(k.shape[0])[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[bounds[r] : bounds[r + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def _check(
    batch: _Batch,
    num_heads: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    config: ta._LaunchConfig | None = None,
    soft_cap: float | None = None,
) -> None:
    head_size = batch.key_cache.shape[-1]
    device = batch.key_cache.device
    gen = torch.Generator().manual_seed(7)
    num_tokens = batch.metadata.num_tokens
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype).to(device)
    scale = head_size**-0.5
    args = (query, batch.key_cache, batch.value_cache, batch.metadata, scale, sliding_window)
    if config is None:
        out = ta.paged_attention(*args, soft_cap)
    else:
        out = ta._paged_attention(*args, config, soft_cap)
    assert out.shape == query.shape and out.dtype == dtype
    tol = _TOL[dtype]
    dense = _dense_reference(query, batch, scale, sliding_window, soft_cap)
    torch.testing.assert_close(out.float().cpu(), dense, atol=tol, rtol=tol)
    torch_out = torch_paged_attention(*args, soft_cap)
    torch.testing.assert_close(out.float(), torch_out.float(), atol=2 * tol, rtol=2 * tol)


# steps as (computed, new) per request, num_heads, num_kv_heads, head_size (24 pads to 32),
# block_size.
_CASES = {
    "decode": ([(5, 1), (0, 1), (17, 1), (30, 1)], 4, 2, 32, 4),
    "prefill": ([(0, 13), (0, 1), (0, 21)], 6, 2, 16, 16),  # group 3: a padding row per tile
    "mixed": ([(9, 1), (0, 11), (12, 6), (20, 1), (3, 19)], 4, 1, 24, 8),
}


@on_cpu_tensors
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(_CASES))
def test_paged_attention_matches_references(case: str, dtype: torch.dtype) -> None:
    steps, num_heads, num_kv_heads, head_size, block_size = _CASES[case]
    batch = _build_batch(steps, num_kv_heads, head_size, block_size, dtype, num_padding_tokens=2)
    _check(batch, num_heads, dtype)


@on_cpu_tensors
@pytest.mark.parametrize("sliding_window", [1, 5, 16])
def test_sliding_window(sliding_window: int) -> None:
    steps = [(14, 1), (0, 17), (9, 10), (40, 1)]
    batch = _build_batch(steps, 2, 16, 4, torch.float32)
    _check(batch, 4, torch.float32, sliding_window)


@on_cpu_tensors
@pytest.mark.parametrize(
    ("steps", "num_kv_splits"),
    [([(40, 1), (3, 1), (0, 1)], 3), ([(40, 1), (3, 1), (25, 1)], 16), ([(30, 1), (5, 20)], 2)],
)
def test_kv_splits_merge_like_one_pass(steps: list[tuple[int, int]], num_kv_splits: int) -> None:
    # More splits than keys leaves some splits empty: the merge must give them weight 0.
    batch = _build_batch(steps, 2, 16, 8, torch.float16, num_padding_tokens=3)
    config = ta._LaunchConfig(block_m=16, block_n=16, num_kv_splits=num_kv_splits)
    _check(batch, 4, torch.float16, sliding_window=None, config=config)
    _check(batch, 4, torch.float16, sliding_window=9, config=config)


@on_cpu_tensors
def test_soft_capped_scores() -> None:
    """Gemma 2's cap * tanh(score / cap), through prefills, decodes and merged decode splits;
    a cap of 1 bends these scores (about unit spread) well past the tolerance."""
    batch = _build_batch([(9, 1), (0, 11), (12, 6)], 2, 16, 4, torch.float32, 2)
    _check(batch, 4, torch.float32, sliding_window=5, soft_cap=1.0)
    decodes = _build_batch([(40, 1), (3, 1)], 2, 16, 8, torch.float32)
    config = ta._LaunchConfig(block_m=16, block_n=16, num_kv_splits=3)
    _check(decodes, 4, torch.float32, config=config, soft_cap=1.0)


@on_cpu_tensors
def test_small_query_tiles_and_multi_step_kv_loop() -> None:
    # block_n 16 with block_size 4: several loop steps and blocks per step; block_m 16 with
    # group 3 gives 5-token tiles (one padding row), so prefills span several tiles.
    steps = [(0, 9), (21, 1), (6, 14), (0, 1), (33, 5)]
    batch = _build_batch(steps, 1, 16, 4, torch.float32, num_padding_tokens=1)
    config = ta._LaunchConfig(block_m=16, block_n=16, num_kv_splits=1)
    _check(batch, 3, torch.float32, config=config)


@on_cpu_tensors
def test_padding_rows_are_zero_and_padding_slots_not_written() -> None:
    batch = _build_batch([(3, 4), (8, 1)], 2, 16, 4, torch.float32, num_padding_tokens=3)
    query = torch.randn(batch.metadata.num_tokens, 2, 16)
    out = ta.paged_attention(query, batch.key_cache, batch.value_cache, batch.metadata, 0.25)
    assert torch.count_nonzero(out[-3:]) == 0
    key_cache = batch.key_cache.clone()
    key = torch.randn(batch.metadata.num_tokens, 2, 16)
    ta.write_kv_cache(key, key, key_cache, key_cache, batch.metadata.slot_mapping)
    flat = key_cache.view(-1, 2, 16)
    slots = batch.metadata.slot_mapping
    torch.testing.assert_close(flat[slots[slots >= 0]], key[slots >= 0], atol=0, rtol=0)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat[untouched], batch.key_cache.view(-1, 2, 16)[untouched])


@on_cpu_tensors
def test_write_kv_cache_strided_input_and_cast() -> None:
    # K and V as views into a fused qkv projection output, written into an fp16 cache.
    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    key = qkv[:, 64:96].view(5, 2, 16)
    value = qkv[:, 96:].view(5, 2, 16)
    key_cache = torch.zeros(3, 4, 2, 16, dtype=torch.float16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([0, 5, -1, 11, 7])
    ta.write_kv_cache(key, value, key_cache, value_cache, slots)
    expected_k, expected_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    torch_attention.write_kv_cache(key, value, expected_k, expected_v, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_launch_config_splits_decode_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ta, "_num_sms", lambda device: 132)
    cache = torch.empty(1, 16, 2, 128)
    query = torch.empty(2, 8, 128, dtype=torch.float16)

    def config(max_query_len: int, max_seq_len: int) -> ta._LaunchConfig:
        metadata = CommonAttentionMetadata(
            torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2, 1), max_query_len,
            max_seq_len,
        )  # fmt: skip
        return ta._choose_launch_config(query, cache, metadata)

    assert config(1, 1000).num_kv_splits == 4  # limited by keys per split (1000 / 256)
    assert config(1, 100_000).num_kv_splits == 16  # capped
    assert config(1, 100).num_kv_splits == 1
    assert config(7, 100_000).num_kv_splits == 1  # prefill tiles already fill the device
    assert config(1, 1000).block_m == 16 and config(7, 1000).block_m == 64


@on_cpu_tensors
def test_rejects_bad_inputs() -> None:
    cache = torch.zeros(2, 4, 2, 16)
    metadata = _build_batch([(0, 2)], 2, 16, 4, torch.float32).metadata
    with pytest.raises(ValueError, match="sliding_window"):
        ta.paged_attention(torch.zeros(2, 2, 16), cache, cache, metadata, 1.0, 0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ta.paged_attention(torch.zeros(2, 3, 16), cache, cache, metadata, 1.0)
    with pytest.raises(ValueError, match="key/value"):
        ta.write_kv_cache(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), cache, cache, torch.zeros(2))


@on_cpu_tensors
def test_triton_backend_writes_and_attends_like_the_torch_backend() -> None:
    """The registered backends, end to end: metadata, K/V write and attention of one layer."""
    common = build_metadata(BlockAllocator(8, 4), [(0, 0, 6), (1, 0, 1)], num_padding_tokens=1)
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, common.num_tokens, 2, 16, generator=gen)
    query = torch.randn(common.num_tokens, 4, 16, generator=gen)
    results = []
    for name in ("triton", "torch"):
        backend = get_attention_backend(name)
        assert backend.name == name
        kv_cache = (torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16))
        metadata = backend.build_metadata(common, attention_spec(kv_cache[0], sliding_window=3))
        backend.write_kv_cache(key, value, kv_cache, metadata)
        results.append((backend.forward(query, kv_cache, metadata, 0.25, 3), kv_cache))
    (out, kv_cache), (expected, expected_kv_cache) = results
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(kv_cache, expected_kv_cache))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_size"),
    [
        (torch.bfloat16, 32, 8, 128),
        (torch.float16, 16, 16, 64),
        (torch.float16, 28, 4, 80),
        (torch.float32, 8, 2, 128),
    ],
)
def test_matches_torch_on_gpu(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int
) -> None:
    # Long prefixes, a 512-token chunk, many decodes (and a decode-only batch for the splits).
    steps = [(700, 1), (0, 300), (1000, 512), (37, 1), (0, 1), (250, 64)] + [(300, 1)] * 20
    batch = _build_batch(steps, num_kv_heads, head_size, 16, dtype, 5, device="cuda")
    for sliding_window in (None, 128):
        _check(batch, num_heads, dtype, sliding_window)
    decode_steps = [(2000, 1), (5, 1), (900, 1)]
    decode = _build_batch(decode_steps, num_kv_heads, head_size, 16, dtype, device="cuda")
    _check(decode, num_heads, dtype)
