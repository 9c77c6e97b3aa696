from __future__ import annotations

import math
import pickle

import pytest
import torch

from tests.kv_specs import full, sliding
from v1engine.config import CacheConfig, SchedulerConfig
from v1engine.core.kv_cache_utils import (
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_kv_cache_capacity,
    get_kv_cache_configs,
    get_max_concurrency_for_kv_cache_config,
    unify_kv_cache_configs,
)
from v1engine.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

PAGE = 16 * 2 * 64 * 4 * 2  # bytes of one 16-token block of one default layer
CACHE = CacheConfig()
SCHED = SchedulerConfig(max_model_len=16)  # one block per full layer, two per sliding layer


def qwen_layer() -> FullAttentionSpec:  # 0.5 MiB per token over 32 layers
    return FullAttentionSpec(block_size=16, num_kv_heads=32, head_size=128, dtype=torch.float16)


def configs(specs, memory, cache=CACHE, sched=SCHED) -> list[KVCacheConfig]:
    return get_kv_cache_configs(cache, sched, specs, memory)


def one(specs, memory, **kwargs) -> KVCacheConfig:
    return configs([specs], [memory], **kwargs)[0]


def layout(num_blocks, tensors, groups) -> KVCacheConfig:
    """tensors: [(pages, layers)]; groups: [(layers, spec)]."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=p * PAGE, shared_by=ls) for p, ls in tensors],
        kv_cache_groups=[KVCacheGroupSpec(ls, spec) for ls, spec in groups],
    )


def layers(*indices: int) -> list[str]:
    return [f"layer{i}" for i in indices]


def hybrid(num_full: int, num_sliding: int) -> dict:
    specs = {f"layer{i}": full() for i in range(1, num_full + 1)}
    specs.update({f"layer{i}": sliding() for i in range(num_full + 1, num_full + num_sliding + 1)})
    return specs


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


def test_num_gpu_blocks_override_too_small_for_max_model_len():
    cache = CacheConfig(num_gpu_blocks_override=32)
    sched = SchedulerConfig(max_model_len=1024)  # needs 64 blocks
    with pytest.raises(ValueError, match="max seq len") as info:
        one({"layer1": full(), "layer2": full()}, PAGE * 2 * 1024, cache=cache, sched=sched)
    message = str(info.value)
    assert "num_gpu_blocks_override` (now 32)" in message
    # One of the 32 blocks is the block pool's null block: 31 x 16 tokens are usable.
    assert "estimated maximum model length is 496" in message
    sched = SchedulerConfig(max_model_len=512)  # exactly 32 blocks: one short at run time
    with pytest.raises(ValueError, match="max seq len"):
        one({"layer1": full()}, PAGE, cache=cache, sched=sched)
    sched = SchedulerConfig(max_model_len=496)
    assert one({"layer1": full()}, PAGE, cache=cache, sched=sched).num_blocks == 32


@pytest.mark.parametrize("memory", [0, -PAGE])
def test_no_memory_left_for_the_cache(memory):
    with pytest.raises(ValueError, match="No available memory for the cache blocks") as info:
        one({"layer1": full()}, memory)
    assert "gpu_memory_utilization` (now 0.9)" in str(info.value)


def test_not_enough_memory_message_names_sizes_estimate_and_knobs():
    sched = SchedulerConfig(max_model_len=2048)  # 2 layers x 128 pages + the null block
    with pytest.raises(ValueError) as info:
        one({"layer1": full(), "layer2": full()}, PAGE * 100, sched=sched)
    message = str(info.value)
    for part in (
        "max seq len (max_model_len=2048)",
        f"({258 * PAGE} bytes)",
        f"({100 * PAGE} bytes)",
        "estimated maximum model length is 784",  # (50 blocks - null block) x 16
        "gpu_memory_utilization",
        "kv_cache_memory_bytes` (now unset)",
        "decreasing `max_model_len`",
    ):
        assert part in message


def test_not_enough_memory_message_in_gib():
    sched = SchedulerConfig(max_model_len=16385, max_num_batched_tokens=32768)
    spec = {f"layer_{i}": qwen_layer() for i in range(32)}
    with pytest.raises(ValueError) as info:
        configs([spec, spec], [8 << 30, 9 << 30], sched=sched)
    message = str(info.value)
    assert message.startswith("rank 0: ")
    assert "8.02 GiB of KV cache is needed" in message and "memory: 8.00 GiB" in message
    assert "estimated maximum model length is 16368" in message  # 1024 blocks - null block


def test_estimate_is_left_out_when_not_even_one_token_fits():
    with pytest.raises(ValueError, match="max seq len") as info:
        one({"layer1": full()}, PAGE - 1)
    assert "estimated" not in str(info.value)


def test_memory_check_at_the_exact_boundary():
    sched = SchedulerConfig(max_model_len=100)  # 7 pages per full layer, + 1 null block
    specs = {"layer1": full(), "layer2": full()}
    assert one(specs, 16 * PAGE, sched=sched).num_blocks == 8
    with pytest.raises(ValueError, match="max seq len"):
        one(specs, 16 * PAGE - 1, sched=sched)


def test_memory_check_counts_padding_layers_of_hybrid_groups():
    # Groups (F1,F2,F3) (S4,S7,S10) (S5,S8,_) (S6,S9,_): 3 x (1 + 3 x 2) = 21 pages per
    # request, though the layers alone need 3 + 7 x 2 = 17; plus the null block's 3 pages.
    specs = hybrid(3, 7)
    check_enough_kv_cache_memory(CACHE, SCHED, specs, 17 * PAGE)
    with pytest.raises(ValueError, match="max seq len"):
        one(specs, 24 * PAGE - 1)
    assert one(specs, 24 * PAGE).num_blocks == 8


def test_check_enough_kv_cache_memory_sums_over_layers():
    sched = SchedulerConfig(max_model_len=100)
    specs = {"layer1": full(), "layer2": sliding(sliding_window=20)}  # 7 + (ceil(100/16)+1)
    check_enough_kv_cache_memory(CACHE, sched, specs, 15 * PAGE)
    with pytest.raises(ValueError, match="max seq len.*estimated maximum model length is 96"):
        check_enough_kv_cache_memory(CACHE, sched, specs, 15 * PAGE - 1)
    check_enough_kv_cache_memory(CACHE, sched, {}, 0)  # attention-free: nothing to check
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes` \(now 1024\)"):
        check_enough_kv_cache_memory(CacheConfig(kv_cache_memory_bytes=1024), sched, specs, 1)


@pytest.mark.parametrize(("max_model_len", "expected"), [(16385, 16384), (16383, 16383)])
def test_estimate_max_model_len_reference_cases(max_model_len, expected):
    sched = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=32768)
    spec = {f"layer_{i}": qwen_layer() for i in range(32)}
    assert estimate_max_model_len(CACHE, sched, spec, 8 << 30) == expected


@pytest.mark.parametrize(
    ("memory", "expected"),
    [(3 * PAGE, 48), (3 * PAGE - 1, 32), (PAGE, 16), (PAGE - 1, 0), (0, 0), (1 << 40, 2048)],
)
def test_estimate_max_model_len_at_block_boundaries(memory, expected):
    sched = SchedulerConfig(max_model_len=2048)
    assert estimate_max_model_len(CACHE, sched, {"layer1": full()}, memory) == expected


def test_estimate_max_model_len_with_a_window_and_edge_cases():
    sched = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=64)
    window = {"layer1": sliding(sliding_window=32)}  # min(95, len) tokens + 1 block
    assert estimate_max_model_len(CACHE, sched, window, 4 * PAGE) == 48
    assert estimate_max_model_len(CACHE, sched, window, 8 * PAGE) == 4096  # window saturates
    assert estimate_max_model_len(CACHE, sched, {}, 0) == 4096
    tiny = SchedulerConfig(max_model_len=1)
    assert estimate_max_model_len(CACHE, tiny, {"layer1": full()}, PAGE) == 1


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
