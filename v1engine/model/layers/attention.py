"""The attention layer: writes new K/V into the paged cache, then attends over it.

The worker binds `kv_cache` after it has sized and allocated the caches; until then (and when a
forward runs without metadata, e.g. the profiling run) the layer attends over the new tokens only.
The backend is chosen per device: the Triton kernels on CUDA when triton imports, the torch
implementation otherwise; both take the same arguments.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from v1engine.logger import init_logger
from v1engine.model.forward_context import get_forward_context
from v1engine.model.layers import attention_torch
from v1engine.model.layers.attention_metadata import AttentionMetadata

logger = init_logger(__name__)


@functools.cache
def get_attention_backend(device_type: str) -> ModuleType:
    """Module with `write_kv_cache` and `paged_attention` for tensors on `device_type`."""
    if device_type == "cuda":
        try:
            from v1engine.model.layers import triton_attention
        except ImportError as e:
            logger.warning("Triton attention unavailable (%s); using the torch backend", e)
        else:
            return triton_attention
    return attention_torch


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
        # (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_size].
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def _metadata(self) -> AttentionMetadata | None:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            return metadata[self.layer_name]
        return metadata

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [num_tokens, num_heads * head_size], key/value [num_tokens, num_kv_heads *
        head_size] -> [num_tokens, num_heads * head_size]."""
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        metadata = self._metadata()
        if self.kv_cache is None or metadata is None:
            query_start_loc = None if metadata is None else metadata.query_start_loc
            out = attention_torch.causal_attention(
                q, k, v, query_start_loc, self.scale, self.sliding_window
            )
            return out.view(num_tokens, -1)
        backend = get_attention_backend(q.device.type)
        key_cache, value_cache = self.kv_cache
        backend.write_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = backend.paged_attention(
            q, key_cache, value_cache, metadata, self.scale, self.sliding_window
        )
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
