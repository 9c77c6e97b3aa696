"""`check_enough_kv_cache_memory` and `estimate_max_model_len`: their messages, their numbers,
and that they say exactly what `get_kv_cache_configs` does."""

from __future__ import annotations

import pytest

from tests.kv_specs import CACHE, PAGE, SCHED, configs, full, hybrid, one, qwen_layer, sliding
from v1engine.config import CacheConfig, SchedulerConfig
from v1engine.core.kv_cache_utils import check_enough_kv_cache_memory, estimate_max_model_len
from v1engine.utils import GiB_bytes


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
        configs([spec, spec], [8 * GiB_bytes, 9 * GiB_bytes], sched=sched)
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
    with pytest.raises(ValueError, match="max seq len"):
        check_enough_kv_cache_memory(CACHE, SCHED, specs, 24 * PAGE - 1)
    with pytest.raises(ValueError, match="max seq len"):
        one(specs, 24 * PAGE - 1)
    check_enough_kv_cache_memory(CACHE, SCHED, specs, 24 * PAGE)
    assert one(specs, 24 * PAGE).num_blocks == 8


def test_check_enough_kv_cache_memory_counts_groups_and_the_null_block():
    sched = SchedulerConfig(max_model_len=100)
    # Two groups of one layer: 7 full pages + (ceil(100/16) + 1) window pages + the null block.
    specs = {"layer1": full(), "layer2": sliding(sliding_window=20)}
    check_enough_kv_cache_memory(CACHE, sched, specs, 16 * PAGE)
    with pytest.raises(ValueError, match="max seq len.*estimated maximum model length is 96"):
        check_enough_kv_cache_memory(CACHE, sched, specs, 16 * PAGE - 1)
    check_enough_kv_cache_memory(CACHE, sched, {}, 0)  # attention-free: nothing to check
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes` \(now 1024\)"):
        check_enough_kv_cache_memory(CacheConfig(kv_cache_memory_bytes=1024), sched, specs, 1)
    with pytest.raises(ValueError, match="No available memory.*gpu_memory_utilization"):
        check_enough_kv_cache_memory(CACHE, sched, specs, 0)


# Per case: the layers, max_model_len, the blocks one request needs with the null block, and
# the bytes of one block over all of the worker's tensors.
BOUNDARY_CASES = {
    "one full group": ({"layer1": full(), "layer2": full()}, 100, 7 + 1, 2 * PAGE),
    "full + window groups": (
        {"layer1": full(), "layer2": sliding(sliding_window=20)},
        100,
        7 + 8 + 1,
        PAGE,
    ),
    # Groups (F1,F2,F3) (S4,S7,S10) (S5,S8,_) (S6,S9,_), block = 3 pages.
    "hybrid with padding layers": (hybrid(3, 7), 100, 7 + 3 * 8 + 1, 3 * PAGE),
    "uniform type (head sizes differ)": (
        {"layer1": full(head_size=128), "layer2": full()},
        100,
        7 + 1,
        3 * PAGE,
    ),
}


@pytest.mark.parametrize("case", list(BOUNDARY_CASES))
@pytest.mark.parametrize("short_by", ["nothing", "one byte", "one block"])
def test_public_check_and_engine_agree_at_the_boundary(case, short_by):
    specs, max_model_len, num_blocks, block_bytes = BOUNDARY_CASES[case]
    sched = SchedulerConfig(max_model_len=max_model_len)
    needed = num_blocks * block_bytes
    memory = needed - {"nothing": 0, "one byte": 1, "one block": block_bytes}[short_by]

    def outcome(check):
        try:
            check()
        except ValueError as e:
            return str(e)
        return None

    public = outcome(lambda: check_enough_kv_cache_memory(CACHE, sched, specs, memory))
    engine = outcome(lambda: one(specs, memory, sched=sched))
    assert public == engine
    # Tensor-parallel ranks each hold every layer: the engine names the first rank short.
    tp_engine = outcome(lambda: configs([specs, specs], [memory, memory], sched=sched))
    assert tp_engine == (None if public is None else "rank 0: " + public)
    assert (public is None) == (short_by == "nothing")
    estimate = estimate_max_model_len(CACHE, sched, specs, memory)
    assert (estimate == max_model_len) == (short_by == "nothing")
    if public is not None:
        assert f"({needed} bytes)" in public and f"({memory} bytes)" in public
        assert f"estimated maximum model length is {estimate}" in public
        # The estimate is exactly the longest length the engine accepts.
        one(specs, memory, sched=SchedulerConfig(max_model_len=estimate))
        with pytest.raises(ValueError, match="max seq len"):
            one(specs, memory, sched=SchedulerConfig(max_model_len=estimate + 1))


@pytest.mark.parametrize(("override", "fits"), [(8, True), (7, False)])
def test_public_check_and_engine_agree_under_num_gpu_blocks_override(override, fits):
    cache = CacheConfig(num_gpu_blocks_override=override)
    sched = SchedulerConfig(max_model_len=100)  # 7 blocks + the null block
    specs = {"layer1": full()}
    for memory in (0, PAGE, 1000 * PAGE):  # the override replaces the measured memory
        if fits:
            check_enough_kv_cache_memory(cache, sched, specs, memory)
            assert one(specs, memory, cache=cache, sched=sched).num_blocks == override
            assert estimate_max_model_len(cache, sched, specs, memory) == 100
            continue
        with pytest.raises(ValueError, match="num_gpu_blocks_override` \\(now 7\\)") as public:
            check_enough_kv_cache_memory(cache, sched, specs, memory)
        with pytest.raises(ValueError) as engine:
            one(specs, memory, cache=cache, sched=sched)
        assert str(public.value) == str(engine.value)
        assert estimate_max_model_len(cache, sched, specs, memory) == 96  # 6 usable blocks


@pytest.mark.parametrize(("max_model_len", "expected"), [(16385, 16368), (16383, 16368)])
def test_estimate_max_model_len_reference_cases(max_model_len, expected):
    # vLLM's reference cases (8 GiB, 32 layers of 0.25 MiB per 16-token page: 1024 blocks), less
    # the null block: 1023 x 16 tokens.
    sched = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=32768)
    spec = {f"layer_{i}": qwen_layer() for i in range(32)}
    assert estimate_max_model_len(CACHE, sched, spec, 8 * GiB_bytes) == expected


@pytest.mark.parametrize(
    ("memory", "expected"),
    [
        (4 * PAGE, 48),
        (4 * PAGE - 1, 32),
        (2 * PAGE, 16),
        (2 * PAGE - 1, 0),
        (0, 0),
        (1 << 40, 2048),
    ],
)
def test_estimate_max_model_len_at_block_boundaries(memory, expected):
    sched = SchedulerConfig(max_model_len=2048)  # one of the blocks is the null block
    assert estimate_max_model_len(CACHE, sched, {"layer1": full()}, memory) == expected


def test_estimate_max_model_len_with_a_window_and_edge_cases():
    sched = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=64)
    window = {"layer1": sliding(sliding_window=32)}  # min(95, len) tokens + 1 block + null
    assert estimate_max_model_len(CACHE, sched, window, 5 * PAGE) == 48
    assert estimate_max_model_len(CACHE, sched, window, 8 * PAGE) == 4096  # window saturates
    assert estimate_max_model_len(CACHE, sched, {}, 0) == 4096
    tiny = SchedulerConfig(max_model_len=1)
    assert estimate_max_model_len(CACHE, tiny, {"layer1": full()}, 2 * PAGE) == 1
