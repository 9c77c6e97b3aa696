"""The CPU attention backend: decodes through our C kernel, prefills through the torch backend.

Every decode row (one request's one new token) is attended by `cpu_decode_attention.c`, which
reads the request's keys in place through the block table: no gather, no padding to the group's
longest request, no mask. At batch 1 and a few hundred keys it is several times faster than the
torch backend's gathered SDPA (`scripts/profile_steps.py`, "attention"). A step of decodes only
(steady decoding) is all kernel; a step with prefills in it attends them with the torch
backend's plan (built without its decode groups) and its decode rows with the kernel. Cache dtypes
the kernel does not read (float16) and V heads of another size than K's take the torch backend
for everything. Chosen by default on CPU when the kernels build (`get_default_attention_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.attention_backend import CommonAttentionMetadata, KVCache
from v1engine.model.layers.cpu_kernel_library import KERNEL_DTYPES
from v1engine.model.layers.torch_attention import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    build_step_plan,
    written_slots,
)


@dataclass(frozen=True)
class CpuDecodeMetadata:
    """Decodes for the kernel: entry i is the i-th decode's (a step of decodes only: row i)."""

    slot_mapping: torch.Tensor  # [num_decodes] int64
    block_table: torch.Tensor  # [num_decodes, max_blocks_per_req] int32, contiguous
    seq_lens: torch.Tensor  # [num_decodes] int32, contiguous
    # No window here: the kernel takes the layer's at call time (no plan depends on it).


@dataclass(frozen=True)
class CpuMixedMetadata:
    """A step with prefills: the torch backend's plan for them, the kernel for the decode rows."""

    prefills: TorchAttentionMetadata  # writes every row's K/V; its plan has no decode groups
    decode_rows: torch.Tensor  # [num_decodes] int64, the query rows of the decodes
    decodes: CpuDecodeMetadata  # the decodes' own (their K/V are written with every row's)


CpuMetadata = CpuDecodeMetadata | CpuMixedMetadata | TorchAttentionMetadata


class CpuAttentionBackend:
    """The `AttentionBackend` for CPUs: our decode kernel, the torch backend for the rest."""

    name = "cpu"

    def __init__(self) -> None:
        self._torch = TorchAttentionBackend()

    def build_metadata(
        self, common: CommonAttentionMetadata, kv_cache_spec: AttentionSpec
    ) -> CpuMetadata:
        if not (_kernel_reads(kv_cache_spec) and common.block_table.device.type == "cpu"):
            return self._torch.build_metadata(common, kv_cache_spec)
        if common.max_query_len == 1 and common.num_tokens == common.num_reqs:
            if bool((common.slot_mapping >= 0).all()):  # decodes only: row r is request r's
                return CpuDecodeMetadata(
                    common.slot_mapping.to(torch.int64).contiguous(),
                    common.block_table[: common.num_reqs].to(torch.int32).contiguous(),
                    common.seq_lens.to(torch.int32).contiguous(),
                )
        plan = build_step_plan(common, kv_cache_spec, with_decodes=False)
        prefills = TorchAttentionMetadata(*written_slots(common.slot_mapping), plan)
        decodes = (common.query_start_loc.diff() == 1).nonzero().flatten()  # request indices
        if decodes.numel() == 0:
            return prefills
        rows = common.query_start_loc.index_select(0, decodes).to(torch.int64)
        return CpuMixedMetadata(
            prefills,
            rows,
            CpuDecodeMetadata(
                common.slot_mapping.index_select(0, rows),
                common.block_table.index_select(0, decodes).to(torch.int32).contiguous(),
                common.seq_lens.index_select(0, decodes).to(torch.int32).contiguous(),
            ),
        )

    def write_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, metadata: CpuMetadata
    ) -> None:
        if isinstance(metadata, CpuDecodeMetadata):
            cpu_kernels.write_kv(key, value, *kv_cache, metadata.slot_mapping)
        else:
            torch_metadata = (
                metadata.prefills if isinstance(metadata, CpuMixedMetadata) else metadata
            )
            self._torch.write_kv_cache(key, value, kv_cache, torch_metadata)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: CpuMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if isinstance(metadata, CpuDecodeMetadata):
            return _decode(query, kv_cache, metadata, scale, sliding_window)
        if isinstance(metadata, TorchAttentionMetadata):
            return self._torch.forward(query, kv_cache, metadata, scale, sliding_window)
        # The torch plan leaves the decode rows zero; the kernel fills them in.
        out = self._torch.forward(query, kv_cache, metadata.prefills, scale, sliding_window)
        rows = metadata.decode_rows
        decoded = _decode(
            query.index_select(0, rows), kv_cache, metadata.decodes, scale, sliding_window
        )
        return out.index_copy_(0, rows, decoded)


def _decode(
    query: torch.Tensor,
    kv_cache: KVCache,
    metadata: CpuDecodeMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """query [num_decodes, num_heads, head_size], row i request i of the metadata."""
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


def _kernel_reads(kv_cache_spec: AttentionSpec) -> bool:
    """Whether the kernel can attend over this group's cache (on this CPU)."""
    return (
        kv_cache_spec.dtype in KERNEL_DTYPES
        and kv_cache_spec.head_size_v == kv_cache_spec.head_size
        and cpu_kernels.available()
    )
