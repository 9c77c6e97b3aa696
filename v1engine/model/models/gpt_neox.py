"""GPT-NeoX (`GPTNeoXForCausalLM`: EleutherAI's Pythia suite, GPT-NeoX-20B, and models trained in
its shape), as HF's GPTNeoXModel computes it: LayerNorm (weight and bias) before the attention
and the MLP, which by default read the same input and are added to it together ("parallel
residual"; `use_parallel_residual: false` chains them as Llama does); RoPE on the first
`partial_rotary_factor` of each head (a quarter in Pythia); biased projections; a plain MLP with
exact gelu; a final LayerNorm; an LM head of its own (`embed_out`).

The checkpoint's fused `query_key_value` holds each head's q, k and v together ([heads, 3,
head_size] rows); they are regrouped into the q, k and v shards of each rank as they load.
Tensors are named `gpt_neox.*` and `embed_out`; old checkpoints' mask buffers are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from v1engine.model.layers.linear import (
    VocabParallelEmbedding,
)
from v1engine.model.layers.rotary_embedding import CosSin, RotaryEmbedding
from v1engine.model.models.gpt2 import FusedMultiHeadAttention, GeluMLP, PlainDecoderModel
from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM, MakeMLP
from v1engine.model.weight_utils import WeightSource, materialize

# Checkpoint names -> the model's, replaced in order.
_RENAMES = (
    ("gpt_neox.embed_in.", "model.embed_tokens."),
    ("gpt_neox.final_layer_norm.", "model.norm."),
    ("gpt_neox.", "model."),
    ("embed_out.", "lm_head."),
    (".attention.query_key_value.", ".attention.fused_qkv."),
    (".attention.dense.", ".attention.out_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.fc1."),
    (".mlp.dense_4h_to_h.", ".mlp.fc2."),
)


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.layer_norm_eps
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(size, eps)
        self.post_attention_layernorm = nn.LayerNorm(size, eps)
        self.attention = FusedMultiHeadAttention(
            config, f"{prefix}.attention", rotary_emb, config.attention_bias
        )
        self.mlp = GeluMLP(size, config.intermediate_size, config.hidden_act)

    def forward(
        self, cos_sin: CosSin, hidden: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Past the attention, only `output_rows` of the tokens (all when None)."""
        residual = hidden if output_rows is None else hidden[output_rows]
        attn = self.attention(cos_sin, self.input_layernorm(hidden), output_rows)
        if self.use_parallel_residual:  # HF's order of the sum
            return self.mlp(self.post_attention_layernorm(residual)) + attn + residual
        hidden = attn + residual
        return self.mlp(self.post_attention_layernorm(hidden)) + hidden


class GPTNeoXModel(PlainDecoderModel):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention], make_mlp: MakeMLP) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        head_size = config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding.from_config(config, head_size)
        self.layers = nn.ModuleList(
            GPTNeoXLayer(config, self.rotary_emb, f"gpt_neox.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps)


class GPTNeoXForCausalLM(LlamaForCausalLM):
    model_cls = GPTNeoXModel

    checkpoint_skips = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
    checkpoint_renames = _RENAMES

    def load_special_weight(self, name: str, loaded: WeightSource) -> bool:
        """`query_key_value`'s weight and bias: per head, its q, k and v rows."""
        if not name.endswith((".attention.fused_qkv.weight", ".attention.fused_qkv.bias")):
            return False
        param = self.get_parameter(name)
        tensor = materialize(loaded)  # [3 * hidden, hidden] or [3 * hidden]
        num_heads = self.config.num_attention_heads
        head_size = self.config.hidden_size // num_heads
        grouped = tensor.reshape(num_heads, 3, head_size, *tensor.shape[1:])
        for i, shard_id in enumerate("qkv"):
            rows = grouped[:, i].reshape(num_heads * head_size, *tensor.shape[1:])
            param.weight_loader(param, rows, shard_id)
        return True
