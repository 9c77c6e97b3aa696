"""KV cache specs for tests: one default layer shape (16-token blocks, 2 KV heads of 64, fp32),
any field overridable."""

from __future__ import annotations

import torch

from v1engine.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

_DEFAULTS = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)


def full(**overrides) -> FullAttentionSpec:
    return FullAttentionSpec(**{**_DEFAULTS, **overrides})


def sliding(sliding_window: int = 1, **overrides) -> SlidingWindowSpec:
    return SlidingWindowSpec(**{**_DEFAULTS, "sliding_window": sliding_window, **overrides})
