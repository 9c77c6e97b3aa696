"""KV cache specs for tests: one default layer shape (16-token blocks, 2 KV heads of 64, fp32),
any field overridable; and `get_kv_cache_configs` with small defaults."""

from __future__ import annotations

import torch

from v1engine.config import CacheConfig, SchedulerConfig
from v1engine.core.kv_cache_utils import get_kv_cache_configs
from v1engine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

_DEFAULTS = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
PAGE = 16 * 2 * 64 * 4 * 2  # bytes of one 16-token block of one default layer
CACHE = CacheConfig()
SCHED = SchedulerConfig(max_model_len=16)  # one block per full layer, two per sliding layer


def full(**overrides) -> FullAttentionSpec:
    return FullAttentionSpec(**{**_DEFAULTS, **overrides})


def sliding(sliding_window: int = 1, **overrides) -> SlidingWindowSpec:
    return SlidingWindowSpec(**{**_DEFAULTS, "sliding_window": sliding_window, **overrides})


def hybrid(num_full: int, num_sliding: int) -> dict:
    """`layer1..` full layers, then sliding ones, numbered on."""
    specs = {f"layer{i}": full() for i in range(1, num_full + 1)}
    specs.update({f"layer{i}": sliding() for i in range(num_full + 1, num_full + num_sliding + 1)})
    return specs


def qwen_layer() -> FullAttentionSpec:  # 0.5 MiB per token over 32 layers
    return FullAttentionSpec(block_size=16, num_kv_heads=32, head_size=128, dtype=torch.float16)


def configs(specs, memory, cache=CACHE, sched=SCHED) -> list[KVCacheConfig]:
    return get_kv_cache_configs(cache, sched, specs, memory)


def one(specs, memory, **kwargs) -> KVCacheConfig:
    """The config of a single worker holding `specs` with `memory` bytes."""
    return configs([specs], [memory], **kwargs)[0]
