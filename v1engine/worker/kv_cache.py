"""Allocates the KV cache tensors a `KVCacheConfig` describes and binds them to the layers.

Binding also tells each layer its KV cache group, whose entry of the step's per-group attention
metadata it reads; `kv_cache_group_specs` gives the spec each group's metadata is built for.

Each `KVCacheTensor` is one zero-filled byte buffer of `size` bytes (see `_zeroed_bytes` for why
zeros, and how the CPU gets them without a fill). Every layer in its
`shared_by` views the whole buffer as `[2, num_blocks, block_size, num_kv_heads, head_size]` of
its cache dtype: index 0 is the key cache, 1 the value cache, each
`[num_blocks, block_size, num_kv_heads, head_size]`. Layers sharing a buffer belong to different
KV cache groups, whose block ids never overlap, so they never touch the same bytes.
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

from v1engine.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from v1engine.model.hf_config import resolve_dtype
from v1engine.model.layers.attention import Attention
from v1engine.model.layers.attention_backend import KVCache
from v1engine.model.models.llama import get_head_size, get_sliding_window


def _attention_spec(spec: KVCacheSpec, name: str) -> AttentionSpec:
    if not isinstance(spec, AttentionSpec):
        raise ValueError(
            f"layer {name!r} has KV cache spec {spec!r}; the worker allocates attention caches "
            "(FullAttentionSpec, SlidingWindowSpec) only"
        )
    return spec


def layer_kv_cache_specs(kv_cache_config: KVCacheConfig) -> dict[str, AttentionSpec]:
    """Layer name -> the attention spec its cache follows (a group's spec, or the layer's own
    entry in a uniform-type group, whose layers differ in page size)."""
    specs: dict[str, AttentionSpec] = {}
    for group in kv_cache_config.kv_cache_groups:
        group_spec: KVCacheSpec = group.kv_cache_spec
        for name in group.layer_names:
            spec = group_spec
            if isinstance(group_spec, UniformTypeKVCacheSpecs):
                spec = group_spec.kv_cache_specs[name]
            specs[name] = _attention_spec(spec, name)
    return specs


def kv_cache_group_specs(kv_cache_config: KVCacheConfig) -> list[AttentionSpec]:
    """Per KV cache group, the spec its attention metadata is built for. A uniform-type group's
    layers share block size and window but not page size: its largest layer stands for it (the
    torch backend bounds its gathers by that layer's bytes per token)."""
    specs = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = max(spec.kv_cache_specs.values(), key=lambda s: s.page_size_bytes)
        specs.append(_attention_spec(spec, f"group {len(specs)}"))
    return specs


def _view_layer(buffer: torch.Tensor, spec: AttentionSpec, num_blocks: int, name: str) -> KVCache:
    if spec.head_size_v != spec.head_size:
        raise ValueError(
            f"layer {name!r}: head_size_v={spec.head_size_v} differs from head_size="
            f"{spec.head_size}, which the [2, ...] K/V layout cannot hold"
        )
    if spec.page_size_bytes * num_blocks != buffer.numel():
        raise ValueError(
            f"layer {name!r}: KV cache tensor has {buffer.numel()} bytes but num_blocks="
            f"{num_blocks} pages of {spec.page_size_bytes} bytes need "
            f"{spec.page_size_bytes * num_blocks}; build the config with get_kv_cache_configs"
        )
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    kv = buffer.view(spec.dtype).view(shape)
    return kv[0], kv[1]


def _zeroed_bytes(size: int, device: torch.device) -> torch.Tensor:
    """`size` zero bytes. Zeros, not garbage: decode attends over whole blocks and masks the
    slots past a sequence's end, and a masked NaN still poisons SDPA's product with V (0 x NaN).
    Once written, a slot only ever holds finite K/V, so zeros are needed at allocation only.

    On the CPU the buffer is an anonymous mapping: the kernel hands out zero pages on first
    touch, so gigabytes cost nothing at start-up (a fill took ~1 s per GiB) and pages are
    committed as blocks come into use. On a GPU, filling is fast and the allocator's memory may
    hold anything."""
    if device.type != "cpu":
        return torch.zeros(size, dtype=torch.int8, device=device)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.int8)  # keeps the mapping alive


def allocate_kv_caches(kv_cache_config: KVCacheConfig, device: torch.device) -> dict[str, KVCache]:
    """Zero-filled caches for every layer of the config: layer name -> (key, value).

    Raises:
        ValueError: a tensor's size does not match its layers' pages, or a layer of a group has
            no tensor.
    """
    specs = layer_kv_cache_specs(kv_cache_config)
    caches: dict[str, KVCache] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        buffer = _zeroed_bytes(tensor.size, device)
        for name in tensor.shared_by:
            caches[name] = _view_layer(buffer, specs[name], kv_cache_config.num_blocks, name)
    missing = sorted(set(specs) - set(caches))
    if missing:
        raise ValueError(
            f"KV cache config has no tensor for layer(s) {missing}; every layer of a KV cache "
            "group needs one (build the config with get_kv_cache_configs)"
        )
    return caches


def bind_kv_caches(
    layers: dict[str, Attention], caches: dict[str, KVCache], kv_cache_config: KVCacheConfig
) -> None:
    """Sets every attention layer's `kv_cache` (from `allocate_kv_caches(kv_cache_config)`) and
    `kv_cache_group_index`.

    Raises:
        RuntimeError: a layer of the model has no cache, which would silently make it attend
            over the new tokens only.
    """
    missing = sorted(set(layers) - set(caches))
    if missing:
        raise RuntimeError(
            f"the KV cache config covers no cache for attention layer(s) {missing}; it must "
            "come from this model's get_kv_cache_spec"
        )
    groups = kv_cache_config.kv_cache_groups
    group_index = {name: index for index, group in enumerate(groups) for name in group.layer_names}
    for name, layer in layers.items():
        layer.kv_cache = caches[name]
        layer.kv_cache_group_index = group_index[name]


def unbind_kv_caches(layers: dict[str, Attention]) -> None:
    for layer in layers.values():
        layer.kv_cache = None
        layer.kv_cache_group_index = None


def kv_cache_spec_from_config(config: Any) -> dict[str, KVCacheSpec]:
    """One rank's layer name -> KVCacheSpec as the built-in Worker reports it, from the model's
    config alone (no weights): each layer's `Attention` with this rank's heads (KV heads split
    over the ranks, or replicated when there are fewer than ranks, as QKVParallelLinear does),
    the model's head size and sliding windows, and the cache dtype."""
    hf_config = config.model_config.hf_config
    tp_size = config.parallel_config.world_size
    num_heads = hf_config.num_attention_heads // tp_size
    total_num_kv_heads = (
        getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    )
    num_kv_heads = max(1, total_num_kv_heads // tp_size)
    head_size = get_head_size(hf_config)
    cache_dtype = config.cache_config.cache_dtype
    dtype = resolve_dtype(hf_config, config.model_config.dtype, config.device_config.device_type)
    kv_cache_dtype = dtype if cache_dtype == "auto" else getattr(torch, cache_dtype)
    specs: dict[str, KVCacheSpec] = {}
    for i in range(hf_config.num_hidden_layers):
        name = f"model.layers.{i}.self_attn.attn"
        window = get_sliding_window(hf_config, i)
        layer = Attention(num_heads, head_size, head_size**-0.5, num_kv_heads, name, window)
        specs[name] = layer.get_kv_cache_spec(config.cache_config.block_size, kv_cache_dtype)
    return specs
