"""The attention layer: writes new K/V into the paged cache, then attends over it.

The worker binds `kv_cache` and `kv_cache_group_index` after it has sized and allocated the
caches; each step the forward context brings the backend and one metadata per KV cache group,
and the layer uses its group's. A forward without metadata (the profiling run, or a model run
without a KV cache) attends over the new tokens only.
"""

from __future__ import annotations

import torch
from torch import nn

from v1engine.kv_cache_interface import AttentionSpec, FullAttentionSpec, SlidingWindowSpec
from v1engine.model.layers.attention_backend import KVCache, get_forward_context
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
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{layer_name}: num_heads={num_heads} is not a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(
                f"{layer_name}: logits_soft_cap must be > 0 (or None: no cap), "
                f"got {logits_soft_cap}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.layer_name = layer_name
        self.sliding_window = sliding_window
        # Gemma 2's: each attention score s becomes cap * tanh(s / cap) before the softmax.
        self.logits_soft_cap = logits_soft_cap
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
                q,
                k,
                v,
                context.query_start_loc,
                self.scale,
                self.sliding_window,
                self.logits_soft_cap,
            )
            return out.view(num_tokens, -1)
        # The runner builds metadata only once every layer's cache is bound.
        assert self.kv_cache is not None and self.kv_cache_group_index is not None, self
        metadata = context.attn_metadata[self.kv_cache_group_index]
        backend = context.attn_backend
        backend.write_kv_cache(k, v, self.kv_cache, metadata)
        out = backend.forward(
            q, self.kv_cache, metadata, self.scale, self.sliding_window, self.logits_soft_cap
        )
        return out.view(num_tokens, -1)

    def extra_repr(self) -> str:
        return (
            f"layer_name={self.layer_name}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"sliding_window={self.sliding_window}, logits_soft_cap={self.logits_soft_cap}"
        )


def get_attention_layers(model: nn.Module) -> dict[str, Attention]:
    """Every `Attention` of `model`, keyed by its `layer_name` (the KV cache's key)."""
    return {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}
