"""The attention layer: writes new K/V into the paged cache, then attends over it.

The worker binds `kv_cache` and `kv_cache_group_index` after it has sized and allocated the
caches; each step the forward context brings the backend and one metadata per KV cache group,
and the layer uses its group's. A forward without metadata (the profiling run, or a model run
without a KV cache) attends over the new tokens only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from v1engine.kv_cache_interface import AttentionSpec, FullAttentionSpec, SlidingWindowSpec
from v1engine.model.layers.attention_backend import AttentionBackend, KVCache
from v1engine.model.layers.torch_attention import causal_attention


class Attention(nn.Module):
    """Attention of `num_heads` query heads over `num_kv_heads` KV heads (both per rank)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_name: str,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{layer_name}: num_heads={num_heads} is not a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.layer_name = layer_name
        self.sliding_window = sliding_window
        # Set together by the worker's bind_kv_caches.
        self.kv_cache: KVCache | None = None
        self.kv_cache_group_index: int | None = None

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> AttentionSpec:
        """The cache this layer needs (this rank's KV heads) in blocks of `block_size` tokens."""
        args = (block_size, self.num_kv_heads, self.head_size, dtype)
        if self.sliding_window is None:
            return FullAttentionSpec(*args)
        return SlidingWindowSpec(*args, sliding_window=self.sliding_window)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [num_tokens, num_heads * head_size], key/value [num_tokens, num_kv_heads *
        head_size] -> [num_tokens, num_heads * head_size]."""
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        context = get_forward_context()
        if context.attn_metadata is None:
            out = causal_attention(
                q, k, v, context.query_start_loc, self.scale, self.sliding_window
            )
            return out.view(num_tokens, -1)
        # The runner builds metadata only once every layer's cache is bound.
        assert self.kv_cache is not None and self.kv_cache_group_index is not None, self
        metadata = context.attn_metadata[self.kv_cache_group_index]
        backend = context.attn_backend
        backend.write_kv_cache(k, v, self.kv_cache, metadata)
        out = backend.forward(q, self.kv_cache, metadata, self.scale, self.sliding_window)
        return out.view(num_tokens, -1)

    def extra_repr(self) -> str:
        return (
            f"layer_name={self.layer_name}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"sliding_window={self.sliding_window}"
        )


def get_attention_layers(model: nn.Module) -> dict[str, Attention]:
    """Every `Attention` of `model`, keyed by its `layer_name` (the KV cache's key)."""
    return {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}


# -- the forward context ---------------------------------------------------------------------------
# The per-step context attention layers read, so the model's forward stays (input_ids, positions).
#
# The runner wraps each forward in `set_forward_context(...)`; every `Attention` layer reads it
# through `get_forward_context()` and takes entry `kv_cache_group_index` of `attn_metadata`. It is a
# module global because a process runs one forward at a time (a worker executes its steps in
# order, and the model is never re-entered), so no layer can see another step's context.
@dataclass(frozen=True)
class ForwardContext:
    # [num_reqs + 1] int32: where each request's new tokens start; None: one request.
    query_start_loc: torch.Tensor | None = None
    attn_backend: AttentionBackend | None = None
    # Per KV cache group, the backend's metadata for this step; None: no KV cache (profiling).
    attn_metadata: list[Any] | None = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextmanager
def set_forward_context(
    query_start_loc: torch.Tensor | None,
    attn_backend: AttentionBackend | None = None,
    attn_metadata: list[Any] | None = None,
) -> Iterator[ForwardContext]:
    if attn_metadata is not None and attn_backend is None:
        raise ValueError("attn_metadata needs the attn_backend that built it, got None")
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(query_start_loc, attn_backend, attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous
