"""The LoRA slots one projection holds, and the delta it adds to its output.

A projection fusing `J` checkpoint projections (QKV: q, k, v; gate_up: gate, up) with `S` slots
of rank up to `R` holds every slot's A stacked, `a` [S * J * R, in_features of this rank], and
every slot's B side by side, `b` [out_features of this rank, S * J * R], each part's B only in
its own output rows (zeros elsewhere). A step's tokens carry a one-hot row of their slot (all
zeros: the base model), so the whole batch's deltas are two dense matmuls with the unused
slots' columns zeroed between them, whatever mix of adapters the batch runs:

    delta = ((x @ a^T).view(T, S, J * R) * one_hot[:, :, None]).view(T, -1) @ b^T

Column-parallel layers shard B's rows as they shard the weight's (each part through the layer's
own weight loader); row-parallel ones shard A's columns, so `x @ a^T` is a partial sum,
all-reduced before B (which every rank holds whole) and the delta added after the layer's
all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from v1engine.model.layers.attention_backend import get_forward_context
from v1engine.model.layers.linear import LinearBase, RowParallelLinear
from v1engine.model.parallel_state import tensor_model_parallel_all_reduce


@dataclass(frozen=True)
class LoRAMapping:
    """One step's token -> slot one-hots: `tokens` [num_tokens, S] for the layers that see
    every token, `rows` for those that see only the output rows (the last layer's, past its
    attention), None when every row is an output row."""

    tokens: torch.Tensor
    rows: torch.Tensor | None

    @classmethod
    def of_step(cls, one_hot: torch.Tensor, output_rows: torch.Tensor | None) -> LoRAMapping:
        """The mapping of a step whose tokens' one-hots are `one_hot`, of which the last layer
        computes `output_rows` (None: all) past its attention."""
        return cls(one_hot, None if output_rows is None else one_hot[output_rows])

    def for_input(self, x: torch.Tensor) -> torch.Tensor:
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
        self.row_parallel = isinstance(layer, RowParallelLinear)
        out_features, in_features = layer.weight.shape
        width = num_slots * len(parts) * max_rank
        self.a = torch.zeros(width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, width, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Puts an adapter's (A, scaled B) of each part it has (full, unsharded) in `slot`; its
        parts without weights, and its unused rank, stay zero."""
        width = len(self.parts) * self.max_rank
        self.a[slot * width : (slot + 1) * width] = 0
        self.b[:, slot * width : (slot + 1) * width] = 0
        for j, (projection, shard_id) in enumerate(self.parts):
            if projection not in weights:
                continue
            a, b = weights[projection]
            rank, start = a.shape[0], (slot * len(self.parts) + j) * self.max_rank
            if self.row_parallel:  # this rank's input columns of A; B whole
                a = self._shard(a, torch.empty(rank, self.a.shape[1]), shard_id)
            else:  # this rank's output rows of B, at this part's offset
                b = self._shard(b, torch.zeros(self.b.shape[0], rank), shard_id)
            self.a[start : start + rank] = a
            self.b[:, start : start + rank] = b

    def _shard(self, full: torch.Tensor, shard: torch.Tensor, shard_id: object) -> torch.Tensor:
        # The layer's own loader narrows a checkpoint tensor to this rank as it did the weight.
        self.layer.weight_loader(shard, full, shard_id)  # type: ignore[arg-type]
        return shard

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the layer's output for x) plus each token's adapter delta; `out` unchanged
        when the step runs no adapter."""
        mapping: LoRAMapping | None = get_forward_context().lora
        if mapping is None:
            return out
        one_hot = mapping.for_input(x)
        shrunk = F.linear(x, self.a)
        if self.row_parallel:
            shrunk = tensor_model_parallel_all_reduce(shrunk)
        rows, slots = one_hot.shape
        shrunk = (shrunk.view(rows, slots, -1) * one_hot[:, :, None]).view(rows, -1)
        return out + F.linear(shrunk, self.b)
