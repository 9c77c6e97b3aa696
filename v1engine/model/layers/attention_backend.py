"""The attention-backend seam: what every backend reads, the protocol it implements, the registry,
and the forward context that carries a step's backend and metadata to the layers.

The model runner picks one backend per process (`get_default_attention_backend`) and asks it
once per step and KV cache group to turn the group's `CommonAttentionMetadata` into its own
metadata (the torch backend plans its gathers there); every layer of the group then writes K/V
and attends with that metadata. Under CUDA graphs (`worker/cuda_graphs.py`) `build_metadata` runs
once per captured size, on static buffers, so a backend used there must build its metadata with
device work alone (no host reads of the tensors).

The batch contract: a step's tokens are flattened; request r owns query rows
`query_start_loc[r] : query_start_loc[r + 1]`, which are its *last* `query_len_r` tokens, so a
query row i of request r sits at position `seq_lens[r] - query_len_r + i`. Prefill (with or
without a cached prefix), chunked prefill and decode (query_len 1) mix freely in one batch.
Paged KV: a slot is `block_id * block_size + offset_in_block`. `block_table[r, j]` is the block
holding positions `j * block_size ... (j + 1) * block_size - 1` of request r. Key position k is
visible to a query at position p iff `k <= p` and, with a sliding window W, `p - k < W`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.logger import init_logger
from v1engine.model.layers import cpu_kernels

logger = init_logger(__name__)

# (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_size].
KVCache = tuple[torch.Tensor, torch.Tensor]
MetadataT = TypeVar("MetadataT")


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """One KV cache group's view of the step, the input to every backend's `build_metadata`."""

    # [num_tokens] int64: where each new token's K/V is written; -1 marks padding (skip).
    slot_mapping: torch.Tensor
    # [num_reqs + 1] int32: prefix sums of the query lengths.
    query_start_loc: torch.Tensor
    # [num_reqs] int32: tokens in the KV cache after this step (cached prefix + new tokens).
    seq_lens: torch.Tensor
    # [num_reqs, max_num_blocks_per_req] int32: block ids; unused entries may hold anything.
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


class AttentionBackend(Protocol[MetadataT]):
    """Paged attention for one device kind. Backends hold no per-step state: everything a step
    needs lives in the metadata `build_metadata` returns, which every layer of the group reads."""

    name: str
    # Whether a CUDA graph may capture this backend: `build_metadata` and `forward` on device
    # work alone, with launches that depend on shapes and `max_seq_len` only.
    supports_cuda_graphs: bool

    def build_metadata(
        self, common: CommonAttentionMetadata, kv_cache_spec: AttentionSpec
    ) -> MetadataT:
        """This step's metadata for one KV cache group, built once before the forward.

        Args:
            common: the group's slot mapping, block table and the step's request layout.
            kv_cache_spec: the group's layers' cache (block size, KV heads, sliding window).

        Returns:
            What `write_kv_cache` and `forward` read for every layer of the group.
        """
        ...

    def write_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, metadata: MetadataT
    ) -> None:
        """Stores each new token's K/V ([num_tokens, num_kv_heads, head_size]) at its slot,
        skipping padding slots (-1); the cache is written in place."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: MetadataT,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Attention of every new token over its request's cached keys (new tokens included).

        Args:
            query: [num_tokens, num_heads, head_size].
            kv_cache: the layer's cache, already holding this step's K/V.
            metadata: from `build_metadata` for the layer's group.
            scale: softmax scale.
            sliding_window: the layer's window (the group spec's), None for full attention.
            logits_soft_cap: each score s becomes cap * tanh(s / cap) before the softmax
                (Gemma 2's layers); None: scores as they are.

        Returns:
            [num_tokens, num_heads, head_size]; rows past `query_start_loc[-1]` are zeros.
        """
        ...


# Name -> class path, imported on first use: triton must stay optional on CPU-only machines.
_BACKENDS = {
    "torch": "v1engine.model.layers.torch_attention.TorchAttentionBackend",
    "cpu": "v1engine.model.layers.cpu_attention_backend.CpuAttentionBackend",
    "triton": "v1engine.model.layers.triton_attention_backend.TritonAttentionBackend",
}


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend of the registered `name`.

    Raises:
        ValueError: `name` is not registered.
        ImportError: the backend's dependencies (e.g. triton) do not import here.
    """
    path = _BACKENDS.get(name)
    if path is None:
        raise ValueError(
            f"unknown attention backend {name!r}; registered backends: {sorted(_BACKENDS)}"
        )
    module_name, class_name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)()


def get_default_attention_backend(device_type: str) -> AttentionBackend:
    """Triton's kernels on CUDA when triton imports; on CPU our compiled attention kernel when it
    builds (`cpu_kernels`); the torch backend otherwise."""
    if device_type == "cuda":
        try:
            return get_attention_backend("triton")
        except ImportError as e:
            logger.warning("Triton attention unavailable (%s); using the torch backend", e)
    if device_type == "cpu" and cpu_kernels.available():  # builds them on first use
        return get_attention_backend("cpu")
    return get_attention_backend("torch")


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
    # This step's token -> LoRA slot mapping (lora/layers.py); None: no token runs an adapter.
    lora: Any = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextmanager
def set_forward_context(
    query_start_loc: torch.Tensor | None,
    attn_backend: AttentionBackend | None = None,
    attn_metadata: list[Any] | None = None,
    lora: Any = None,
) -> Iterator[ForwardContext]:
    if attn_metadata is not None and attn_backend is None:
        raise ValueError("attn_metadata needs the attn_backend that built it, got None")
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(query_start_loc, attn_backend, attn_metadata, lora)
    try:
        yield _forward_context
    finally:
        _forward_context = previous
