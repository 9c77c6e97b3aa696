"""A CPU decode step's decoder layers in one native call (`layers/cpu_decoder_stack.c`).

At batch 1 a layer is about ten small ops, and from Python each costs more in dispatch than in
arithmetic: a quarter of a SmolLM2 step (`scripts/profile_steps.py`); at a few dozen decodes the
dispatch is still several percent of a step. `LlamaModel.forward` hands such steps to this class,
which runs the same kernels in the same order in C (the matmul kernel `linear` picks for the row
count included), so the hidden states are bit-identical to the layer-by-layer forward
(`tests/model/test_decode_stack.py`). It applies to steps of at most `linear.max_kernel_tokens`
rows (for every matmul's width) without padding (decodes, or decodes and a few prompt tokens)
that the CPU attention backend planned (`CpuAttentionMetadata` for every KV cache group), at
tensor-parallel size 1, with KV caches of the model's dtype, RoPE over whole heads in every layer
(not SmolLM3, Phi-4-mini), no residual multiplier (not Granite), dense MLPs (not an MoE), and
whose tokens run no LoRA adapter or all the same one (its deltas are added in C, not
bit-identical to the layers' but close: tests/lora/test_lora_decode_stack.py); every other step
runs the layers.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

import torch

from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.attention_backend import get_forward_context
from v1engine.model.layers.cpu_attention_backend import CpuAttentionMetadata
from v1engine.model.layers.layernorm import RMSNorm
from v1engine.model.layers.linear import max_kernel_tokens
from v1engine.model.layers.rotary_embedding import CosSin
from v1engine.model.parallel_state import get_tp_world_size

if TYPE_CHECKING:
    from v1engine.lora.layers import LoRASlots
    from v1engine.model.models.llama import LlamaDecoderLayer, LlamaModel

_P, _N = ctypes.c_void_p, ctypes.c_long
_WEIGHTS = (
    "input_norm", "qkv_weight", "qkv_bias", "q_norm", "k_norm", "o_weight", "o_bias",
    "post_norm", "gate_up_weight", "gate_up_bias", "down_weight", "down_bias",
    "qkv_packed", "o_packed", "gate_up_packed", "down_packed",
)  # fmt: skip
# Each matmul's LoRA slots (lora/layers.py), if LoRA is on: its `a` and `b_t`, then slot widths.
_LORA_MATMULS = ("qkv", "o", "gate_up", "down")
_LORA = tuple(f"{m}_lora_{t}" for m in _LORA_MATMULS for t in ("a", "b"))


# The C structs of cpu_decoder_stack.c, field for field.
class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in (*_WEIGHTS, "k_cache", "v_cache")] + [
        ("kv_cache_group", _N),
        ("block_size", _N),
        ("window", _N),
        *((name, _P) for name in _LORA),
        *((f"{m}_lora_width", _N) for m in _LORA_MATMULS),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, _N) for name in ("hidden", "num_heads", "num_kv_heads", "head_size")),
        ("intermediate", _N),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("gemv_max_tokens", _N),
        ("packed_max_tokens", _N),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _N),
        ("num_seqs", _N),
        ("cos", _P),
        ("sin", _P),
        ("slots", ctypes.POINTER(_P)),
        ("block_tables", ctypes.POINTER(_P)),
        ("table_strides", ctypes.POINTER(_N)),
        ("seq_lens", ctypes.POINTER(_P)),
        ("query_start_locs", ctypes.POINTER(_P)),
        ("lora_slot", _N),
    ]


class LlamaDecodeStack:
    """`model`'s decoder layers and final norm for CPU decode steps of a few tokens."""

    def __init__(self, model: LlamaModel) -> None:
        self._model = model
        # The layer table holds raw pointers to weights and caches. It is rebuilt when a layer's
        # cache is rebound (weights that moved, after sleep mode, come with new caches); weak
        # references tell, without keeping a dropped cache's memory alive.
        self._cache_refs: list[weakref.ref] = []
        self._table: ctypes.Array[_Layer] | None = None
        if not all(hasattr(layer.mlp, "gate_up_proj") for layer in model.layers):
            self._max_tokens = 0  # a layer's MLP is a mixture of experts: never applies
            return
        attention = model.layers[0].self_attn
        self._shape = _Shape(
            model.norm.weight.shape[0],
            attention.num_heads,
            attention.num_kv_heads,
            attention.head_size,
            model.layers[0].mlp.down_proj.weight.shape[1],
            model.norm.eps,
            attention.attn.scale,
            cpu_kernels.max_gemv_tokens(model.norm.weight.dtype),
            cpu_kernels.max_gemm_packed_tokens(model.norm.weight.dtype),
        )
        # The most rows every matmul's kernel takes (the bfloat16 gemm needs an even K).
        self._max_tokens = max_kernel_tokens(
            model.norm.weight.dtype,
            self._shape.hidden,
            attention.num_heads * attention.head_size,
            self._shape.intermediate,
        )

    def applies(self, hidden: torch.Tensor) -> bool:
        """Whether this step (hidden [tokens, hidden_size]) can run here."""
        context = get_forward_context()
        metadata = context.attn_metadata
        return (
            metadata is not None
            and (context.lora is None or context.lora.slot is not None)  # no mix of adapters
            and hidden.shape[0] <= self._max_tokens
            and all(
                isinstance(m, CpuAttentionMetadata) and m.num_rows == hidden.shape[0]
                for m in metadata
            )
            and cpu_kernels.applies(hidden, self._model.norm.weight)  # one dtype, on CPU
            and self._layer_table() is not None
        )

    def __call__(self, hidden: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
        """The embeddings hidden [tokens, hidden_size] -> the final norm's output, as
        `LlamaModel.forward`; check `applies` first."""
        context = get_forward_context()
        metadata: list[CpuAttentionMetadata] = context.attn_metadata  # type: ignore
        cos, sin = (t.contiguous() for t in cos_sin)
        groups = len(metadata)
        step = _Step(
            hidden.shape[0],
            metadata[0].seq_lens.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            (_P * groups)(*(m.slot_mapping.data_ptr() for m in metadata)),
            (_P * groups)(*(m.block_table.data_ptr() for m in metadata)),
            (_N * groups)(*(m.block_table.stride(0) for m in metadata)),
            (_P * groups)(*(m.seq_lens.data_ptr() for m in metadata)),
            (_P * groups)(*(cpu_kernels.data_pointer(m.query_start_loc) for m in metadata)),
            -1 if context.lora is None else context.lora.slot,
        )
        hidden = hidden.contiguous()
        out = torch.empty_like(hidden)
        table = self._table
        failed = cpu_kernels.kernel("decoder_stack", hidden.dtype)(
            table,
            len(table),
            ctypes.byref(self._shape),
            ctypes.byref(step),
            hidden.data_ptr(),
            self._model.norm.weight.data_ptr(),
            out.data_ptr(),
        )
        if failed:
            raise MemoryError("the CPU decoder stack could not allocate its buffers")
        return out

    def _layer_table(self) -> ctypes.Array[_Layer] | None:
        """The C layer table, built on first use and after the caches were rebound; None if this
        model cannot take the path."""
        caches = [layer.self_attn.attn.kv_cache for layer in self._model.layers]
        # Every step: one pass over the layers while the caches stay those the table was built on.
        refs = self._cache_refs
        if refs and all(c is not None and r() is c[0] for r, c in zip(refs, caches)):
            return self._table
        if any(cache is None for cache in caches):
            return None
        self._cache_refs = [weakref.ref(cache[0]) for cache in caches]
        self._table = self._build_table()
        return self._table

    def _build_table(self) -> ctypes.Array[_Layer] | None:
        model = self._model
        dtype = model.norm.weight.dtype
        weights = [_layer_weights(layer) for layer in model.layers]
        caches = [layer.self_attn.attn.kv_cache for layer in model.layers]
        tensors = [t for w in weights for t in w.values()] + [t for c in caches for t in c or ()]
        supported = (
            get_tp_world_size() == 1
            and all(_rotates_whole_heads(layer) for layer in model.layers)  # no NoPE or partial
            and all(layer.residual_multiplier is None for layer in model.layers)  # not Granite
            and all(layer.self_attn.attn.logits_soft_cap is None for layer in model.layers)
            and all(t is None or (t.dtype == dtype and t.is_contiguous()) for t in tensors)
            and len({m.eps for m in model.modules() if isinstance(m, RMSNorm)}) == 1
        )
        if not supported:
            return None
        structs = (_layer_struct(layer, w) for layer, w in zip(model.layers, weights))
        return (_Layer * len(model.layers))(*structs)


def _rotates_whole_heads(layer: LlamaDecoderLayer) -> bool:
    rope = layer.self_attn.rotary_emb
    return rope is not None and rope.rotary_dim == rope.head_size


def _layer_weights(layer: LlamaDecoderLayer) -> dict[str, torch.Tensor | None]:
    attention, mlp = layer.self_attn, layer.mlp
    return dict(
        input_norm=layer.input_layernorm.weight,
        qkv_weight=attention.qkv_proj.weight,
        qkv_bias=attention.qkv_proj.bias,
        q_norm=None if attention.q_norm is None else attention.q_norm.weight,
        k_norm=None if attention.k_norm is None else attention.k_norm.weight,
        o_weight=attention.o_proj.weight,
        o_bias=attention.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up_weight=mlp.gate_up_proj.weight,
        gate_up_bias=mlp.gate_up_proj.bias,
        down_weight=mlp.down_proj.weight,
        down_bias=mlp.down_proj.bias,
        qkv_packed=attention.qkv_proj.packed_weight,
        o_packed=attention.o_proj.packed_weight,
        gate_up_packed=mlp.gate_up_proj.packed_weight,
        down_packed=mlp.down_proj.packed_weight,
        **{
            f"{matmul}_lora_{side}": None if slots is None else getattr(slots, name)
            for matmul, slots in zip(_LORA_MATMULS, _lora_slots(layer))
            for side, name in (("a", "a"), ("b", "b_t"))
        },
    )


def _layer_struct(layer: LlamaDecoderLayer, weights: dict[str, torch.Tensor | None]) -> _Layer:
    attn = layer.self_attn.attn
    k_cache, v_cache = attn.kv_cache
    slots = _lora_slots(layer)
    return _Layer(
        *(cpu_kernels.data_pointer(weights[name]) for name in _WEIGHTS),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        attn.kv_cache_group_index,
        k_cache.shape[1],
        attn.sliding_window or 0,
        *(cpu_kernels.data_pointer(weights[name]) for name in _LORA),
        *(0 if s is None else s.slot_width for s in slots),
    )


def _lora_slots(layer: LlamaDecoderLayer) -> list[LoRASlots | None]:
    """The layer's matmuls' LoRA slots, in _LORA_MATMULS order (None each without LoRA)."""
    attention, mlp = layer.self_attn, layer.mlp
    return [p.lora for p in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)]
