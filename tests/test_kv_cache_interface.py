from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tests import kv_specs
from v1engine.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheSpecMismatchError,
    KVCacheTensor,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from v1engine.utils import cdiv

full = kv_specs.full


def sliding(**overrides) -> SlidingWindowSpec:
    return kv_specs.sliding(**{"sliding_window": 128, **overrides})


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.float32, 16 * 2 * 128 * 4), (torch.float16, 16 * 2 * 128 * 2), (torch.int8, 4096)],
)
def test_page_size_is_block_heads_k_plus_v_dtype(dtype, expected):
    assert full(dtype=dtype).page_size_bytes == expected
    assert sliding(dtype=dtype).page_size_bytes == expected


def test_page_size_with_separate_v_head_size():
    spec = full(head_size=192, head_size_v=128, dtype=torch.bfloat16)
    assert spec.page_size_bytes == 16 * 2 * (192 + 128) * 2


def test_head_size_v_defaults_to_head_size_and_compares_equal():
    assert full().head_size_v == 64
    assert full() == full(head_size_v=64)
    assert hash(full()) == hash(full(head_size_v=64))
    assert sliding(head_size_v=32) != sliding()


def test_positional_construction_matches_design_signature():
    assert FullAttentionSpec(16, 2, 64, torch.float32) == full()
    assert SlidingWindowSpec(16, 2, 64, torch.float32, 128) == sliding()


@pytest.mark.parametrize(("max_model_len", "num_pages"), [(1, 1), (16, 1), (17, 2), (2048, 128)])
def test_full_attention_needs_ceil_len_over_block_pages(max_model_len, num_pages):
    spec = full()
    usage = spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens=8192)
    assert usage == num_pages * spec.page_size_bytes


@pytest.mark.parametrize(
    ("window", "max_model_len", "batched", "num_pages"),
    [
        (1, 16, 2048, 2),  # capped by max_model_len: ceil(16 / 16) + 1
        (128, 4096, 256, 25),  # 127 + 256 = 383 tokens -> 24 pages + 1 straddling block
        (129, 4096, 256, 25),  # 384 tokens, exactly 24 pages, + 1
        (130, 4096, 256, 26),  # 385 tokens -> 25 pages + 1
        (1024, 16384, 1024, 129),  # vLLM's reference case
        (4096, 100, 2048, 8),  # window longer than the model: ceil(100 / 16) + 1
    ],
)
def test_sliding_window_pages(window, max_model_len, batched, num_pages):
    spec = sliding(sliding_window=window)
    usage = spec.max_memory_usage_bytes(max_model_len, batched)
    assert usage == num_pages * spec.page_size_bytes


def test_type_id_ignores_shape_but_not_kind_window_or_block_size():
    assert full().type_id == full(head_size=128, num_kv_heads=8, dtype=torch.float16).type_id
    assert full().type_id != full(block_size=32).type_id
    assert full().type_id != sliding().type_id
    assert sliding().type_id != sliding(sliding_window=64).type_id
    assert sliding().type_id == sliding(head_size=32).type_id


def test_specs_are_frozen_hashable_and_picklable():
    spec = sliding()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32  # type: ignore[misc]
    assert {spec: "x"}[sliding()] == "x"
    for obj in (full(), sliding(), full(head_size_v=32)):
        restored = pickle.loads(pickle.dumps(obj))
        assert restored == obj and hash(restored) == hash(obj)


def test_base_classes_are_abstract():
    with pytest.raises(TypeError):
        KVCacheSpec(block_size=16)  # type: ignore[abstract]
    with pytest.raises(TypeError):
        AttentionSpec(16, 2, 64, torch.float32)  # type: ignore[abstract]


@pytest.mark.parametrize(
    ("overrides", "field_name"),
    [
        ({"block_size": 0}, "block_size"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"head_size": -1}, "head_size"),
        ({"head_size_v": -1}, "head_size_v"),
        ({"dtype": "float16"}, "dtype"),
        ({"block_size": 16.0}, "block_size"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_invalid_spec_fields_raise_value_error_naming_the_field(overrides, field_name):
    with pytest.raises(ValueError, match=field_name):
        sliding(**overrides)


def test_merge_returns_the_common_spec():
    assert FullAttentionSpec.merge([full(), full(), full()]) == full()
    assert SlidingWindowSpec.merge([sliding()]) == sliding()


@pytest.mark.parametrize(
    "specs",
    [
        [full(num_kv_heads=32), full(num_kv_heads=16)],
        [full(), full(dtype=torch.float16)],
        [sliding(), sliding(sliding_window=1)],
    ],
)
def test_merge_of_unequal_specs_raises(specs):
    with pytest.raises(KVCacheSpecMismatchError, match="differs from"):
        type(specs[0]).merge(specs)


def test_merge_error_is_both_value_and_assertion_error():
    # ValueError by our rules; AssertionError as in vLLM, whose tests catch that.
    different_kinds = [full(), sliding(sliding_window=1)]
    with pytest.raises(ValueError):
        FullAttentionSpec.merge(different_kinds)
    with pytest.raises(AssertionError):
        SlidingWindowSpec.merge(different_kinds)


def test_merge_rejects_specs_of_another_class_and_empty_lists():
    with pytest.raises(KVCacheSpecMismatchError):
        FullAttentionSpec.merge([sliding(), sliding()])
    with pytest.raises(ValueError, match="at least one"):
        FullAttentionSpec.merge([])


def test_uniform_type_from_specs_merges_one_attention_type():
    specs = {"layer_1": full(), "layer_2": full(head_size=128)}
    assert UniformTypeKVCacheSpecs.from_specs(specs) == UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs=specs
    )
    same_window = {"a": sliding(sliding_window=1), "b": sliding(sliding_window=1, head_size=128)}
    assert UniformTypeKVCacheSpecs.from_specs(same_window) is not None


@pytest.mark.parametrize(
    "specs",
    [
        {"layer_1": full(), "layer_2": sliding(sliding_window=1)},
        {"layer_1": sliding(sliding_window=1), "layer_2": full()},
        {"layer_1": full(block_size=16), "layer_2": full(block_size=32)},
        {"layer_1": sliding(sliding_window=1), "layer_2": sliding(sliding_window=2)},
        {},
    ],
)
def test_uniform_type_from_specs_refuses_mixed_types(specs):
    assert UniformTypeKVCacheSpecs.from_specs(specs) is None


def test_uniform_type_spec_sums_pages_and_counts_blocks_once():
    specs = {"a": full(head_size=128), "b": full()}
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs)
    assert uniform.page_size_bytes == 3 * full().page_size_bytes
    assert uniform.type_id == full().type_id
    # 100 tokens -> 7 blocks, each spanning both layers' pages.
    assert uniform.max_memory_usage_bytes(100, 2048) == 7 * uniform.page_size_bytes
    assert cdiv(uniform.max_memory_usage_bytes(100, 2048), uniform.page_size_bytes) == 7


def test_uniform_type_spec_hash_ignores_layer_order_and_pickles():
    a = UniformTypeKVCacheSpecs(16, {"x": full(), "y": full(head_size=32)})
    b = UniformTypeKVCacheSpecs(16, {"y": full(head_size=32), "x": full()})
    assert a == b and hash(a) == hash(b)
    assert pickle.loads(pickle.dumps(a)) == a


@pytest.mark.parametrize(
    ("block_size", "specs"),
    [(16, {}), (16, {"a": full(), "b": sliding()}), (32, {"a": full(), "b": full(head_size=8)})],
)
def test_uniform_type_spec_validates_its_layers(block_size, specs):
    with pytest.raises(ValueError, match="UniformTypeKVCacheSpecs"):
        UniformTypeKVCacheSpecs(block_size=block_size, kv_cache_specs=specs)


def test_config_objects_normalise_sequences_to_lists():
    from_tuples = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=(KVCacheTensor(size=64, shared_by=("a", "b")),),
        kv_cache_groups=(KVCacheGroupSpec(("a", "b"), full()),),
    )
    from_lists = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[KVCacheTensor(size=64, shared_by=["a", "b"])],
        kv_cache_groups=[KVCacheGroupSpec(["a", "b"], full())],
    )
    assert from_tuples == from_lists
    assert from_tuples.kv_cache_groups[0].layer_names == ["a", "b"]
    assert from_tuples.kv_cache_tensors[0].shared_by == ["a", "b"]
    assert pickle.loads(pickle.dumps(from_tuples)) == from_lists


def test_config_objects_are_frozen_and_validate_counts():
    config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_blocks = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(num_blocks=-1, kv_cache_tensors=[], kv_cache_groups=[])
    with pytest.raises(ValueError, match="size"):
        KVCacheTensor(size=-8, shared_by=["a"])
