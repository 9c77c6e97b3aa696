"""The LoRA slots one projection holds, and the delta it adds to its output.

A projection fusing `J` checkpoint projections (QKV: q, k, v; gate_up: gate, up) with `S` slots
of rank up to `R` holds every slot's A stacked, `a` [S * J * R, in_features of this rank], and
every slot's B transposed and stacked alike, `b_t` [S * J * R, out_features of this rank], each
part's B only in its own output columns (zeros elsewhere). A step whose tokens all run one
adapter (the common case) multiplies by its slot's rows only; a mixed step gives each token a
one-hot row of its slot (all zeros: the base model), so the whole batch's deltas are two dense
matmuls with the other slots' columns zeroed between them, whatever the mix:

    delta = (x @ a[slot]^T) @ b_t[slot]                                        one adapter
    delta = ((x @ a^T).view(T, S, J * R) * one_hot[:, :, None]).view(T, -1) @ b_t     a mix

Column-parallel layers shard B's output features as they shard the weight's (each part through
the layer's own weight loader); row-parallel ones shard A's input features, so `x @ a^T` is a
partial sum, all-reduced before B (which every rank holds whole) and the delta added after the
layer's all-reduce.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from v1engine.model.layers.attention_backend import get_forward_context
from v1engine.model.layers.linear import LinearBase, RowParallelLinear
from v1engine.model.parallel_state import tensor_model_parallel_all_reduce


@dataclass(frozen=True)
class LoRAMapping:
    """One step's token -> slot mapping: `slot` when every token runs the adapter in that slot,
    else one-hot rows, `tokens` [num_tokens, S] for the layers that see every token and `rows`
    for those that see only the output rows (the last layer's, past its attention; None: every
    row is an output row)."""

    slot: int | None
    tokens: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    def with_output_rows(self, output_rows: torch.Tensor | None) -> LoRAMapping:
        """This step's mapping when its last layer computes `output_rows` (None: all)."""
        if self.tokens is None or output_rows is None:
            return self
        return dataclasses.replace(self, rows=self.tokens[output_rows])

    def one_hot(self, x: torch.Tensor) -> torch.Tensor:
        assert self.tokens is not None
        return self.tokens if self.rows is None or x.shape[0] == self.tokens.shape[0] else self.rows


class LoRASlots:
    """`parts`: the (checkpoint projection, weight-loader shard id) the layer fuses, in order."""

    def __init__(
        self,
        layer: LinearBase,
        parts: list[tuple[str, object]],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer = layer
        self.parts = parts
        self.max_rank = max_rank
        self.slot_width = len(parts) * max_rank  # rows of `a` and `b_t` per slot
        self.row_parallel = isinstance(layer, RowParallelLinear)
        out_features, in_features = layer.weight.shape
        width = num_slots * self.slot_width
        self.a = torch.zeros(width, in_features, dtype=dtype, device=device)
        self.b_t = torch.zeros(width, out_features, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b_t.nbytes

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Puts an adapter's (A, scaled B) of each part it has (full, unsharded) in `slot`; its
        parts without weights, and its unused rank, stay zero."""
        rows = self._rows(slot)
        self.a[rows] = 0
        self.b_t[rows] = 0
        for j, (projection, shard_id) in enumerate(self.parts):
            if projection not in weights:
                continue
            a, b = weights[projection]
            rank, start = a.shape[0], rows.start + j * self.max_rank
            if self.row_parallel:  # this rank's input columns of A; B whole
                a = self._shard(a, torch.empty(rank, self.a.shape[1]), shard_id)
            else:  # this rank's output rows of B, at this part's offset
                b = self._shard(b, torch.zeros(self.b_t.shape[1], rank), shard_id)
            self.a[start : start + rank] = a
            self.b_t[start : start + rank] = b.t()

    def _rows(self, slot: int) -> slice:
        return slice(slot * self.slot_width, (slot + 1) * self.slot_width)

    def _shard(self, full: torch.Tensor, shard: torch.Tensor, shard_id: object) -> torch.Tensor:
        # The layer's own loader narrows a checkpoint tensor to this rank as it did the weight.
        self.layer.weight_loader(shard, full, shard_id)  # type: ignore[arg-type]
        return shard

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the layer's output for x, a tensor of its own) plus each token's adapter
        delta, in place; unchanged when the step runs no adapter."""
        mapping: LoRAMapping | None = get_forward_context().lora
        if mapping is None:
            return out
        a, b_t = self.a, self.b_t
        if mapping.slot is not None:
            rows = self._rows(mapping.slot)
            a, b_t = a[rows], b_t[rows]
        shrunk = F.linear(x, a)
        if self.row_parallel:
            shrunk = tensor_model_parallel_all_reduce(shrunk)
        if mapping.slot is None:
            one_hot = mapping.one_hot(x)
            tokens, slots = one_hot.shape
            shrunk = (shrunk.view(tokens, slots, -1) * one_hot[:, :, None]).view(tokens, -1)
        return out.addmm_(shrunk, b_t)
