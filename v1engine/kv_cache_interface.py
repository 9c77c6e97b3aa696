"""What a layer's KV cache looks like, and how the core tells every worker to lay it out.

Workers describe each attention layer with a frozen `KVCacheSpec` (`get_kv_cache_spec`); the core
turns those into one `KVCacheConfig` per worker (`core/kv_cache_utils.py`) and sends it back
(`initialize_from_config`). Everything here crosses process boundaries, so it is plain, picklable
dataclasses; specs are also hashable, because the grouping step buckets layers by spec.

Vocabulary: a *block* holds `block_size` tokens; a *page* is one block of one layer, K and V
together, `page_size_bytes` long. A request that is `max_model_len` tokens long needs
`max_memory_usage_bytes(...)` bytes of pages in one layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from v1engine.utils import cdiv

if TYPE_CHECKING:
    import torch

SpecT = TypeVar("SpecT", bound="KVCacheSpec")


class KVCacheSpecMismatchError(ValueError, AssertionError):
    """Specs that must be equal (one group, or one layer seen by two workers) are not.

    It is a ValueError by our error rules; it is also an AssertionError because vLLM reports this
    condition with `assert`, and callers ported from vLLM catch that.
    """


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class KVCacheSpec(ABC):
    """The KV cache one layer needs, as reported by a worker to the core.

    Contract (specs travel between processes and are bucketed by value):
    - frozen, hashable and picklable; two layers can share a block table only if their specs
      are equal;
    - `block_size` is in tokens and `page_size_bytes` is the bytes one block takes in this layer;
    - `type_id` names the token-slot bookkeeping: layers with equal `type_id` need the same number
      of blocks for any request, whatever their page sizes.
    """

    block_size: int

    @property
    @abstractmethod
    def page_size_bytes(self) -> int:
        """Returns:
        Bytes of one block (`block_size` tokens) of this layer, K and V included.
        """

    @property
    @abstractmethod
    def type_id(self) -> str:
        """Returns:
        A key equal for layers that need the same blocks per request (same attention kind,
        window and block size), independent of head counts, head sizes and dtype.
        """

    @abstractmethod
    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Bytes this layer needs to hold one request of `max_model_len` tokens.

        Args:
            max_model_len: the longest request, prompt plus output, in tokens.
            max_num_batched_tokens: the most tokens one scheduler step may compute; a sliding
                window layer must also hold the tokens of the chunk being prefilled.

        Returns:
            A whole number of pages, in bytes.
        """

    @classmethod
    def merge(cls: type[SpecT], specs: Sequence[KVCacheSpec]) -> SpecT:
        """Merge the specs of the layers of one group into the group's spec.

        Args:
            specs: one spec per layer of the group; all must be equal and of type `cls`.

        Returns:
            The common spec.

        Raises:
            ValueError: `specs` is empty.
            KVCacheSpecMismatchError: two specs differ or one is not a `cls`.
        """
        if not specs:
            raise ValueError(f"{cls.__name__}.merge needs at least one spec, got none")
        first = specs[0]
        for spec in specs:
            if not isinstance(spec, cls) or spec != first:
                raise KVCacheSpecMismatchError(
                    f"{cls.__name__}.merge: all layers of one KV cache group must have equal "
                    f"{cls.__name__} specs, but {spec!r} differs from {first!r}; put layers "
                    "with different specs in different groups"
                )
        return first  # type: ignore[return-value]


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """A paged K/V cache: per block, `block_size` tokens × `num_kv_heads` heads of K and of V.

    `head_size_v` (keyword only) is the V head size when it differs from K's; `None` means
    `head_size` and is replaced by it, so specs built either way compare equal.
    """

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _require_int("block_size", self.block_size, 1)
        _require_int("num_kv_heads", self.num_kv_heads, 1)
        _require_int("head_size", self.head_size, 1)
        _require_int("head_size_v", self.head_size_v, 0)
        # torch is imported here, not at the top: the engine core imports this module before it
        # starts its workers, and they should not wait for its second of imports.
        import torch

        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(
                f"dtype must be a torch.dtype such as torch.float16, got {self.dtype!r}"
            )

    @property
    def page_size_bytes(self) -> int:
        # K and V live in the same page: [block_size, num_kv_heads, head_size + head_size_v].
        head_bytes = self.head_size + self.head_size_v  # type: ignore[operator]
        return self.block_size * self.num_kv_heads * head_bytes * self.dtype.itemsize


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """A layer that attends to every earlier token: a request keeps all of its blocks."""

    @property
    def type_id(self) -> str:
        return f"full_attention_{self.block_size}"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer that attends to the last `sliding_window` tokens only (the current one included)."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_int("sliding_window", self.sliding_window, 1)

    @property
    def type_id(self) -> str:
        return f"sliding_window_{self.sliding_window}_{self.block_size}"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # A prefill chunk of max_num_batched_tokens still sees the window - 1 tokens before it,
        # and no request holds more than max_model_len tokens.
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        # + 1: the window may start in the middle of a block, straddling one more block.
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """One group of layers of the same attention type whose page sizes differ (e.g. head sizes).

    They share one block table: block `i` is page `i` of every layer, each in its own tensor, so
    one block costs the sum of the layers' pages. `kv_cache_specs` maps layer name to its spec.
    """

    kv_cache_specs: dict[str, KVCacheSpec]

    def __post_init__(self) -> None:
        if not self.kv_cache_specs:
            raise ValueError("UniformTypeKVCacheSpecs needs at least one layer spec, got none")
        type_ids = {spec.type_id for spec in self.kv_cache_specs.values()}
        block_sizes = {spec.block_size for spec in self.kv_cache_specs.values()}
        if len(type_ids) != 1 or block_sizes != {self.block_size}:
            raise ValueError(
                "UniformTypeKVCacheSpecs needs layers of one attention type and block size "
                f"(block_size={self.block_size}), got type ids {sorted(type_ids)}"
            )

    def __hash__(self) -> int:
        # Equality compares the dicts regardless of order, so the hash must ignore order too.
        return hash((self.block_size, frozenset(self.kv_cache_specs.items())))

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    @property
    def type_id(self) -> str:
        return next(iter(self.kv_cache_specs.values())).type_id

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # Every layer needs the same number of blocks (same type); a block spans all layers.
        max_num_pages = max(
            cdiv(
                spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
                spec.page_size_bytes,
            )
            for spec in self.kv_cache_specs.values()
        )
        return max_num_pages * self.page_size_bytes

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """The group spec for `kv_cache_specs`, or None when their type ids differ."""
        if not kv_cache_specs:
            return None
        if len({spec.type_id for spec in kv_cache_specs.values()}) != 1:
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=dict(kv_cache_specs))


@dataclass(frozen=True)
class KVCacheTensor:
    """One tensor a worker allocates: `size` bytes, used by the layers in `shared_by`.

    Layers sharing a tensor belong to different groups: each group has its own block table, so
    they use disjoint blocks of it.
    """

    size: int
    shared_by: list[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared_by", list(self.shared_by))
        _require_int("KVCacheTensor.size", self.size, 0)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table, and the spec they share."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", list(self.layer_names))


@dataclass(frozen=True)
class KVCacheConfig:
    """How one worker lays out its KV cache.

    `num_blocks` is the same on every worker (the scheduler hands out block ids once for all);
    `kv_cache_groups` are the same on every worker, in the same order, each filtered to the
    worker's own layers (so a group may be empty on some worker).
    """

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        # Lists whatever the caller passed, so configs built from tuples compare equal.
        object.__setattr__(self, "kv_cache_tensors", list(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", list(self.kv_cache_groups))
        _require_int("num_blocks", self.num_blocks, 0)
