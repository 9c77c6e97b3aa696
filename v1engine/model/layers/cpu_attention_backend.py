"""The CPU attention backend: decode steps through our C kernel, everything else through the torch
backend.

A step whose every row is one request's one new token (every step of a steady decode) is attended
by `cpu_decode_attention.c`, which reads each request's keys in place through the block table: no
gather, no padding to the group's longest request, no mask. At batch 1 and a few hundred keys it
is several times faster than the torch backend's gathered SDPA (`scripts/profile_steps.py`,
"attention"). Steps with a prefill, cache dtypes the kernel does not read (float16) and V heads of
another size than K's take the torch backend's plan unchanged. Chosen by default on CPU when the
kernels build (`get_default_attention_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.attention_backend import CommonAttentionMetadata, KVCache
from v1engine.model.layers.cpu_kernel_library import KERNEL_DTYPES
from v1engine.model.layers.torch_attention import TorchAttentionBackend, TorchAttentionMetadata


@dataclass(frozen=True)
class CpuDecodeMetadata:
    """A step of decodes only: row r is request r's one new token."""

    slot_mapping: torch.Tensor  # [num_reqs] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, contiguous
    seq_lens: torch.Tensor  # [num_reqs] int32, contiguous
    # No window here: the kernel takes the layer's at call time (no plan depends on it).


class CpuAttentionBackend:
    """The `AttentionBackend` for CPUs: our decode kernel, the torch backend for the rest."""

    name = "cpu"

    def __init__(self) -> None:
        self._torch = TorchAttentionBackend()

    def build_metadata(
        self, common: CommonAttentionMetadata, kv_cache_spec: AttentionSpec
    ) -> CpuDecodeMetadata | TorchAttentionMetadata:
        if not _kernel_applies(common, kv_cache_spec):
            return self._torch.build_metadata(common, kv_cache_spec)
        return CpuDecodeMetadata(
            common.slot_mapping.to(torch.int64).contiguous(),
            common.block_table[: common.num_reqs].to(torch.int32).contiguous(),
            common.seq_lens.to(torch.int32).contiguous(),
        )

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: CpuDecodeMetadata | TorchAttentionMetadata,
    ) -> None:
        if isinstance(metadata, CpuDecodeMetadata):
            cpu_kernels.write_kv(key, value, *kv_cache, metadata.slot_mapping)
        else:
            self._torch.write_kv_cache(key, value, kv_cache, metadata)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: CpuDecodeMetadata | TorchAttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if not isinstance(metadata, CpuDecodeMetadata):
            return self._torch.forward(query, kv_cache, metadata, scale, sliding_window)
        cache_dtype = kv_cache[0].dtype
        out = cpu_kernels.decode_attention(
            query.to(cache_dtype).contiguous(),
            *kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            scale,
            sliding_window,
        )
        return out.to(query.dtype)


def _kernel_applies(common: CommonAttentionMetadata, kv_cache_spec: AttentionSpec) -> bool:
    """Every row is a decode, in request order, with a slot, on a cache the kernel reads."""
    return (
        common.max_query_len == 1
        and common.num_tokens == common.num_reqs
        and bool((common.slot_mapping >= 0).all())
        and common.block_table.device.type == "cpu"
        and kv_cache_spec.dtype in KERNEL_DTYPES
        and kv_cache_spec.head_size_v == kv_cache_spec.head_size
        and cpu_kernels.available()
    )
