"""The CUDA `AttentionBackend`: the Triton kernels of `triton_attention.py`.

Importing this module imports triton, so the registry loads it only when asked for "triton".
The kernels read the common metadata as it is: tile counts and KV splits are chosen per layer
call from the query's shape, which the metadata alone does not give, and from `max_seq_len`
(max_model_len in a captured CUDA graph, so its splits cover any request a replay meets).
"""

from __future__ import annotations

import torch

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.model.layers import triton_attention
from v1engine.model.layers.attention_backend import CommonAttentionMetadata, KVCache


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True

    def build_metadata(
        self, common: CommonAttentionMetadata, kv_cache_spec: AttentionSpec
    ) -> CommonAttentionMetadata:
        return common

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: CommonAttentionMetadata,
    ) -> None:
        triton_attention.write_kv_cache(key, value, *kv_cache, metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: CommonAttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        return triton_attention.paged_attention(
            query, *kv_cache, metadata, scale, sliding_window, logits_soft_cap
        )
