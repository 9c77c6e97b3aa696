"""Tensor-parallel linear layers (Megatron-style) whose weight loaders narrow to this rank's shard.

Column-parallel layers split the output features: each rank computes its slice and no
communication is needed until a row-parallel layer, which splits the input features, sums the
partial products with one all-reduce. Weights keep nn.Linear's layout: [out_features, in_features].
"""

from __future__ import annotations

import torch
from torch import nn

from v1engine.model.layers.gemm import linear
from v1engine.model.parallel_state import (
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from v1engine.model.weight_utils import WeightSource, copy_weight, narrow_weight, weight_shape


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}; "
            "choose a tensor_parallel_size that divides it"
        )
    return numerator // denominator


class LinearBase(nn.Module):
    """Holds `weight` [output_size_per_rank, input_size_per_rank] and an optional bias."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded: WeightSource, shard_id: object = None
    ) -> None:
        raise NotImplementedError


class ColumnParallelLinear(LinearBase):
    """y = x A^T + b with A split by output rows; `gather_output` all-gathers the full y."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False
    ) -> None:
        self.output_size_per_rank = _divide(output_size, get_tp_world_size(), "output_size")
        super().__init__(input_size, self.output_size_per_rank, bias)
        self.gather_output = gather_output

    def weight_loader(
        self, param: nn.Parameter, loaded: WeightSource, shard_id: object = None
    ) -> None:
        size = param.shape[0]
        copy_weight(param, narrow_weight(loaded, 0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul, e.g. the MLP's gate and up projections.

    Each rank holds its shard of every output, concatenated: [gate_r | up_r]; `shard_id` is the
    index of the checkpoint tensor in `output_sizes`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: WeightSource, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"MergedColumnParallelLinear needs an int shard_id, got {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = narrow_weight(loaded, 0, self.tp_rank * size, size)
        copy_weight(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul: each rank holds [q_r | k_r | v_r].

    Query heads split evenly. With more ranks than KV heads, each KV head is replicated on
    `tp_size // total_num_kv_heads` consecutive ranks, which are exactly the ranks whose query
    heads attend to it.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size, tp_rank = get_tp_world_size(), get_tp_rank()
        self.head_size = head_size
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            _divide(tp_size, total_num_kv_heads, "num_key_value_heads (replicated)")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // (tp_size // total_num_kv_heads)
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # Replication means the merged output is not total/tp: build the per-rank size directly.
        output_size = (self.q_size + 2 * self.kv_size) * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: WeightSource, shard_id: object = None
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_size
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be q, k or v, got {shard_id!r}")
        copy_weight(param.data.narrow(0, offset, size), narrow_weight(loaded, 0, start, size))


class RowParallelLinear(LinearBase):
    """y = x A^T + b with A split by input columns; partial sums are all-reduced, then b added."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.input_size_per_rank = _divide(input_size, get_tp_world_size(), "input_size")
        super().__init__(self.input_size_per_rank, output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: WeightSource, shard_id: object = None
    ) -> None:
        if param is self.bias:
            # The bias is added once, after the reduction, so every rank holds all of it.
            copy_weight(param, loaded)
            return
        size = param.shape[1]
        if len(weight_shape(loaded)) != 2:
            raise ValueError(f"row-parallel weight must be 2-D, got {list(weight_shape(loaded))}")
        copy_weight(param, narrow_weight(loaded, 1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tensor_model_parallel_all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias
