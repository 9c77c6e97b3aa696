"""StarCoder 2 (`Starcoder2ForCausalLM`: bigcode's starcoder2-3b, -7b, -15b and their
fine-tunes), as HF's Starcoder2Model computes it: Llama's attention (grouped KV heads, RoPE, a
sliding window over every layer where `sliding_window` is set) with biased q, k, v and output
projections (`use_bias`); LayerNorm (weight and bias) before the attention and before the MLP,
each added back to its input in turn; a plain MLP (`c_fc`, gelu with the tanh approximation,
`c_proj`); a final LayerNorm; the LM head tied to the embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from v1engine.model.layers.linear import VocabParallelEmbedding
from v1engine.model.layers.rotary_embedding import CosSin, RotaryEmbedding
from v1engine.model.models.gpt2 import GeluMLP, PlainDecoderModel
from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM, MakeMLP, get_head_size


class Starcoder2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        return config.use_bias, config.use_bias


class Starcoder2DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str, mlp: nn.Module
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.norm_epsilon
        self.input_layernorm = nn.LayerNorm(size, eps)
        self.self_attn = Starcoder2Attention(config, layer_idx, rotary_emb, f"{prefix}.self_attn")
        self.post_attention_layernorm = nn.LayerNorm(size, eps)
        self.mlp = mlp

    def forward(
        self, cos_sin: CosSin, hidden: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Past the attention, only `output_rows` of the tokens (all when None)."""
        residual = hidden if output_rows is None else hidden[output_rows]
        hidden = residual + self.self_attn(cos_sin, self.input_layernorm(hidden), output_rows)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Starcoder2Model(PlainDecoderModel):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention], make_mlp: MakeMLP) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding.from_config(config, get_head_size(config))
        self.layers = nn.ModuleList(
            Starcoder2DecoderLayer(
                config, i, self.rotary_emb, f"model.layers.{i}", make_mlp(config, i)
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, config.norm_epsilon)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_cls = Starcoder2Model
    checkpoint_renames = ((".mlp.c_fc.", ".mlp.fc1."), (".mlp.c_proj.", ".mlp.fc2."))

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return GeluMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, config.use_bias
        )
