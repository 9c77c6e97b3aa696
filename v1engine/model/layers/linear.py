"""The tensor-parallel layers that hold weight matrices (Megatron-style): linear layers, the
vocabulary-parallel embedding and LM head, and the one matmul they all call. Weight loaders
narrow each checkpoint tensor to this rank's shard.

Column-parallel layers split the output features: each rank computes its slice and no
communication is needed until a row-parallel layer, which splits the input features, sums the
partial products with one all-reduce. Weights keep nn.Linear's layout: [out_features, in_features].
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from v1engine.logger import init_logger
from v1engine.model.layers import cpu_kernels
from v1engine.model.parallel_state import (
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from v1engine.model.weight_utils import WeightSource, copy_weight, narrow_weight, weight_shape
from v1engine.utils import round_up

if TYPE_CHECKING:
    from v1engine.lora.layers import LoRASlots

logger = init_logger(__name__)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}; "
            "choose a tensor_parallel_size that divides it"
        )
    return numerator // denominator


class LinearBase(nn.Module):
    """Holds `weight` [output_size_per_rank, input_size_per_rank] and an optional bias, and on
    CPU in float32 the weight packed for our gemm (`pack_cpu_weights`)."""

    packed_weight: torch.Tensor | None = None
    # A decoder projection's LoRA adapters, with LoRA enabled (v1engine/lora/layers.py).
    lora: LoRASlots | None = None

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
        out = linear(x, self.weight, self.bias, self.packed_weight)
        if self.lora is not None:
            out = self.lora.add_delta(x, out)
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
        out = tensor_model_parallel_all_reduce(linear(x, self.weight, packed=self.packed_weight))
        if self.lora is not None:
            out = self.lora.add_delta(x, out)
        return out if self.bias is None else out + self.bias


# -- the matmul under every layer here ----------------------------------------------------------
# y = x W^T + b. On CPU, torch's `F.linear` goes to MKL's sgemm, which on the AMD EPYC (AVX-512) we
# benchmark on ran 1.5-3x slower than oneDNN's JIT kernels at 64 tokens and more, and about even
# at 1 token; at a few tokens (a decode step) both read the weights at half the memory bandwidth
# or less, and at a few dozen reach half the GFLOP/s they get on a prefill. Our own kernels do
# better there (`scripts/bench_gemm.py` measures all of them). float32: `cpu_gemv.c` for one row,
# `cpu_gemm_packed.c` up to `cpu_kernels.max_gemm_packed_tokens` rows, on the weight packed once
# after loading (`pack_cpu_weights`), then the tiled `cpu_gemm.c` up to `max_gemm_tokens` on the
# plain weight (the two gemms give the same bits); bfloat16: `cpu_gemv.c` up to
# `max_gemv_tokens`, then `cpu_gemm.c` where the CPU has AVX512-BF16. Larger inputs go
# through oneDNN's linear (`mkldnn._linear_pointwise`, the op torch's own CPU compiler emits for
# linear layers), except float32 on Intel CPUs, where MKL's sgemm is the faster of the two
# (2-core Xeon with AVX-512, the SmolLM2 step's matmuls: 3-4% at 128-512 rows, 10-14% at
# 1024-2048); both read the plain weight. Anywhere else, where none is available, or where
# autograd must see the op (our kernels have no backward), `F.linear`.


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in_features], weight [out_features, in_features] -> [..., out_features]; `packed`
    is the weight as `cpu_kernels.pack_weight` lays it out, if the layer has it."""
    if not cpu_kernels.cpu_inputs(x, weight, bias):  # oneDNN's linear reads the same inputs
        return F.linear(x, weight, bias)
    x = x.contiguous()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows <= max_kernel_tokens(x.dtype, x.shape[-1]) and kernels_apply(weight, bias):
        if rows <= cpu_kernels.max_gemv_tokens(x.dtype):
            return cpu_kernels.gemv(x, weight, bias)
        if packed is not None and rows <= cpu_kernels.max_gemm_packed_tokens(x.dtype):
            return cpu_kernels.gemm_packed(x, packed, weight.shape[0], bias)
        return cpu_kernels.gemm(x, weight, bias)
    if _onednn_linear_works() and not (x.dtype == torch.float32 and _mkl_is_faster()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_cpu_weights(model: nn.Module, with_lm_head: bool = True) -> None:
    """Gives every matmul layer of `model` whose weight our CPU gemm takes (float32, on CPU,
    kernels built) its `packed_weight`, once the weights are loaded and tied. The weight stays
    for the larger inputs the tiled gemm and MKL take (and the embedding a tied LM head shares):
    float32 weights are held twice on CPU, for decode steps of 2 to 32 requests 1.05-1.35x
    faster (cpu_gemm_packed.c). Skipped, with a warning, where the copies would take more than
    half of the memory still available: the layers then run the tiled gemm. `with_lm_head=False`
    (a model that only pools) leaves the LM head unpacked."""
    kinds = (LinearBase, ParallelLMHead) if with_lm_head else LinearBase
    layers = [m for m in model.modules() if isinstance(m, kinds) and _packs(m.weight)]
    needed = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    available = psutil.virtual_memory().available
    if needed > available // 2:
        logger.warning(
            "Not packing the float32 weights for the CPU decode gemm: the copies need %.2f GiB "
            "of the %.2f GiB available; decode steps of up to 32 requests run up to 1.35x slower",
            needed / 2**30,
            available / 2**30,
        )
        return
    for module in layers:
        module.packed_weight = cpu_kernels.pack_weight(module.weight)


def repack_cpu_weights(model: nn.Module) -> None:
    """Rewrites every packed copy from its weight, after the weights were loaded again. In
    place: the CPU decoder stack holds the copies' addresses."""
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if packed is not None:
            packed.copy_(cpu_kernels.pack_weight(module.weight))


def packed_weight_bytes(model: nn.Module) -> int:
    """What `pack_cpu_weights` added to `model`'s memory."""
    packed = (getattr(m, "packed_weight", None) for m in model.modules())
    return sum(p.numel() * p.element_size() for p in packed if p is not None)


def _packs(weight: torch.Tensor) -> bool:
    return (
        cpu_kernels.max_gemm_packed_tokens(weight.dtype) > 0
        and cpu_kernels.cpu_inputs(weight)
        and kernels_apply(weight, None)
    )


def max_kernel_tokens(dtype: torch.dtype, *in_features: int) -> int:
    """The most rows our CPU matmul kernels take for `dtype` inputs of every width in
    `in_features` (none given: a width any kernel takes), gemv, then gemm past it."""
    gemv = cpu_kernels.max_gemv_tokens(dtype)
    return min(max(gemv, cpu_kernels.max_gemm_tokens(dtype, k)) for k in in_features or (0,))


def kernels_apply(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Beyond `cpu_inputs` (checked by the caller): contiguous weights, kernels built."""
    return (
        weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
        and cpu_kernels.available()
    )


@functools.cache
def _mkl_is_faster() -> bool:
    """Whether float32 matmuls past our kernels go to MKL (F.linear): on Intel CPUs, with MKL."""
    return torch.backends.mkl.is_available() and cpu_kernels.is_intel_cpu()


@functools.cache
def _onednn_linear_works() -> bool:
    """Whether this torch build has oneDNN's linear and it agrees with `F.linear` on a probe."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=generator)
    weight = torch.randn(5, 8, generator=generator)
    bias = torch.randn(5, generator=generator)
    try:
        with torch.inference_mode():
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    except RuntimeError as e:
        logger.warning("oneDNN linear unavailable (%s); CPU matmuls use F.linear", e)
        return False
    return bool(torch.allclose(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-5))


# -- vocabulary-parallel embedding and LM head --------------------------------------------------
# Each rank owns a contiguous range of token ids. The vocabulary is padded up to a multiple of the
# tensor-parallel size so every rank holds the same number of rows; padded rows are zero and
# padded logits are cut off after the gather.
class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp_size = get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_padded = round_up(num_embeddings, tp_size)
        self.num_embeddings_per_rank = self.num_embeddings_padded // tp_size
        self.vocab_start = get_tp_rank() * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        # zeros, not empty: the padded rows are never loaded and must not produce garbage logits.
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: WeightSource, shard_id: object = None
    ) -> None:
        rows = weight_shape(loaded)[0]
        if rows != self.num_embeddings:
            raise ValueError(
                f"checkpoint embedding has {rows} rows but config.json says vocab_size="
                f"{self.num_embeddings}; the checkpoint does not match its config"
            )
        num_rows = max(0, min(self.vocab_end, rows) - self.vocab_start)
        if num_rows:
            shard = narrow_weight(loaded, 0, self.vocab_start, num_rows)
            copy_weight(param.data[:num_rows], shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [num_tokens] -> [num_tokens, embedding_dim]
        if self.num_embeddings_per_rank == self.num_embeddings_padded:
            return F.embedding(input_ids, self.weight)
        # Ids owned by another rank look up row 0 here, are zeroed, and arrive via the all-reduce.
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        embeds = F.embedding(local_ids, self.weight).masked_fill_(~in_range.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(embeds)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    packed_weight: torch.Tensor | None = None  # pack_cpu_weights

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden_size] -> [num_tokens, vocab_size] float32, on every rank."""
        # [num_tokens, num_embeddings_per_rank]
        logits = linear(hidden_states, self.weight, packed=self.packed_weight)
        if self.num_embeddings_per_rank != self.num_embeddings_padded:  # split over ranks
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings].float()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)
