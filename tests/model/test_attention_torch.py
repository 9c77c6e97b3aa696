"""The torch paged-attention backend against a dense, naive reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.model.paged_batch import (
    BlockAllocator,
    attention_spec,
    build_metadata,
    dense_attention,
    torch_paged_attention,
)
from v1engine.model.layers import torch_attention, torch_attention_plan
from v1engine.model.layers.torch_attention import TorchAttentionBackend, write_kv_cache

HEAD_SIZE = 8
NUM_BLOCKS = 64


def _run_step(steps, num_heads, num_kv_heads, block_size, sliding_window, padding=0, soft_cap=None):
    """Fills the cache with each request's prefix, writes the new K/V, returns (out, expected)."""
    torch.manual_seed(0)
    allocator = BlockAllocator(NUM_BLOCKS, block_size, seed=1)
    shape = (NUM_BLOCKS, block_size, num_kv_heads, HEAD_SIZE)
    key_cache, value_cache = torch.randn(shape), torch.randn(shape)  # garbage where unwritten
    full_kv = {}
    for req_id, num_computed, num_new in steps:
        full_kv[req_id] = (
            torch.randn(num_computed + num_new, num_kv_heads, HEAD_SIZE),
            torch.randn(num_computed + num_new, num_kv_heads, HEAD_SIZE),
        )
        if num_computed:
            prefix = build_metadata(allocator, [(req_id, 0, num_computed)])
            k, v = full_kv[req_id]
            write_kv_cache(
                k[:num_computed], v[:num_computed], key_cache, value_cache, prefix.slot_mapping
            )
    metadata = build_metadata(allocator, steps, num_padding_tokens=padding)
    pad = torch.zeros(padding, num_kv_heads, HEAD_SIZE)
    new_k = torch.cat([full_kv[r][0][c:] for r, c, _ in steps] + [pad])
    new_v = torch.cat([full_kv[r][1][c:] for r, c, _ in steps] + [pad])
    write_kv_cache(new_k, new_v, key_cache, value_cache, metadata.slot_mapping)
    # Scores of a few units, so that a soft-cap of 2 bends them.
    query = 3 * torch.randn(metadata.num_tokens, num_heads, HEAD_SIZE)
    scale = HEAD_SIZE**-0.5
    out = torch_paged_attention(
        query, key_cache, value_cache, metadata, scale, sliding_window, soft_cap
    )
    expected = torch.zeros_like(query)
    starts = metadata.query_start_loc.tolist()
    for r, (req_id, _, _) in enumerate(steps):
        k, v = full_kv[req_id]
        rows = slice(starts[r], starts[r + 1])
        expected[rows] = dense_attention(query[rows], k, v, scale, sliding_window, soft_cap)
    return out, expected


# (req_id, num_computed_tokens, num_new_tokens): fresh prefill, chunked prefill over a cached
# prefix, decodes of several lengths, a one-token prompt.
MIXED = [(0, 0, 13), (1, 7, 9), (2, 20, 1), (3, 5, 1), (4, 0, 1), (5, 33, 1), (6, 16, 4)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, block_size, sliding_window):
    out, expected = _run_step(MIXED, num_heads, num_kv_heads, block_size, sliding_window, 3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert out[-3:].abs().sum() == 0, "padding rows must come back as zeros"


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_soft_capped_scores_match_dense(num_heads, num_kv_heads, sliding_window):
    """Gemma 2's cap * tanh(score / cap) in every path: fresh prefill, chunk over a prefix,
    decode groups; the cap must change the result (else the test would prove nothing)."""
    out, expected = _run_step(MIXED, num_heads, num_kv_heads, 4, sliding_window, 2, soft_cap=2.0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    uncapped, _ = _run_step(MIXED, num_heads, num_kv_heads, 4, sliding_window, 2)
    assert (out - uncapped).abs().max() > 1e-2


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_soft_capped_attention_without_a_cache(sliding_window):
    torch.manual_seed(0)
    q = 3 * torch.randn(10, 4, HEAD_SIZE)
    k, v = torch.randn(2, 10, 2, HEAD_SIZE)
    starts = torch.tensor([0, 6, 10], dtype=torch.int32)
    out = torch_attention.causal_attention(q, k, v, starts, 0.5, sliding_window, soft_cap=2.0)
    for a, b in ((0, 6), (6, 10)):
        expected = dense_attention(q[a:b], k[a:b], v[a:b], 0.5, sliding_window, soft_cap=2.0)
        torch.testing.assert_close(out[a:b], expected, atol=1e-5, rtol=1e-5)


def test_decode_split_into_several_gathers(monkeypatch):
    monkeypatch.setattr(torch_attention_plan, "MAX_GATHER_ELEMENTS", 1)
    steps = [(r, 3 + 5 * r, 1) for r in range(6)]
    out, expected = _run_step(steps, 4, 2, 4, None)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_many_decodes_of_mixed_lengths_in_sorted_groups(sliding_window):
    """More decodes than one group holds, in no length order, around a prefill."""
    lengths = [29, 3, 17, 40, 8, 22, 1, 35, 12, 26, 5, 31, 19, 9, 38, 14, 2, 24, 33, 11]
    steps = [(r, n, 1) for r, n in enumerate(lengths)] + [(99, 6, 5)]
    assert len(lengths) > 2 * torch_attention_plan.DECODE_GROUP_SIZE
    out, expected = _run_step(steps, 6, 2, 16, sliding_window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_the_plan_is_built_once_per_step_and_group(monkeypatch):
    plans = []
    build_step_plan = torch_attention.build_step_plan

    def counting_build_step_plan(*args):
        plans.append(build_step_plan(*args))
        return plans[-1]

    monkeypatch.setattr(torch_attention, "build_step_plan", counting_build_step_plan)
    torch.manual_seed(0)
    common = build_metadata(BlockAllocator(NUM_BLOCKS, 4), MIXED)
    caches = (torch.randn(NUM_BLOCKS, 4, 2, HEAD_SIZE), torch.randn(NUM_BLOCKS, 4, 2, HEAD_SIZE))
    query = torch.randn(common.num_tokens, 4, HEAD_SIZE)
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(common, attention_spec(caches[0]))
    first = backend.forward(query, caches, metadata, 0.3, None)
    again = backend.forward(query, caches, metadata, 0.3, None)  # the next layer of the step
    assert [metadata.plan] == plans
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    # A sliding-window group of the same step gets its own plan.
    windowed = backend.build_metadata(common, attention_spec(caches[0], sliding_window=5))
    backend.forward(query, caches, windowed, 0.3, 5)
    assert len(plans) == 2 and windowed.plan.sliding_window == 5


def test_sliding_window_of_one_sees_only_itself():
    out, expected = _run_step([(0, 0, 6), (1, 9, 1)], 2, 2, 4, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_cache_skips_padding_slots():
    key_cache = torch.zeros(4, 2, 1, 3)
    value_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(1.0, 10.0).view(3, 1, 3)
    slot_mapping = torch.tensor([5, -1, 0])
    write_kv_cache(key, -key, key_cache, value_cache, slot_mapping)
    flat = key_cache.view(8, 3)
    torch.testing.assert_close(flat[5], key[0, 0])
    torch.testing.assert_close(flat[0], key[2, 0])
    assert flat[[1, 2, 3, 4, 6, 7]].abs().sum() == 0
    torch.testing.assert_close(value_cache.view(8, 3)[5], -key[0, 0])


def test_bfloat16_close_to_float32_reference():
    steps = [(0, 0, 10), (1, 6, 1)]
    torch.manual_seed(0)
    allocator = BlockAllocator(NUM_BLOCKS, 4)
    metadata = build_metadata(allocator, steps)
    k = torch.randn(metadata.num_tokens, 2, HEAD_SIZE)
    v = torch.randn(metadata.num_tokens, 2, HEAD_SIZE)
    q = torch.randn(metadata.num_tokens, 4, HEAD_SIZE)
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        caches = [torch.zeros(NUM_BLOCKS, 4, 2, HEAD_SIZE, dtype=dtype) for _ in range(2)]
        write_kv_cache(k.to(dtype), v.to(dtype), *caches, metadata.slot_mapping)
        out = torch_paged_attention(q.to(dtype), *caches, metadata, HEAD_SIZE**-0.5)
        outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], atol=3e-2, rtol=3e-2)


def test_blocks_outside_the_window_are_never_read():
    """A sliding-window KV manager may free a request's old blocks: garbage ids there are fine."""
    window, block_size = 5, 4
    torch.manual_seed(0)
    allocator = BlockAllocator(NUM_BLOCKS, block_size)
    steps = [(0, 17, 1), (1, 12, 6)]
    metadata = build_metadata(allocator, steps)
    shape = (NUM_BLOCKS, block_size, 2, HEAD_SIZE)
    key_cache, value_cache = torch.randn(shape), torch.randn(shape)
    query = torch.randn(metadata.num_tokens, 4, HEAD_SIZE)
    expected = torch_paged_attention(query, key_cache, value_cache, metadata, 0.3, window)
    garbage = metadata.block_table.clone()
    for r, (_, num_computed, _) in enumerate(steps):
        first_visible = max(0, num_computed - window + 1)  # of the request's first query row
        garbage[r, : first_visible // block_size] = 10**6
    metadata = dataclasses.replace(metadata, block_table=garbage)
    out = torch_paged_attention(query, key_cache, value_cache, metadata, 0.3, window)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("padding", [0, 2])
def test_decode_only_step_through_the_backend(padding):
    """Decodes only, longest first: with no padding the plan's one group covers every row in
    order (the output is the group's, no scatter); with padding rows the backend writes only the
    real tokens."""
    torch.manual_seed(0)
    steps = [(0, 12, 1), (1, 7, 1), (2, 3, 1)]
    allocator = BlockAllocator(NUM_BLOCKS, 4, seed=1)
    shape = (NUM_BLOCKS, 4, 2, HEAD_SIZE)
    caches = (torch.zeros(shape), torch.zeros(shape))
    full = {
        r: (torch.randn(c + n, 2, HEAD_SIZE), torch.randn(c + n, 2, HEAD_SIZE)) for r, c, n in steps
    }
    for r, c, _ in steps:
        prefix = build_metadata(allocator, [(r, 0, c)])
        write_kv_cache(full[r][0][:c], full[r][1][:c], *caches, prefix.slot_mapping)
    common = build_metadata(allocator, steps, num_padding_tokens=padding)
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(common, attention_spec(caches[0]))
    assert metadata.plan.decode_rows_are_all_rows(common.num_tokens) == (padding == 0)
    garbage = torch.full((padding, 2, HEAD_SIZE), 7.0)
    new_k = torch.cat([full[r][0][c:] for r, c, _ in steps] + [garbage])
    new_v = torch.cat([full[r][1][c:] for r, c, _ in steps] + [garbage])
    before = caches[0].clone()
    backend.write_kv_cache(new_k, new_v, caches, metadata)
    assert int((caches[0] != before).any(dim=(2, 3)).sum()) == len(steps)  # padding not written
    query = torch.randn(common.num_tokens, 4, HEAD_SIZE)
    out = backend.forward(query, caches, metadata, HEAD_SIZE**-0.5, None)
    for row, (r, _, _) in enumerate(steps):
        expected = dense_attention(query[row : row + 1], *full[r], HEAD_SIZE**-0.5, None)
        torch.testing.assert_close(out[row : row + 1], expected, atol=1e-5, rtol=1e-5)
    assert out[len(steps) :].abs().sum() == 0
