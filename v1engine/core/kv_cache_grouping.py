"""KV cache groups (layers that share one block table) and how one worker lays them out.

The scheduler allocates blocks per group, from one pool of block ids shared by all groups, so
every group's block must cost the same bytes. Three shapes of model, decided once for the whole
model (the union of every worker's layers):

- all layers have equal specs (most models): one group;
- one attention type, different page sizes (e.g. head sizes differ): one group whose spec is a
  `UniformTypeKVCacheSpecs`; a block is one page in each layer's own tensor;
- hybrid (full + sliding window): page sizes are made equal by growing the smaller layers'
  `block_size`, then layers are split into groups of `group_size` layers with equal specs.
  Tensor `i` is then shared by the `i`-th layer of every group.

`get_kv_cache_config_from_groups` turns one worker's share of the groups and its bytes into its
blocks and tensors; `kv_cache_utils` runs the whole handshake step.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from v1engine.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheSpecMismatchError,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
)
from v1engine.logger import init_logger
from v1engine.utils import cdiv

logger = init_logger(__name__)

# Bucket sizes closer than this ratio use the larger one as the group size, so that e.g.
# 13 full + 12 sliding layers (a drafter adding one layer) pad to two groups of 13, not
# 1 + 2 groups of 12 with 11 padding slots.
_PAD_TO_LARGEST_RATIO = 1.5


class KVCachePageSizeError(ValueError, NotImplementedError):
    """Layer page sizes cannot be made equal by growing block sizes.

    A ValueError by our error rules; also a NotImplementedError, which is what vLLM raises here.
    """


def merge_kv_cache_specs(kv_cache_specs: list[dict[str, KVCacheSpec]]) -> dict[str, KVCacheSpec]:
    """The whole model's layer -> spec map, from each worker's map.

    Workers may hold different layers (pipeline stages), but a layer held by two workers
    (tensor-parallel ranks) must have the same spec on both.

    Raises:
        KVCacheSpecMismatchError: a layer's spec differs between two workers.
    """
    merged: dict[str, KVCacheSpec] = {}
    first_rank: dict[str, int] = {}
    for rank, worker_specs in enumerate(kv_cache_specs):
        for layer_name, spec in worker_specs.items():
            if layer_name not in merged:
                merged[layer_name] = spec
                first_rank[layer_name] = rank
            elif merged[layer_name] != spec:
                raise KVCacheSpecMismatchError(
                    f"layer {layer_name!r} has KV cache spec {merged[layer_name]!r} on rank "
                    f"{first_rank[layer_name]} but {spec!r} on rank {rank}; every worker must "
                    "build the layer with the same config (dtype, block_size, heads per rank)"
                )
    return merged


def is_kv_cache_spec_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """Whether all layers have equal specs (an attention-free model counts as uniform)."""
    specs = list(kv_cache_spec.values())
    return all(spec == specs[0] for spec in specs)


def unify_kv_cache_spec_page_size(kv_cache_spec: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """A copy where every layer has the largest page size, by multiplying smaller block sizes.

    Raises:
        KVCachePageSizeError: some page size does not divide the largest one.
    """
    if not kv_cache_spec:
        return {}
    largest_name, largest = max(kv_cache_spec.items(), key=lambda item: item[1].page_size_bytes)
    max_page_size = largest.page_size_bytes
    unified: dict[str, KVCacheSpec] = {}
    for layer_name, spec in kv_cache_spec.items():
        page_size = spec.page_size_bytes
        if max_page_size % page_size != 0:
            raise KVCachePageSizeError(
                f"hybrid KV cache layout needs one page size for all layers, but layer "
                f"{layer_name!r} has page_size_bytes={page_size}, which does not divide the "
                f"largest, {max_page_size} (layer {largest_name!r}). No setting fixes this "
                "(block_size and cache dtype scale every page alike): this mix of layer shapes "
                "is not supported, only page sizes that divide the largest one are"
            )
        ratio = max_page_size // page_size
        if ratio > 1:
            spec = dataclasses.replace(spec, block_size=spec.block_size * ratio)
        unified[layer_name] = spec
    return unified


def _pick_group_size(bucket_sizes: list[int]) -> int:
    # Hybrid models repeat an n:1 pattern (e.g. 5 sliding : 1 full), so the smallest bucket is
    # the natural group size; near-equal buckets use the largest to pad less.
    smallest, largest = min(bucket_sizes), max(bucket_sizes)
    return largest if largest < smallest * _PAD_TO_LARGEST_RATIO else smallest


def _get_kv_cache_groups_hybrid(kv_cache_spec: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Groups of `group_size` layers with equal specs; page sizes must already be equal."""
    buckets: dict[KVCacheSpec, list[str]] = defaultdict(list)
    for layer_name, spec in kv_cache_spec.items():
        buckets[spec].append(layer_name)
    group_size = _pick_group_size([len(layers) for layers in buckets.values()])
    groups: list[KVCacheGroupSpec] = []
    for spec, layers in buckets.items():
        num_groups = cdiv(len(layers), group_size)
        num_padding = num_groups * group_size - len(layers)
        if num_padding:
            logger.warning(
                "Add %d padding layers, may waste at most %.2f%% KV cache memory",
                num_padding,
                num_padding / len(layers) * 100,
            )
        # Strided, not contiguous: with pipeline stages holding consecutive layers, each stage
        # then gets an equal share of every group instead of whole groups and empty ones.
        for i in range(num_groups):
            groups.append(KVCacheGroupSpec(layers[i::num_groups], spec))
    return groups


def get_kv_cache_groups(kv_cache_spec: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Split the whole model's layers into KV cache groups (none for an attention-free model).

    Raises:
        KVCachePageSizeError: a hybrid model whose page sizes cannot be made equal.
    """
    if not kv_cache_spec:
        return []
    layer_names = list(kv_cache_spec)
    if is_kv_cache_spec_uniform(kv_cache_spec):
        specs = list(kv_cache_spec.values())
        return [KVCacheGroupSpec(layer_names, type(specs[0]).merge(specs))]
    uniform_type = UniformTypeKVCacheSpecs.from_specs(kv_cache_spec)
    if uniform_type is not None:
        return [KVCacheGroupSpec(layer_names, uniform_type)]
    return _get_kv_cache_groups_hybrid(unify_kv_cache_spec_page_size(kv_cache_spec))


def project_kv_cache_groups_to_worker(
    global_groups: list[KVCacheGroupSpec], worker_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """The model's groups, same order, each filtered to the layers this worker holds.

    A group may come out empty; it keeps its spec so every worker agrees on the group list.
    """
    projected: list[KVCacheGroupSpec] = []
    for group in global_groups:
        names = [name for name in group.layer_names if name in worker_spec]
        spec = group.kv_cache_spec
        if names and isinstance(spec, UniformTypeKVCacheSpecs):
            # A uniform-type block spans only the pages of the layers this worker holds.
            own_specs = {name: spec.kv_cache_specs[name] for name in names}
            spec = UniformTypeKVCacheSpecs(block_size=spec.block_size, kv_cache_specs=own_specs)
        projected.append(KVCacheGroupSpec(names, spec))
    return projected


def _is_uniform_type_layout(groups: list[KVCacheGroupSpec]) -> bool:
    """Whether the groups are the one-group, per-layer-page layout of `UniformTypeKVCacheSpecs`."""
    return len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)


def has_layers(groups: list[KVCacheGroupSpec]) -> bool:
    """False for an attention-free model and for a worker that holds none of the layers."""
    return any(group.layer_names for group in groups)


def _uniform_page_size(groups: list[KVCacheGroupSpec]) -> int:
    """The page size all groups share outside the uniform-type layout (grouping ensures it)."""
    page_sizes = {group.kv_cache_spec.page_size_bytes for group in groups}
    assert len(page_sizes) == 1, f"grouping left several page sizes: {page_sizes}"
    return page_sizes.pop()


def bytes_per_block(groups: list[KVCacheGroupSpec]) -> int:
    """Bytes one block id costs on this worker, over all its tensors."""
    if _is_uniform_type_layout(groups):
        return groups[0].kv_cache_spec.page_size_bytes
    group_size = max(len(group.layer_names) for group in groups)
    return _uniform_page_size(groups) * group_size


def _kv_cache_tensors(groups: list[KVCacheGroupSpec], num_blocks: int) -> list[KVCacheTensor]:
    if _is_uniform_type_layout(groups):
        # One tensor per layer, each block one page of that layer.
        layer_specs = groups[0].kv_cache_spec.kv_cache_specs
        return [
            KVCacheTensor(size=spec.page_size_bytes * num_blocks, shared_by=[name])
            for name, spec in layer_specs.items()
        ]
    # Tensor i is shared by the i-th layer of every group (see the module doc).
    group_size = max(len(group.layer_names) for group in groups)
    return [
        KVCacheTensor(
            size=_uniform_page_size(groups) * num_blocks,
            shared_by=[group.layer_names[i] for group in groups if i < len(group.layer_names)],
        )
        for i in range(group_size)
    ]


def get_kv_cache_config_from_groups(
    groups: list[KVCacheGroupSpec], available_memory: int
) -> KVCacheConfig:
    """One worker's config, before unification, from its projected groups."""
    if not has_layers(groups):
        # No tensors: the worker's num_blocks binds nothing (see unify). The scheduler's block
        # pool always keeps one null block, hence 1 for an attention-free model.
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups)
    num_blocks = max(available_memory, 0) // bytes_per_block(groups)
    return KVCacheConfig(num_blocks, _kv_cache_tensors(groups, num_blocks), groups)
