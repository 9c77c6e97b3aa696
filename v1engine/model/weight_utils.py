"""Checkpoint tensors as the weight loaders see them: a tensor, or a lazy safetensors slice.

The loader hands each parameter's `weight_loader` a `safe_open(...).get_slice(name)` so that a rank
reads only its own shard from disk; tests and conversions hand plain tensors. The helpers here
make both look alike: shape, narrow along one dimension, materialize.
"""

from __future__ import annotations

from typing import Any

import torch

# A torch.Tensor or a safetensors slice (has get_shape() and supports [a:b, c:d] indexing).
WeightSource = Any


def weight_shape(loaded: WeightSource) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_weight(loaded: WeightSource, dim: int, start: int, length: int) -> WeightSource:
    """Rows (dim 0) or columns (dim 1) `start : start + length`, still lazy for a slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    if isinstance(loaded, _NarrowedSlice):
        # Narrowing twice composes the two ranges on the underlying slice.
        index = list(loaded.index)
        offset = index[dim].start or 0
        index[dim] = slice(offset + start, offset + start + length)
        return _NarrowedSlice(loaded.base, tuple(index))
    index = [slice(None)] * len(weight_shape(loaded))
    index[dim] = slice(start, start + length)
    return _NarrowedSlice(loaded, tuple(index))


def materialize(loaded: WeightSource) -> torch.Tensor:
    """Reads the (possibly narrowed) weight into memory."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    if isinstance(loaded, _NarrowedSlice):
        return loaded.read()
    return loaded[:] if len(weight_shape(loaded)) else loaded[()]


def copy_weight(param: torch.Tensor, loaded: WeightSource, name: str = "weight") -> None:
    """Copies `loaded` into `param`, converting dtype; a shape mismatch is a clear error."""
    shape = weight_shape(loaded)
    if shape != tuple(param.shape):
        raise ValueError(
            f"checkpoint tensor for {name} has shape {list(shape)} but the model expects "
            f"{list(param.shape)}; the checkpoint does not match its config.json"
        )
    param.data.copy_(materialize(loaded))


def default_weight_loader(
    param: torch.nn.Parameter, loaded: WeightSource, shard_id: object = None
) -> None:
    """For parameters that every rank holds whole (norms, replicated biases)."""
    copy_weight(param, loaded)


class _NarrowedSlice:
    """A safetensors slice plus the index to read: nothing is read until `read()`."""

    def __init__(self, base: Any, index: tuple[slice, ...]) -> None:
        self.base = base
        self.index = index

    def get_shape(self) -> list[int]:
        shape = list(self.base.get_shape())
        return [len(range(*s.indices(n))) for s, n in zip(self.index, shape)]

    def read(self) -> torch.Tensor:
        return self.base[self.index]
