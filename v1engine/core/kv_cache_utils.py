"""KV cache sizing: every worker's specs and spare bytes -> one `KVCacheConfig` per worker.

The steps of `get_kv_cache_configs`, the centre of the start-up handshake:
1. merge the workers' layer -> spec maps into the whole model's;
2. group the whole model's layers once (`kv_cache_grouping`);
3. give each worker every group, in the same order, filtered to its own layers;
4. `num_gpu_blocks_override` replaces each worker's bytes by override x bytes per block;
5. per worker, check that one `max_model_len` request fits, then size its blocks and tensors;
6. unify: every worker gets the smallest `num_blocks`, and its tensors shrink to match.

Layout of one worker (general case): with groups (full.0, full.1), (sw.0, sw.2), (sw.1, sw.3),
`group_size` = 2 tensors of `page_size_bytes x num_blocks` bytes each; tensor 0 is shared by
full.0, sw.0, sw.1 and tensor 1 by full.1, sw.2, sw.3. Block ids are unique across groups, so
layers sharing a tensor never touch the same block.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from v1engine.core.kv_cache_grouping import (
    bytes_per_block,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    has_layers,
    is_uniform_type_layout,
    merge_kv_cache_specs,
    project_kv_cache_groups_to_worker,
    uniform_page_size,
)
from v1engine.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    cdiv,
)
from v1engine.logger import init_logger

if TYPE_CHECKING:
    from v1engine.config import CacheConfig, SchedulerConfig

logger = init_logger(__name__)

_GIB = 1 << 30


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / _GIB:.2f}"


def _knob_hint(cache_config: CacheConfig, override_applied: bool) -> str:
    if override_applied:
        return f"increasing `num_gpu_blocks_override` (now {cache_config.num_gpu_blocks_override})"
    # kv_cache_memory_bytes, when set, replaces the utilization-based budget on the workers.
    memory_bytes = cache_config.kv_cache_memory_bytes
    return (
        f"increasing `gpu_memory_utilization` (now {cache_config.gpu_memory_utilization}) "
        f"or `kv_cache_memory_bytes` (now {'unset' if memory_bytes is None else memory_bytes})"
    )


def _search_max_model_len(
    memory_for_len: Callable[[int], int], max_model_len: int, available_memory: int
) -> int:
    """The largest length in [1, max_model_len] whose memory fits; 0 if even 1 does not."""
    if memory_for_len(1) > available_memory:
        return 0
    low, high = 1, max_model_len  # memory grows with length; `low` always fits
    while low < high:
        mid = (low + high + 1) // 2
        if memory_for_len(mid) <= available_memory:
            low = mid
        else:
            high = mid - 1
    return low


def _raise_if_not_enough(
    available_memory: int,
    memory_for_len: Callable[[int], int],
    max_model_len: int,
    knob_hint: str,
    where: str = "",
) -> None:
    if available_memory <= 0:
        raise ValueError(
            f"{where}No available memory for the cache blocks "
            f"(available_memory={available_memory} bytes). Try {knob_hint}."
        )
    needed_memory = memory_for_len(max_model_len)
    if needed_memory <= available_memory:
        return
    estimate = _search_max_model_len(memory_for_len, max_model_len, available_memory)
    estimate_msg = (
        f"Based on the available memory, the estimated maximum model length is {estimate}. "
        if estimate > 0
        else ""
    )
    raise ValueError(
        f"{where}To serve at least one request with the model's max seq len "
        f"(max_model_len={max_model_len}), {_gib(needed_memory)} GiB of KV cache is needed "
        f"({needed_memory} bytes), which is larger than the available KV cache memory: "
        f"{_gib(available_memory)} GiB ({available_memory} bytes). {estimate_msg}"
        f"Try {knob_hint}, or decreasing `max_model_len`."
    )


def _sum_of_layers(
    scheduler_config: SchedulerConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> Callable[[int], int]:
    tokens = scheduler_config.max_num_batched_tokens
    specs = list(kv_cache_spec.values())
    return lambda length: sum(spec.max_memory_usage_bytes(length, tokens) for spec in specs)


def check_enough_kv_cache_memory(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
) -> None:
    """Check that `available_memory` holds one request of `max_model_len` tokens in every layer.

    The need is the sum over layers of `max_memory_usage_bytes`. Nothing is checked for an
    attention-free model (no layers).

    Raises:
        ValueError: no memory at all, or too little; the message gives the GiB needed and
            available, the longest max_model_len that fits and the knobs to turn.
    """
    if not kv_cache_spec:
        return
    _raise_if_not_enough(
        available_memory,
        _sum_of_layers(scheduler_config, kv_cache_spec),
        scheduler_config.max_model_len,
        _knob_hint(cache_config, override_applied=False),
    )


def estimate_max_model_len(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
) -> int:
    """The longest max_model_len in [1, scheduler_config.max_model_len] whose one request fits
    in `available_memory` (summed over layers, as in `check_enough_kv_cache_memory`); 0 when even
    a one-token request does not fit.
    """
    return _search_max_model_len(
        _sum_of_layers(scheduler_config, kv_cache_spec),
        scheduler_config.max_model_len,
        available_memory,
    )


def _memory_for_len_from_groups(
    scheduler_config: SchedulerConfig, groups: list[KVCacheGroupSpec]
) -> Callable[[int], int]:
    """Bytes one request of a given length takes on this worker, padding layers included, plus
    the block the block pool keeps back as its null block (as vLLM does since its PR #47272):
    without it a cache of exactly one request's blocks passes here and then never schedules it.
    """
    tokens = scheduler_config.max_num_batched_tokens
    block_bytes = bytes_per_block(groups)
    if is_uniform_type_layout(groups):
        spec = groups[0].kv_cache_spec
        return lambda length: spec.max_memory_usage_bytes(length, tokens) + block_bytes
    page_size = uniform_page_size(groups)
    specs = [group.kv_cache_spec for group in groups]

    # Every group draws its blocks from the same pool, empty groups on this worker included.
    def memory_for_len(length: int) -> int:
        blocks = sum(cdiv(spec.max_memory_usage_bytes(length, tokens), page_size) for spec in specs)
        return (blocks + 1) * block_bytes

    return memory_for_len


def _apply_num_gpu_blocks_override(
    cache_config: CacheConfig,
    groups_per_worker: list[list[KVCacheGroupSpec]],
    available_memory: list[int],
) -> list[int]:
    """With an override, each worker's memory becomes exactly `override` blocks' worth."""
    override = cache_config.num_gpu_blocks_override
    if override is None:
        return list(available_memory)
    adjusted, natural_num_blocks = [], []
    for groups, memory in zip(groups_per_worker, available_memory):
        if not has_layers(groups):
            adjusted.append(memory)
            continue
        natural_num_blocks.append(max(memory, 0) // bytes_per_block(groups))
        adjusted.append(override * bytes_per_block(groups))
    if natural_num_blocks:
        logger.info(
            "Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d",
            min(natural_num_blocks),
            override,
        )
    return adjusted


def _check_groups_agree(kv_cache_configs: list[KVCacheConfig]) -> None:
    def type_ids(config: KVCacheConfig) -> list[str]:
        return [group.kv_cache_spec.type_id for group in config.kv_cache_groups]

    reference = type_ids(kv_cache_configs[0])
    for rank, config in enumerate(kv_cache_configs[1:], start=1):
        if type_ids(config) != reference:
            raise ValueError(
                f"KV cache configs disagree: rank 0 has groups {reference} but rank {rank} has "
                f"{type_ids(config)}; build all configs in one get_kv_cache_configs call"
            )


def _shrink(config: KVCacheConfig, num_blocks: int) -> KVCacheConfig:
    tensors = []
    for tensor in config.kv_cache_tensors:
        if config.num_blocks == 0 or tensor.size % config.num_blocks != 0:
            raise ValueError(
                f"cannot shrink KV cache tensor {tensor.shared_by}: size {tensor.size} is not a "
                f"positive multiple of num_blocks {config.num_blocks}; size tensors as "
                "bytes_per_page x num_blocks"
            )
        size = tensor.size // config.num_blocks * num_blocks
        tensors.append(dataclasses.replace(tensor, size=size))
    return dataclasses.replace(config, num_blocks=num_blocks, kv_cache_tensors=tensors)


def unify_kv_cache_configs(kv_cache_configs: list[KVCacheConfig]) -> list[KVCacheConfig]:
    """Give every worker the smallest `num_blocks`, shrinking its tensors to match.

    One scheduler hands out block ids for all workers, so all must hold the same number. A
    config with no tensors (a worker holding no layer) does not bind the minimum.

    Raises:
        ValueError: no configs, configs whose groups disagree, or a tensor whose size is not a
            multiple of its config's num_blocks.
    """
    if not kv_cache_configs:
        raise ValueError("unify_kv_cache_configs needs at least one KVCacheConfig, got none")
    _check_groups_agree(kv_cache_configs)
    binding = [c.num_blocks for c in kv_cache_configs if c.kv_cache_tensors]
    min_num_blocks = min(binding or [c.num_blocks for c in kv_cache_configs])
    return [_shrink(config, min_num_blocks) for config in kv_cache_configs]


def _validate_inputs(
    kv_cache_specs: list[dict[str, KVCacheSpec]], available_memory: list[int]
) -> None:
    if not kv_cache_specs or len(kv_cache_specs) != len(available_memory):
        raise ValueError(
            "get_kv_cache_configs needs one spec dict and one available_memory entry per "
            f"worker, got {len(kv_cache_specs)} spec dicts and {len(available_memory)} "
            "memory entries"
        )


def get_kv_cache_configs(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> list[KVCacheConfig]:
    """One KV cache config per worker, all with the same `num_blocks` (steps in the module doc).

    Args:
        cache_config: `num_gpu_blocks_override` and the knobs named in errors.
        scheduler_config: `max_model_len` and `max_num_batched_tokens` size one request.
        kv_cache_specs: per worker, layer name -> spec (`Worker.get_kv_cache_spec`).
        available_memory: per worker, bytes free for the KV cache.

    Returns:
        Per worker, in order, its `KVCacheConfig` for `initialize_from_config`.

    Raises:
        ValueError: mismatched inputs, a layer with two specs, page sizes that cannot be made
            equal, or a worker that cannot hold one `max_model_len` request.
    """
    _validate_inputs(kv_cache_specs, available_memory)
    global_groups = get_kv_cache_groups(merge_kv_cache_specs(kv_cache_specs))
    groups_per_worker = [
        project_kv_cache_groups_to_worker(global_groups, worker_spec)
        for worker_spec in kv_cache_specs
    ]
    available_memory = _apply_num_gpu_blocks_override(
        cache_config, groups_per_worker, available_memory
    )
    hint = _knob_hint(cache_config, cache_config.num_gpu_blocks_override is not None)
    for rank, (groups, memory) in enumerate(zip(groups_per_worker, available_memory)):
        if has_layers(groups):
            memory_for_len = _memory_for_len_from_groups(scheduler_config, groups)
            where = f"rank {rank}: " if len(kv_cache_specs) > 1 else ""
            _raise_if_not_enough(
                memory, memory_for_len, scheduler_config.max_model_len, hint, where
            )
    configs = [
        get_kv_cache_config_from_groups(groups, memory)
        for groups, memory in zip(groups_per_worker, available_memory)
    ]
    return unify_kv_cache_configs(configs)


def _num_blocks_per_request(scheduler_config: SchedulerConfig, config: KVCacheConfig) -> int:
    tokens = scheduler_config.max_num_batched_tokens
    return sum(
        cdiv(
            group.kv_cache_spec.max_memory_usage_bytes(scheduler_config.max_model_len, tokens),
            group.kv_cache_spec.page_size_bytes,
        )
        for group in config.kv_cache_groups
    )


def get_max_concurrency_for_kv_cache_config(
    scheduler_config: SchedulerConfig, kv_cache_config: KVCacheConfig
) -> float:
    """How many `max_model_len`-token requests fit at once: num_blocks over the blocks one such
    request needs summed over all groups. Infinite for an attention-free model.
    """
    if not kv_cache_config.kv_cache_groups:
        return math.inf
    return kv_cache_config.num_blocks / _num_blocks_per_request(scheduler_config, kv_cache_config)


def get_kv_cache_capacity(
    scheduler_config: SchedulerConfig, kv_cache_config: KVCacheConfig
) -> tuple[int, float]:
    """(KV cache size in tokens, maximum concurrency), the two numbers the core logs.

    The size is max concurrency x max_model_len: the tokens of context the cache holds when
    full, which stays right for sliding-window groups whose blocks cap at the window. An
    attention-free model gives (0, inf).
    """
    max_concurrency = get_max_concurrency_for_kv_cache_config(scheduler_config, kv_cache_config)
    if math.isinf(max_concurrency):
        return 0, max_concurrency
    return int(max_concurrency * scheduler_config.max_model_len), max_concurrency
