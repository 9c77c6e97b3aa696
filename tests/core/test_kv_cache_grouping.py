from __future__ import annotations

import pytest

from tests.kv_specs import PAGE, full, sliding
from v1engine.core.kv_cache_grouping import (
    KVCachePageSizeError,
    bytes_per_block,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    is_kv_cache_spec_uniform,
    merge_kv_cache_specs,
    project_kv_cache_groups_to_worker,
    unify_kv_cache_spec_page_size,
)
from v1engine.kv_cache_interface import (
    KVCacheGroupSpec,
    KVCacheSpecMismatchError,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
)


def names_and_specs(groups: list[KVCacheGroupSpec]) -> list[tuple[list[str], object]]:
    return [(group.layer_names, group.kv_cache_spec) for group in groups]


def test_merge_takes_the_union_in_first_seen_order():
    merged = merge_kv_cache_specs([{"a": full(), "b": full()}, {"b": full(), "c": sliding()}])
    assert list(merged) == ["a", "b", "c"]
    assert merged["c"] == sliding()


def test_merge_rejects_a_layer_with_two_specs():
    with pytest.raises(KVCacheSpecMismatchError, match=r"'layer1'.*rank 0.*rank 1"):
        merge_kv_cache_specs([{"layer1": full()}, {"layer1": sliding()}])


@pytest.mark.parametrize(
    ("specs", "uniform"),
    [
        ({}, True),
        ({"a": full(), "b": full()}, True),
        ({"a": full(), "b": sliding()}, False),
        ({"a": sliding(), "b": sliding()}, True),
        ({"a": sliding(), "b": sliding(sliding_window=2)}, False),
        ({"a": full(), "b": full(num_kv_heads=4)}, False),
    ],
)
def test_is_kv_cache_spec_uniform(specs, uniform):
    assert is_kv_cache_spec_uniform(specs) is uniform


def test_unify_page_size_grows_block_size_of_smaller_pages():
    specs = {
        "big": full(head_size=128),
        "small": sliding(head_size=32),
        "same": full(head_size=128),
    }
    unified = unify_kv_cache_spec_page_size(specs)
    assert unified["big"] is specs["big"] and unified["same"] is specs["same"]
    assert unified["small"] == sliding(head_size=32, block_size=64)
    assert {spec.page_size_bytes for spec in unified.values()} == {2 * PAGE}
    assert unify_kv_cache_spec_page_size({"a": full()}) == {"a": full()}


def test_unify_page_size_refuses_sizes_that_do_not_divide():
    specs = {"layer_1": full(head_size=64), "layer_2": sliding(head_size=96)}
    with pytest.raises(KVCachePageSizeError, match="does not divide") as info:
        unify_kv_cache_spec_page_size(specs)
    # ValueError by our rules, NotImplementedError as vLLM raises.
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, NotImplementedError)
    assert "layer_1" in str(info.value) and "layer_2" in str(info.value)


def test_groups_attention_free_uniform_and_uniform_type():
    assert get_kv_cache_groups({}) == []
    assert get_kv_cache_groups({"a": full(), "b": full()}) == [KVCacheGroupSpec(["a", "b"], full())]
    specs = {"a": full(head_size=128), "b": full()}
    assert get_kv_cache_groups(specs) == [
        KVCacheGroupSpec(["a", "b"], UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs))
    ]


def hybrid(num_full: int, num_sliding: int) -> dict:
    specs = {f"layer_{i}": full() for i in range(1, num_full + 1)}
    for i in range(num_full + 1, num_full + num_sliding + 1):
        specs[f"layer_{i}"] = sliding()
    return specs


@pytest.mark.parametrize(
    ("num_full", "num_sliding", "expected"),
    [
        (1, 1, [([1], "F"), ([2], "S")]),
        (2, 4, [([1, 2], "F"), ([3, 5], "S"), ([4, 6], "S")]),
        # group_size = 3: seven sliding layers pad to three groups of three.
        (3, 7, [([1, 2, 3], "F"), ([4, 7, 10], "S"), ([5, 8], "S"), ([6, 9], "S")]),
        # 6 < 1.5 x 5: pad the sliding layers to one group of six instead of splitting.
        (6, 5, [([1, 2, 3, 4, 5, 6], "F"), ([7, 8, 9, 10, 11], "S")]),
        (4, 2, [([1, 3], "F"), ([2, 4], "F"), ([5, 6], "S")]),
    ],
)
def test_hybrid_grouping(num_full, num_sliding, expected):
    kinds = {"F": full(), "S": sliding()}
    groups = get_kv_cache_groups(hybrid(num_full, num_sliding))
    assert names_and_specs(groups) == [
        ([f"layer_{i}" for i in layers], kinds[kind]) for layers, kind in expected
    ]


def test_hybrid_grouping_of_an_interleaved_five_to_one_pattern():
    # Gemma-3-like: every sixth layer is full attention.
    specs = {f"l{i}": full() if i % 6 == 5 else sliding() for i in range(12)}
    groups = get_kv_cache_groups(specs)
    assert [len(group.layer_names) for group in groups] == [2] * 6
    assert groups[0].layer_names == ["l0", "l6"]  # buckets in first-seen order
    assert KVCacheGroupSpec(["l5", "l11"], full()) in groups
    assert sorted(name for group in groups for name in group.layer_names) == sorted(specs)


def test_hybrid_grouping_unifies_page_sizes_first():
    groups = get_kv_cache_groups({"layer_1": full(head_size=64), "layer_2": sliding(head_size=32)})
    assert names_and_specs(groups) == [
        (["layer_1"], full(head_size=64)),
        (["layer_2"], sliding(head_size=32, block_size=32)),
    ]


def test_projection_keeps_every_group_in_order_and_filters_layers():
    groups = [KVCacheGroupSpec(["a", "b", "c"], full()), KVCacheGroupSpec(["d"], sliding())]
    projected = project_kv_cache_groups_to_worker(groups, {"a": full(), "c": full()})
    assert projected == [KVCacheGroupSpec(["a", "c"], full()), KVCacheGroupSpec([], sliding())]


def test_projection_of_a_uniform_type_group_keeps_only_own_pages():
    specs = {"a": full(), "b": full(num_kv_heads=4), "c": full()}
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs)
    (projected,) = project_kv_cache_groups_to_worker(
        [KVCacheGroupSpec(["a", "b", "c"], uniform)], {"a": full(), "c": full()}
    )
    assert projected.layer_names == ["a", "c"]
    assert projected.kv_cache_spec.kv_cache_specs == {"a": full(), "c": full()}
    assert bytes_per_block([projected]) == 2 * PAGE
    (empty,) = project_kv_cache_groups_to_worker([KVCacheGroupSpec(["a"], uniform)], {})
    assert empty == KVCacheGroupSpec([], uniform)


def test_config_from_groups_shares_tensor_i_by_the_ith_layer_of_each_group():
    groups = [
        KVCacheGroupSpec(["f0", "f1"], full()),
        KVCacheGroupSpec(["s0", "s2"], sliding()),
        KVCacheGroupSpec(["s1"], sliding()),
    ]
    assert bytes_per_block(groups) == 2 * PAGE
    config = get_kv_cache_config_from_groups(groups, 2 * PAGE * 7 + PAGE)
    assert config.num_blocks == 7
    assert config.kv_cache_tensors == [
        KVCacheTensor(size=7 * PAGE, shared_by=["f0", "s0", "s1"]),
        KVCacheTensor(size=7 * PAGE, shared_by=["f1", "s2"]),
    ]
    assert config.kv_cache_groups == groups


def test_config_from_groups_without_layers_has_one_block_and_no_tensors():
    config = get_kv_cache_config_from_groups([KVCacheGroupSpec([], full())], 1 << 30)
    assert (config.num_blocks, config.kv_cache_tensors) == (1, [])
    assert get_kv_cache_config_from_groups([], 0).num_blocks == 1
