"""Gemma 2 (`Gemma2ForCausalLM`: gemma-2-2b, -9b, -27b and their -it checkpoints), as HF's
Gemma2Model computes it, and the layout Gemma 3 (gemma3.py) builds on. Llama's with these
differences:

- every norm is Gemma's RMSNorm (the checkpoint holds an offset: the scale is 1 + weight), and
  each layer has four: before and after the attention, before and after the MLP; the outputs of
  the attention and the MLP are normalized before their residual adds;
- the attention logits are scaled by `query_pre_attn_scalar ** -0.5` instead of the head
  size's, and soft-capped: each becomes cap * tanh(logit / cap) before the softmax
  (`attn_logit_softcapping`, 50), in every attention backend;
- layers are "sliding_attention" (a window of `sliding_window` tokens) or "full_attention"
  (`layer_types`: they alternate, the first sliding), with one RoPE table per distinct
  `rope_parameters` (Gemma 2 has one; Gemma 3 one per kind);
- the embeddings are multiplied by sqrt(hidden_size), in the model's dtype;
- the MLP's gate is gelu (tanh approximation), not silu;
- the final logits are soft-capped too (`final_logit_softcapping`, 30). The greedy screen
  (greedy_screen.py) still picks greedy tokens from the raw logits: the cap is monotonic.
Bidirectional attention (EmbeddingGemma) is refused: the generative configs do not use it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from v1engine.model.layers.activation import GeluTanhAndMul
from v1engine.model.layers.layernorm import GemmaRMSNorm
from v1engine.model.layers.linear import VocabParallelEmbedding
from v1engine.model.layers.rotary_embedding import CosSin, RotaryEmbedding, RotaryEmbeddingsByKind
from v1engine.model.models.llama import (
    DecoderModel,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    MakeMLP,
    get_head_size,
)


class Gemma2Attention(LlamaAttention):
    @staticmethod
    def softmax_scale(config: Any, head_size: int) -> float:
        return config.query_pre_attn_scalar**-0.5

    @staticmethod
    def logits_soft_cap(config: Any) -> float | None:
        return getattr(config, "attn_logit_softcapping", None)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attention_cls: type[LlamaAttention],
        rotary_emb: RotaryEmbedding,
        prefix: str,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.layer_type = _layer_types(config)[layer_idx]
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = attention_cls(config, layer_idx, rotary_emb, f"{prefix}.self_attn")
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        cos_sin: dict[str, CosSin],
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer's (the residual add fused into the next norm), with the outputs
        of the attention and the MLP normalized before their adds; `cos_sin` by layer kind."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(cos_sin[self.layer_type], hidden_states, output_rows)
        if output_rows is not None:
            residual = residual[output_rows]
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class GemmaModel(DecoderModel):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention], make_mlp: MakeMLP) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "use_bidirectional_attention (EmbeddingGemma) is not supported: v1engine's "
                "attention is causal"
            )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        kinds = _layer_types(config)
        self.rotary_embs = RotaryEmbeddingsByKind(config, get_head_size(config), kinds)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config,
                i,
                attention_cls,
                self.rotary_embs[kind],
                f"model.layers.{i}",
                make_mlp(config, i),
            )
            for i, kind in enumerate(kinds)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # HF scales by sqrt(hidden_size) rounded to the model's dtype.
        return hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)

    def step_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, CosSin]:
        return self.rotary_embs.cos_sin(positions, dtype)


def _layer_types(config: Any) -> list[str]:
    """Each layer's kind: transformers' Gemma configs list them (from the alternation, or Gemma
    3's `sliding_window_pattern`, for configs written before they did), and so does the HFConfig
    read through them."""
    return list(config.layer_types)


class Gemma2ForCausalLM(LlamaForCausalLM):
    attention_cls = Gemma2Attention
    model_cls = GemmaModel

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {config.hidden_activation!r} is not supported for Gemma; "
                "only 'gelu_pytorch_tanh' is"
            )
        return LlamaMLP(config, act_fn=GeluTanhAndMul())

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap
