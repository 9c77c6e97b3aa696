"""Qwen3: Llama plus an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from typing import Any

import torch

from v1engine.model.layers.layernorm import RMSNorm
from v1engine.model.layers.rotary_embedding import RotaryEmbedding
from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str):
        super().__init__(config, layer_idx, rotary_emb, prefix)
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_size]; the norm runs over head_size, per head.
        return self.q_norm(q), self.k_norm(k)

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.q_norm.weight, self.k_norm.weight


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
