"""Phi-1, Phi-1.5 and Phi-2 (`PhiForCausalLM`), as HF's PhiModel computes them: one LayerNorm
(weight and bias) per layer, whose output feeds the attention and the MLP alike, both added to
the layer's input together ("parallel" blocks); biased q, k, v and output projections, RoPE on
the first `partial_rotary_factor` of each head, optional per-head LayerNorms of queries and keys
(`qk_layernorm`); a plain MLP (`fc1`, gelu with the tanh approximation, `fc2`); a final
LayerNorm; an LM head with a bias, which keeps greedy steps off the greedy screen.
(Phi-3 and Phi-4-mini are `Phi3ForCausalLM`, phi3.py: Llama's layout.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from v1engine.model.layers.linear import (
    VocabParallelEmbedding,
)
from v1engine.model.layers.rotary_embedding import CosSin, RotaryEmbedding
from v1engine.model.models.gpt2 import GeluMLP, PlainDecoderModel
from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM, MakeMLP, get_head_size


class PhiAttention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str):
        super().__init__(config, layer_idx, rotary_emb, prefix)
        if config.qk_layernorm:  # LlamaAttention.qk_norm applies them to each head
            self.q_norm = nn.LayerNorm(self.head_size, config.layer_norm_eps)
            self.k_norm = nn.LayerNorm(self.head_size, config.layer_norm_eps)

    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        return True, True


class PhiDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = PhiAttention(config, layer_idx, rotary_emb, f"{prefix}.self_attn")
        self.mlp = mlp

    def forward(
        self, cos_sin: CosSin, hidden: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Past the attention, only `output_rows` of the tokens (all when None)."""
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(cos_sin, normed, output_rows)
        if output_rows is not None:
            hidden, normed = hidden[output_rows], normed[output_rows]
        return attn + self.mlp(normed) + hidden  # HF's order of the sum


class PhiModel(PlainDecoderModel):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention], make_mlp: MakeMLP) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding.from_config(config, get_head_size(config))
        self.layers = nn.ModuleList(
            PhiDecoderLayer(config, i, self.rotary_emb, f"model.layers.{i}", make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps)


# Checkpoint names -> ours (q_proj, k_proj and v_proj load into qkv_proj as Llama's do).
_RENAMES = (
    ("model.final_layernorm.", "model.norm."),
    (".self_attn.dense.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
)


class PhiForCausalLM(LlamaForCausalLM):
    model_cls = PhiModel
    checkpoint_renames = _RENAMES

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return GeluMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def __init__(
        self, hf_config: Any, dtype: torch.dtype = torch.float32, has_lm_head: bool = True
    ) -> None:
        super().__init__(hf_config, dtype, has_lm_head)
        self.lm_head.bias = nn.Parameter(
            torch.zeros(hf_config.vocab_size, dtype=dtype), requires_grad=False
        )

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) + self.lm_head.bias.float()
