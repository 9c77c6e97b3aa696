"""KV cache sizing: every worker's specs and spare bytes -> one `KVCacheConfig` per worker.

The steps of `get_kv_cache_configs`, the centre of the start-up handshake:
1. merge the workers' layer -> spec maps into the whole model's;
2. group the whole model's layers once (`kv_cache_grouping`);
3. give each worker every group, in the same order, filtered to its own layers;
4. `num_gpu_blocks_override` replaces each worker's bytes by override x bytes per block;
5. per worker, check that one `max_model_len` request fits, then size its blocks and tensors;
6. unify: every worker gets the smallest `num_blocks`, and its tensors shrink to match.
`check_enough_kv_cache_memory` and `estimate_max_model_len` run steps 1-4 and step 5's check for
a single worker, so what they say is what the engine does.

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
    merge_kv_cache_specs,
    project_kv_cache_groups_to_worker,
)
from v1engine.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
)
from v1engine.logger import init_logger
from v1engine.utils import GiB_bytes, cdiv

if TYPE_CHECKING:
    from v1engine.config import CacheConfig, SchedulerConfig

logger = init_logger(__name__)


def _validate_inputs(
    kv_cache_specs: list[dict[str, KVCacheSpec]], available_memory: list[int]
) -> None:
    if not kv_cache_specs or len(kv_cache_specs) != len(available_memory):
        raise ValueError(
            "get_kv_cache_configs needs one spec dict and one available_memory entry per "
            f"worker, got {len(kv_cache_specs)} spec dicts and {len(available_memory)} "
            "memory entries"
        )


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


def _plan_workers(
    cache_config: CacheConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> tuple[list[list[KVCacheGroupSpec]], list[int]]:
    """Steps 1-4 of the module doc: per worker, its share of the model's groups and the bytes
    its blocks are sized from."""
    _validate_inputs(kv_cache_specs, available_memory)
    global_groups = get_kv_cache_groups(merge_kv_cache_specs(kv_cache_specs))
    groups_per_worker = [
        project_kv_cache_groups_to_worker(global_groups, worker_spec)
        for worker_spec in kv_cache_specs
    ]
    memory = _apply_num_gpu_blocks_override(cache_config, groups_per_worker, available_memory)
    return groups_per_worker, memory


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB_bytes:.2f}"


def _knob_hint(cache_config: CacheConfig) -> str:
    if cache_config.num_gpu_blocks_override is not None:
        return f"increasing `num_gpu_blocks_override` (now {cache_config.num_gpu_blocks_override})"
    # kv_cache_memory_bytes, when set, replaces the utilization-based budget on the workers.
    memory_bytes = cache_config.kv_cache_memory_bytes
    return (
        f"increasing `gpu_memory_utilization` (now {cache_config.gpu_memory_utilization}) "
        f"or `kv_cache_memory_bytes` (now {'unset' if memory_bytes is None else memory_bytes})"
    )


def _num_blocks_per_request(
    groups: list[KVCacheGroupSpec], max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Block ids one request of `max_model_len` tokens takes: every group, an empty one
    included, draws its own blocks from the one pool, a block being one page of its spec."""
    return sum(
        cdiv(
            group.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
            group.kv_cache_spec.page_size_bytes,
        )
        for group in groups
    )


def _memory_for_len(
    scheduler_config: SchedulerConfig, groups: list[KVCacheGroupSpec]
) -> Callable[[int], int]:
    """Bytes one request of a given length needs on this worker (padding layers included), plus
    the block the block pool keeps back as its null block (as vLLM does since its PR #47272):
    without it a cache of exactly one request's blocks passes here and then never schedules it.
    """
    tokens = scheduler_config.max_num_batched_tokens
    block_bytes = bytes_per_block(groups)
    return lambda length: (_num_blocks_per_request(groups, length, tokens) + 1) * block_bytes


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


def _not_enough_memory_message(
    memory_for_len: Callable[[int], int], max_model_len: int, available_memory: int, hint: str
) -> str:
    needed_memory = memory_for_len(max_model_len)
    estimate = _search_max_model_len(memory_for_len, max_model_len, available_memory)
    estimate_msg = (
        f"Based on the available memory, the estimated maximum model length is {estimate}. "
        if estimate > 0
        else ""
    )
    return (
        f"To serve at least one request with the model's max seq len "
        f"(max_model_len={max_model_len}), {_gib(needed_memory)} GiB of KV cache is needed "
        f"({needed_memory} bytes), which is larger than the available KV cache memory: "
        f"{_gib(available_memory)} GiB ({available_memory} bytes). {estimate_msg}"
        f"Try {hint}, or decreasing `max_model_len`."
    )


def _check_worker(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    groups: list[KVCacheGroupSpec],
    available_memory: int,
    where: str = "",
) -> None:
    """The check of `check_enough_kv_cache_memory`, on one worker's share of the groups."""
    if not has_layers(groups):
        return
    hint = _knob_hint(cache_config)
    if available_memory <= 0:
        raise ValueError(
            f"{where}No available memory for the cache blocks "
            f"(available_memory={available_memory} bytes). Try {hint}."
        )
    memory_for_len = _memory_for_len(scheduler_config, groups)
    max_model_len = scheduler_config.max_model_len
    if memory_for_len(max_model_len) > available_memory:
        message = _not_enough_memory_message(memory_for_len, max_model_len, available_memory, hint)
        raise ValueError(where + message)


def check_enough_kv_cache_memory(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
) -> None:
    """Check that a worker holding `kv_cache_spec`'s layers fits one `max_model_len` request.

    It is the check `get_kv_cache_configs` runs on every worker, so the two cannot disagree:
    the layers are grouped as the engine groups them, every group takes its own blocks
    (padding layers included), one block is the block pool's null block, and a set
    `num_gpu_blocks_override` replaces `available_memory`. It raises exactly when, and with
    the message that, `get_kv_cache_configs(cache_config, scheduler_config, [kv_cache_spec],
    [available_memory])` does. (With layers split over workers, the engine checks each worker's
    share of the whole model's groups.) An attention-free model (no layers) always passes.

    Raises:
        ValueError: no memory at all, or too little; the message gives the bytes needed and
            available, the longest max_model_len that fits and the knobs to turn.
    """
    [groups], [memory] = _plan_workers(cache_config, [kv_cache_spec], [available_memory])
    _check_worker(cache_config, scheduler_config, groups, memory)


def estimate_max_model_len(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
) -> int:
    """The longest max_model_len in [1, scheduler_config.max_model_len] that
    `check_enough_kv_cache_memory` accepts with these arguments; 0 when even a one-token
    request does not fit, scheduler_config.max_model_len for an attention-free model.
    """
    [groups], [memory] = _plan_workers(cache_config, [kv_cache_spec], [available_memory])
    if not has_layers(groups):
        return scheduler_config.max_model_len
    memory_for_len = _memory_for_len(scheduler_config, groups)
    return _search_max_model_len(memory_for_len, scheduler_config.max_model_len, memory)


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
    groups_per_worker, memory = _plan_workers(cache_config, kv_cache_specs, available_memory)
    for rank, (groups, worker_memory) in enumerate(zip(groups_per_worker, memory)):
        where = f"rank {rank}: " if len(kv_cache_specs) > 1 else ""
        _check_worker(cache_config, scheduler_config, groups, worker_memory, where)
    configs = [
        get_kv_cache_config_from_groups(groups, worker_memory)
        for groups, worker_memory in zip(groups_per_worker, memory)
    ]
    return unify_kv_cache_configs(configs)


def get_max_concurrency_for_kv_cache_config(
    scheduler_config: SchedulerConfig, kv_cache_config: KVCacheConfig
) -> float:
    """How many `max_model_len`-token requests fit at once: num_blocks over the blocks one such
    request needs summed over all groups. Infinite for an attention-free model.
    """
    if not kv_cache_config.kv_cache_groups:
        return math.inf
    num_blocks_per_request = _num_blocks_per_request(
        kv_cache_config.kv_cache_groups,
        scheduler_config.max_model_len,
        scheduler_config.max_num_batched_tokens,
    )
    return kv_cache_config.num_blocks / num_blocks_per_request


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
