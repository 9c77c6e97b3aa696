from __future__ import annotations

import math
import pickle

import pytest
import torch

from tests.kv_specs import PAGE, SCHED, configs, full, hybrid, one, qwen_layer, sliding
from v1engine.config import CacheConfig, SchedulerConfig
from v1engine.core.kv_cache_utils import (
    get_kv_cache_capacity,
    get_max_concurrency_for_kv_cache_config,
    unify_kv_cache_configs,
)
from v1engine.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


def layout(num_blocks, tensors, groups) -> KVCacheConfig:
    """tensors: [(pages, layers)]; groups: [(layers, spec)]."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=p * PAGE, shared_by=ls) for p, ls in tensors],
        kv_cache_groups=[KVCacheGroupSpec(ls, spec) for ls, spec in groups],
    )


def layers(*indices: int) -> list[str]:
    return [f"layer{i}" for i in indices]


FULL_12 = layout(10, [(10, layers(1)), (10, layers(2))], [(layers(1, 2), full())])


@pytest.mark.parametrize("make", [full, sliding])
def test_one_worker_one_group_one_tensor_per_layer(make):
    assert one({"layer1": make(), "layer2": make()}, PAGE * 2 * 32) == layout(
        32, [(32, layers(1)), (32, layers(2))], [(layers(1, 2), make())]
    )


# Identical TP workers; then unequal memory, where the smallest wins and tensors shrink.
@pytest.mark.parametrize(
    "memory", [[PAGE * 20] * 2, [PAGE * 20, PAGE * 40], [PAGE * 40, PAGE * 22 - 1]]
)
def test_tp_workers_get_the_smallest_num_blocks(memory):
    specs = [{"layer1": full(), "layer2": full()}] * 2
    assert configs(specs, memory) == [FULL_12, FULL_12]


def test_layers_on_only_some_workers():
    got = configs([{"layer1": full()}, {"layer2": full(), "layer3": full()}], [PAGE * 20] * 2)
    # Worker 0 could hold 20 blocks of its one layer; it shrinks to worker 1's 10.
    assert got == [
        layout(10, [(10, layers(1))], [(layers(1), full())]),
        layout(10, [(10, layers(2)), (10, layers(3))], [(layers(2, 3), full())]),
    ]


def test_tensor_and_pipeline_parallel_workers():
    specs = [{"layer1": full(), "layer2": full()}] * 2 + [{"layer3": full()}] * 2
    expected_3 = layout(10, [(10, layers(3))], [(layers(3), full())])
    assert configs(specs, [PAGE * 20] * 4) == [FULL_12, FULL_12, expected_3, expected_3]


def test_hybrid_model_split_by_type_across_workers_keeps_empty_groups():
    specs = [{"layer1": full(), "layer2": full()}, {"layer3": sliding(), "layer4": sliding()}]
    assert configs(specs, [PAGE * 20] * 2) == [
        layout(10, [(10, layers(1)), (10, layers(2))], [(layers(1, 2), full()), ([], sliding())]),
        layout(10, [(10, layers(3)), (10, layers(4))], [([], full()), (layers(3, 4), sliding())]),
    ]


def test_hybrid_groups_are_balanced_across_workers():
    specs = [
        {"layer1": full(), "layer2": sliding(), "layer3": sliding()},
        {"layer4": full(), "layer5": sliding(), "layer6": sliding()},
    ]
    f, s = full(), sliding()
    assert configs(specs, [PAGE * 10] * 2) == [
        layout(
            10,
            [(10, layers(i, i + 1, i + 2))],
            [(layers(i), f), (layers(i + 1), s), (layers(i + 2), s)],
        )
        for i in (1, 4)
    ]


def test_worker_holding_no_layer_does_not_bind_num_blocks():
    got = configs([{"layer1": full(), "layer2": full()}, {}], [PAGE * 20, 0])
    assert got == [FULL_12, layout(10, [], [(layers(), full())])]


def test_same_layer_with_different_specs_on_two_workers_is_an_error():
    with pytest.raises(ValueError, match="'layer1'") as info:
        configs([{"layer1": full()}, {"layer1": sliding()}], [PAGE * 20] * 2)
    assert isinstance(info.value, AssertionError)  # what vLLM's own tests expect


@pytest.mark.parametrize("override", [16, 64])
def test_num_gpu_blocks_override_smaller_or_larger_than_what_fits(override):
    got = one(
        {"layer1": full(), "layer2": full()},
        PAGE * 2 * 32,
        cache=CacheConfig(num_gpu_blocks_override=override),
    )
    assert got == layout(
        override, [(override, layers(1)), (override, layers(2))], [(layers(1, 2), full())]
    )


def test_num_gpu_blocks_override_ignores_measured_memory_per_worker():
    cache = CacheConfig(num_gpu_blocks_override=8)
    specs = [hybrid(2, 4), hybrid(2, 4)]
    for config in configs(specs, [0, PAGE * 1000], cache=cache):
        assert config.num_blocks == 8
        assert [t.size for t in config.kv_cache_tensors] == [8 * PAGE, 8 * PAGE]
    assert one({}, 0, cache=cache).num_blocks == 1  # attention-free keeps its null block


def hybrid_cases():
    f, s = full(), sliding()
    one_one = layout(64, [(64, layers(1, 2))], [(layers(1), f), (layers(2), s)])
    two_four = layout(
        32,
        [(32, layers(1, 3, 4)), (32, layers(2, 5, 6))],
        [(layers(1, 2), f), (layers(3, 5), s), (layers(4, 6), s)],
    )
    three_seven = layout(
        32,
        [(32, layers(1, 4, 5, 6)), (32, layers(2, 7, 8, 9)), (32, layers(3, 10))],
        [(layers(1, 2, 3), f), (layers(4, 7, 10), s), (layers(5, 8), s), (layers(6, 9), s)],
    )
    six_five = layout(
        32,
        [(32, layers(i, i + 6)) for i in range(1, 6)] + [(32, layers(6))],
        [(layers(1, 2, 3, 4, 5, 6), f), (layers(7, 8, 9, 10, 11), s)],
    )
    return [
        (1, 1, 2 * 32, one_one),
        (2, 4, 2 * 32, two_four),
        (3, 7, 3 * 32, three_seven),
        (6, 5, 6 * 32, six_five),
    ]


@pytest.mark.parametrize(("num_full", "num_sliding", "memory_pages", "expected"), hybrid_cases())
def test_hybrid_full_and_sliding_layouts(num_full, num_sliding, memory_pages, expected):
    assert one(hybrid(num_full, num_sliding), memory_pages * PAGE) == expected


def test_different_head_sizes_share_one_uniform_type_group():
    specs = {"layer1": full(head_size=128), "layer2": full()}
    got = one(specs, PAGE * 3 * 32)
    assert got == KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[
            KVCacheTensor(size=2 * PAGE * 32, shared_by=layers(1)),
            KVCacheTensor(size=PAGE * 32, shared_by=layers(2)),
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers(1, 2), UniformTypeKVCacheSpecs(16, specs))],
    )
    # Over workers, each counts only its own layers' pages per block.
    pp = configs([{"layer1": full(head_size=128)}, {"layer2": full()}], [PAGE * 64] * 2)
    assert [c.num_blocks for c in pp] == [32, 32]
    assert [t.size for t in pp[1].kv_cache_tensors] == [32 * PAGE]


def test_different_head_sizes_and_types_align_by_block_size():
    got = one({"layer1": full(head_size=64), "layer2": sliding(head_size=32)}, PAGE * 32)
    assert got == layout(
        32,
        [(32, layers(1, 2))],
        [(layers(1), full(head_size=64)), (layers(2), sliding(head_size=32, block_size=32))],
    )


def test_page_sizes_that_do_not_divide_are_an_error():
    specs = {"layer1": full(head_size=64), "layer2": sliding(head_size=96)}
    with pytest.raises(ValueError, match="does not divide") as info:
        one(specs, PAGE * 64)
    assert isinstance(info.value, NotImplementedError)  # what vLLM raises


def test_attention_free_model():
    (config,) = configs([{}], [0])
    assert config == KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    assert [c.num_blocks for c in configs([{}, {}], [PAGE, 0])] == [1, 1]
    assert get_max_concurrency_for_kv_cache_config(SCHED, config) == math.inf
    assert get_kv_cache_capacity(SCHED, config) == (0, math.inf)


@pytest.mark.parametrize(("specs", "memory"), [([{}], []), ([], []), ([{}, {}], [0])])
def test_one_memory_entry_per_worker_is_required(specs, memory):
    with pytest.raises(ValueError, match="one spec dict and one available_memory entry"):
        configs(specs, memory)


def test_inputs_are_not_mutated_and_outputs_pickle():
    specs, memory = [hybrid(1, 1)], [PAGE * 8]
    got = configs(specs, memory, cache=CacheConfig(num_gpu_blocks_override=4))
    assert specs == [hybrid(1, 1)] and memory == [PAGE * 8]
    assert pickle.loads(pickle.dumps(got)) == got


def test_unify_takes_the_minimum_and_shrinks_tensors():
    small = layout(10, [(10, layers(1))], [(layers(1), full())])
    large = layout(30, [(30, layers(2))], [(layers(2), full())])
    assert unify_kv_cache_configs([large, small]) == [
        layout(10, [(10, layers(2))], [(layers(2), full())]),
        small,
    ]
    assert large.num_blocks == 30  # the inputs are left as they were
    tensorless = layout(1, [], [([], full())])
    assert unify_kv_cache_configs([tensorless, large])[0].num_blocks == 30


def test_unify_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        unify_kv_cache_configs([])
    with pytest.raises(ValueError, match="disagree"):
        unify_kv_cache_configs([layout(1, [], [([], full())]), layout(1, [], [([], sliding())])])
    with pytest.raises(ValueError, match="not a positive multiple"):
        unify_kv_cache_configs([layout(3, [(1, ["a"])], [(["a"], full())])])


def concurrency_cases():
    full_spec = qwen_layer()  # 1024 blocks for 16384 tokens
    window = SlidingWindowSpec(16, 32, 128, torch.float16, sliding_window=1024)  # 129 blocks
    uniform = UniformTypeKVCacheSpecs(16, {f"l{i}": full_spec for i in range(4)})
    names = [f"l{i}" for i in range(32)]
    return [
        (1536, [(names, full_spec)], 1.5),
        (129 * 3, [(names, window)], 3.0),
        (1153 * 3, [(names, full_spec), ([f"s{i}" for i in range(32)], window)], 3.0),
        (1153 * 3, [(names, full_spec), (["s0", "s1"], window)], 3.0),
        (1153 * 3, [(names[:4], uniform), (["s0", "s1"], window)], 3.0),
    ]


@pytest.mark.parametrize(("num_blocks", "groups", "expected"), concurrency_cases())
def test_max_concurrency_and_capacity(num_blocks, groups, expected):
    sched = SchedulerConfig(max_model_len=16384, max_num_batched_tokens=1024)
    config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(ls, spec) for ls, spec in groups])
    assert get_max_concurrency_for_kv_cache_config(sched, config) == expected
    assert get_kv_cache_capacity(sched, config) == (int(expected * 16384), expected)
