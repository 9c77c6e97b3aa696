"""The CPU attention backend: every step through our C kernel (`cpu_paged_attention.c`).

The kernel reads each request's keys in place through the block table (no gather, no padding to
the longest request, no mask) and attends any mix of rows: decodes, prefills, chunks of a prefill
over a cached prefix. A decode step runs several times faster than the torch backend's gathered
SDPA, and prefills faster up to several hundred tokens (`scripts/bench_attention.py`, one layer
on the 2-core AVX-512 bench machine; SmolLM2's heads: 4.5 vs 12.5 ms for 13 prompts of 144
tokens, 3.2 vs 4.9 for one of 512, 12.2 vs 14.0 for one of 1024, 51 vs 47 for one of 2048).
Each task's scores are its rows x heads x keys, so the kernel slows past L2 sooner with more
heads: for 32 heads of 128 over 8 KV heads, 27-30 vs 29-39 ms at 512 tokens but 115 vs 94 at
1024; over 32 KV heads (no blocked passes there) level at 512 (38-41 vs 34-41 ms, two runs) and
185 vs 105 at 1024. A step with a request past `LONG_PREFILL_ATTENTIONS` row-key pairs therefore
takes the torch backend. So
do cache dtypes the kernel does not read (float16), V heads of another size than K's, and slots
of -1 among a step's real rows. Chosen by default on CPU when the kernels build
(`get_default_attention_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.attention_backend import CommonAttentionMetadata, KVCache
from v1engine.model.layers.cpu_kernel_library import KERNEL_DTYPES
from v1engine.model.layers.torch_attention import TorchAttentionBackend, TorchAttentionMetadata

# Past this many row-key pairs in one request (query rows x keys), SDPA's blocked GEMMs may beat
# the kernel: a 512-token prompt from scratch. The kernel was faster there for every head shape
# measured; the crossover lies between 512 and 1024 tokens for 7B-sized heads and between 1024
# and 2048 for SmolLM2's (scripts/bench_attention.py --shape).
LONG_PREFILL_ATTENTIONS = 512 * 512


@dataclass(frozen=True)
class CpuAttentionMetadata:
    """One KV cache group's step for the kernel: request r's query rows are query_start_loc[r]
    .. query_start_loc[r + 1] - 1, or row r alone when query_start_loc is None (a step of
    decodes); the rows from num_rows on are padding."""

    slot_mapping: torch.Tensor  # [num_rows] int64, the real rows' slots
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, contiguous
    seq_lens: torch.Tensor  # [num_reqs] int32, contiguous
    query_start_loc: torch.Tensor | None  # [num_reqs + 1] int32, contiguous
    num_rows: int
    # No window here: the kernel takes the layer's at call time (no plan depends on it).

    @property
    def decodes_only(self) -> bool:
        return self.query_start_loc is None


CpuMetadata = CpuAttentionMetadata | TorchAttentionMetadata


class CpuAttentionBackend:
    """The `AttentionBackend` for CPUs: our kernel, the torch backend where it cannot read."""

    name = "cpu"
    supports_cuda_graphs = False

    def __init__(self) -> None:
        self._torch = TorchAttentionBackend()

    def build_metadata(
        self, common: CommonAttentionMetadata, kv_cache_spec: AttentionSpec
    ) -> CpuMetadata:
        if _kernel_reads(kv_cache_spec) and common.block_table.device.type == "cpu":
            if _longest_prefill_attentions(common) > LONG_PREFILL_ATTENTIONS:
                return self._torch.build_metadata(common, kv_cache_spec)
            num_rows = int(common.query_start_loc[-1])
            slots = common.slot_mapping[:num_rows].to(torch.int64).contiguous()
            if bool((slots >= 0).all()):
                decodes = common.max_query_len == 1 and num_rows == common.num_reqs
                starts = None if decodes else common.query_start_loc.to(torch.int32).contiguous()
                return CpuAttentionMetadata(
                    slots,
                    common.block_table[: common.num_reqs].to(torch.int32).contiguous(),
                    common.seq_lens.to(torch.int32).contiguous(),
                    starts,
                    num_rows,
                )
        return self._torch.build_metadata(common, kv_cache_spec)

    def write_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, metadata: CpuMetadata
    ) -> None:
        if isinstance(metadata, TorchAttentionMetadata):
            self._torch.write_kv_cache(key, value, kv_cache, metadata)
            return
        rows = metadata.num_rows
        cpu_kernels.write_kv(key[:rows], value[:rows], *kv_cache, metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: CpuMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if isinstance(metadata, TorchAttentionMetadata):
            return self._torch.forward(query, kv_cache, metadata, scale, sliding_window)
        rows = metadata.num_rows
        cache_dtype = kv_cache[0].dtype
        out = cpu_kernels.paged_attention(
            query[:rows].to(cache_dtype).contiguous(),
            *kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            scale,
            sliding_window,
            metadata.query_start_loc,
        ).to(query.dtype)
        if rows == query.shape[0]:
            return out
        padded = query.new_zeros(query.shape)  # padding rows come back as zeros, as torch's
        padded[:rows] = out
        return padded


def _longest_prefill_attentions(common: CommonAttentionMetadata) -> int:
    """The most row-key pairs of one request in the step (query rows x its keys, an upper bound
    on what causality lets it attend)."""
    if common.max_query_len == 1:
        return common.max_seq_len
    query_lens = common.query_start_loc.diff()
    return int((query_lens.to(torch.int64) * common.seq_lens).max())


def _kernel_reads(kv_cache_spec: AttentionSpec) -> bool:
    """Whether the kernel can attend over this group's cache (on this CPU)."""
    return (
        kv_cache_spec.dtype in KERNEL_DTYPES
        and kv_cache_spec.head_size_v == kv_cache_spec.head_size
        and cpu_kernels.available()
    )
