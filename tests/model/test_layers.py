"""Layer pieces in one process: shard arithmetic at a simulated TP size, norms, dispatch."""

from __future__ import annotations

import pytest
import torch

from tests.model.paged_batch import BlockAllocator, attention_spec, build_metadata
from v1engine.model import parallel_state
from v1engine.model.layers import cpu_kernels, linear
from v1engine.model.layers.attention import Attention
from v1engine.model.layers.attention_backend import (
    get_attention_backend,
    get_default_attention_backend,
    set_forward_context,
)
from v1engine.model.layers.cpu_attention_backend import CpuAttentionBackend
from v1engine.model.layers.layernorm import GemmaRMSNorm, RMSNorm
from v1engine.model.layers.rotary_embedding import RotaryEmbedding
from v1engine.model.layers.torch_attention import TorchAttentionBackend


def _simulate_tp(monkeypatch, rank: int, world_size: int) -> None:
    monkeypatch.setattr(linear, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(linear, "get_tp_world_size", lambda: world_size)


@pytest.mark.parametrize("world_size,kv_heads_per_rank", [(2, 1), (4, 1)])
def test_qkv_shards_replicate_kv_heads(monkeypatch, world_size, kv_heads_per_rank):
    """8 query heads, 2 KV heads: at TP 4 each KV head lives on the 2 ranks that use it."""
    head_size, hidden = 2, 4
    q = torch.arange(8 * head_size * hidden, dtype=torch.float32).view(-1, hidden)
    k = 1000 + torch.arange(2 * head_size * hidden, dtype=torch.float32).view(-1, hidden)
    for rank in range(world_size):
        _simulate_tp(monkeypatch, rank, world_size)
        layer = linear.QKVParallelLinear(hidden, head_size, 8, 2)
        assert layer.num_kv_heads == kv_heads_per_rank
        layer.weight_loader(layer.weight, q, "q")
        layer.weight_loader(layer.weight, k, "k")
        q_rows = 8 // world_size * head_size
        torch.testing.assert_close(layer.weight[:q_rows], q[rank * q_rows : (rank + 1) * q_rows])
        # Query head h uses KV head h // 4, so rank r's first query head picks the KV head.
        kv_head = rank * (8 // world_size) // 4
        torch.testing.assert_close(
            layer.weight[q_rows : q_rows + head_size],
            k[kv_head * head_size : (kv_head + 1) * head_size],
        )


def test_row_and_merged_column_shards(monkeypatch):
    weight = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)
    _simulate_tp(monkeypatch, 1, 2)
    row = linear.RowParallelLinear(6, 4, bias=True)
    row.weight_loader(row.weight, weight)
    row.weight_loader(row.bias, torch.ones(4))
    torch.testing.assert_close(row.weight, weight[:, 3:])
    torch.testing.assert_close(row.bias, torch.ones(4))  # added once, after the all-reduce
    merged = linear.MergedColumnParallelLinear(6, [4, 4])
    merged.weight_loader(merged.weight, weight, 0)
    merged.weight_loader(merged.weight, -weight, 1)
    torch.testing.assert_close(merged.weight, torch.cat([weight[2:], -weight[2:]]))
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=2"):
        linear.ColumnParallelLinear(6, 5)


def test_single_rank_collectives_are_identities():
    assert (parallel_state.get_tp_rank(), parallel_state.get_tp_world_size()) == (0, 1)
    x = torch.randn(3, 4)
    assert parallel_state.tensor_model_parallel_all_reduce(x) is x
    assert parallel_state.tensor_model_parallel_all_gather(x) is x


def test_rms_norm_fuses_the_residual_add():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual))


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build the CPU kernels")
def test_cpu_uses_the_cpu_backend_where_the_kernels_build(monkeypatch):
    assert isinstance(get_default_attention_backend("cpu"), CpuAttentionBackend)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert isinstance(get_default_attention_backend("cpu"), TorchAttentionBackend)


def test_unknown_backend_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"'flash'.*\['cpu', 'torch', 'triton'\]"):
        get_attention_backend("flash")


def test_attention_reads_its_own_groups_metadata():
    """Per-group metadata, e.g. for full and sliding-window groups: a list the layer indexes."""
    torch.manual_seed(0)
    steps = [(0, 0, 6), (1, 0, 3)]
    layers = [Attention(4, 8, 0.3, 2, f"layer{i}") for i in range(2)]
    for index, layer in enumerate(layers):
        layer.kv_cache = (torch.zeros(16, 4, 2, 8), torch.zeros(16, 4, 2, 8))
        layer.kv_cache_group_index = 1 - index
    backend = TorchAttentionBackend()
    spec = attention_spec(layers[0].kv_cache[0])
    # Two groups with their own block tables: other blocks, so other slots.
    group_metadata = [
        backend.build_metadata(build_metadata(BlockAllocator(16, 4, seed), steps), spec)
        for seed in (1, 0)
    ]
    q, k, v = torch.randn(9, 32), torch.randn(9, 16), torch.randn(9, 16)
    query_start_loc = torch.tensor([0, 6, 9], dtype=torch.int32)
    with set_forward_context(query_start_loc, backend, group_metadata):
        out = layers[0](q, k, v)  # group 1
    with set_forward_context(query_start_loc, backend, group_metadata[1:]):
        expected = layers[1](q, k, v)  # group 0 of a step whose only group is the same
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(layers[0].kv_cache[0], layers[1].kv_cache[0])


def test_rotary_tables_are_float64_cos_and_sin_rounded_to_float32():
    # Not torch's float32 cos/sin, which once came out 1.5e-4 off in one thread's half of the
    # table in some processes: the tables must not depend on how a process splits the work.
    rope = RotaryEmbedding(64, 4096, {"rope_type": "default", "rope_theta": 100000.0})
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    angles = torch.arange(4096, dtype=torch.float)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1).double()
    assert torch.equal(rope.cos_cache, angles.cos().float())
    assert torch.equal(rope.sin_cache, angles.sin().float())


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_rotary_tables_land_on_the_device_the_model_is_built_under(rope_type):
    # The loader builds models under `with torch.device("cuda")`: the tables are computed on the
    # host and only then moved (the meta device stands in for CUDA here: it cannot go to numpy
    # either, which is how the CUDA path first failed on a GPU).
    params = {"rope_type": rope_type, "rope_theta": 500000.0, "factor": 8.0}
    params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    params |= {"original_max_position_embeddings": 64}
    with torch.device("meta"):
        rope = RotaryEmbedding(64, 128, params)
    assert rope.cos_cache.device.type == "meta" and rope.sin_cache.device.type == "meta"
    assert rope.cos_cache.shape == (128, 64)


@pytest.mark.parametrize("cap", [0.0, -5.0, float("nan")])
def test_a_soft_cap_that_is_not_positive_is_refused_by_layer_name(cap):
    with pytest.raises(ValueError, match=r"layers.3.attn: logits_soft_cap must be > 0"):
        Attention(4, 8, 1.0, 2, "layers.3.attn", logits_soft_cap=cap)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build the CPU kernels")
def test_gemma_rms_norm_through_the_kernel_matches_its_torch_ops_and_follows_new_weights():
    norm = GemmaRMSNorm(64, eps=1e-6)
    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 5, 64, generator=generator)

    def reference(weight):
        total = x + residual
        normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed * (1.0 + weight), total

    for _ in range(2):  # a second load of new weights in place: the kernel's scale follows
        norm.weight.copy_(torch.randn(64, generator=generator))
        out, total = norm(x, residual)
        want_out, want_total = reference(norm.weight)
        torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
        assert torch.equal(total, want_total)
