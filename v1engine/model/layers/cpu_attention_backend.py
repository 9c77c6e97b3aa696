"""The CPU attention backend: every step through our C kernel (`cpu_paged_attention.c`).

The kernel reads each request's keys in place through the block table (no gather, no padding to
the longest request, no mask) and attends any mix of rows: decodes, prefills, chunks of a prefill
over a cached prefix. A decode step runs several times faster than the torch backend's gathered
SDPA, and prefills faster too (`scripts/bench_attention.py`, one layer on the 2-core AMD EPYC
bench machine, float32), up to a prompt length that depends on the passes
(`cpu_kernels.prefill_passes`) and is kept in `LONG_PREFILL_ATTENTIONS`:
- "blocked": on AVX-512 CPUs, head sizes 64 and 128, query heads sharing KV heads (GQA), the
  kernel runs a prompt's rows as small matrix products. SmolLM2's heads: 5.2 vs 11.6 ms for one
  prompt of 1024 tokens, 20.6 vs 40.4 at 2048, 78 vs 138 at 4096 (311 vs 482 at 8192); 32 heads
  of 128 over 8 KV heads: 38 vs 83 at 1024, 161 vs 256 at 2048, 752 vs 861 at 4096. Up to 4096.
- "blocked, partial": the same with one query head per KV head, 8 of a block's 12 vectors. 12
  heads of 64: 9.8 vs 15.8 ms at 1024, 38 vs 55 at 2048; 32 heads of 128: 61 vs 93 at 1024, 158
  vs 172 at 1536, 326 vs 282 at 2048. Up to 1024.
- "per-key" (other head sizes, CPUs without AVX-512): when these passes still took 32 heads of
  128 over 32 KV heads, 22 vs 36 ms at 512, level at 1024, 373 vs 273 at 2048. Up to 512.
- the blocked passes over heads of 256 (Gemma's): 4 heads over 1 KV head (Gemma 3 270M), 4.6
  vs 7.1 ms at 512, 18.6 vs 18.7 at 1024, 79 vs 63 at 2048: up to 1024; 8 heads over 8, 12.2 vs
  14.4 at 512, 55 vs 40 at 1024: up to 512.
A step with a request past the shortest limit also carries the torch backend's plan, through
which the layers whose limit it passes attend; past the longest the step is the torch
backend's. The torch backend also takes the steps over cache dtypes the kernel does not read
(float16), V heads of another size than K's, and slots of -1 among a step's real rows. Chosen by
default on CPU when the kernels build (`get_default_attention_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.attention_backend import CommonAttentionMetadata, KVCache
from v1engine.model.layers.cpu_kernel_library import KERNEL_DTYPES
from v1engine.model.layers.torch_attention import TorchAttentionBackend, TorchAttentionMetadata

# Row-key pairs in one request (query rows x keys) past which SDPA's blocked GEMMs may beat the
# kernel, by the passes it runs a prompt's rows through (`cpu_kernels.prefill_passes`; the module
# docstring has the measurements): a prompt from scratch of 512, 1024 or 4096 tokens.
LONG_PREFILL_ATTENTIONS = {
    "per-key": 512 * 512,
    "blocked, partial": 1024 * 1024,
    "blocked": 4096 * 4096,
    "blocked, partial, heads of 256": 512 * 512,
    "blocked, heads of 256": 1024 * 1024,
}
_SHORTEST, _LONGEST = min(LONG_PREFILL_ATTENTIONS.values()), max(LONG_PREFILL_ATTENTIONS.values())


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
    # The most row-key pairs of one request, and past the shortest LONG_PREFILL_ATTENTIONS the
    # torch backend's plan, through which the layers `kernel_attends` refuses attend (the cache is
    # written alike).
    longest_prefill: int = 0
    long_prefill: TorchAttentionMetadata | None = None
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
            longest = _longest_prefill_attentions(common)
            if longest > _LONGEST:
                return self._torch.build_metadata(common, kv_cache_spec)
            num_rows = int(common.query_start_loc[-1])
            slots = common.slot_mapping[:num_rows].to(torch.int64).contiguous()
            if bool((slots >= 0).all()):
                decodes = common.max_query_len == 1 and num_rows == common.num_reqs
                starts = None if decodes else common.query_start_loc.to(torch.int32).contiguous()
                long_prefill = None
                if longest > _SHORTEST:
                    long_prefill = self._torch.build_metadata(common, kv_cache_spec)
                return CpuAttentionMetadata(
                    slots,
                    common.block_table[: common.num_reqs].to(torch.int32).contiguous(),
                    common.seq_lens.to(torch.int32).contiguous(),
                    starts,
                    num_rows,
                    longest,
                    long_prefill,
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
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        window_and_cap = (sliding_window, logits_soft_cap)
        if isinstance(metadata, TorchAttentionMetadata):
            return self._torch.forward(query, kv_cache, metadata, scale, *window_and_cap)
        long_prefill = metadata.long_prefill
        if long_prefill is not None:  # only then can the heads send the layer to SDPA
            _, num_heads, head_size = query.shape
            heads = (num_heads, kv_cache[0].shape[2], head_size)
            if not kernel_attends(metadata.longest_prefill, *heads):
                return self._torch.forward(query, kv_cache, long_prefill, scale, *window_and_cap)
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
            soft_cap=logits_soft_cap,
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


def kernel_attends(row_key_pairs: int, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
    """Whether the kernel (else SDPA) attends a step whose longest request has this many row-key
    pairs, for these heads."""
    if row_key_pairs <= _SHORTEST:
        return True
    passes = cpu_kernels.prefill_passes(num_heads, num_kv_heads, head_size)
    return row_key_pairs <= LONG_PREFILL_ATTENTIONS[passes]


def _kernel_reads(kv_cache_spec: AttentionSpec) -> bool:
    """Whether the kernel can attend over this group's cache (on this CPU)."""
    return (
        kv_cache_spec.dtype in KERNEL_DTYPES
        and kv_cache_spec.head_size_v == kv_cache_spec.head_size
        and cpu_kernels.available()
    )
