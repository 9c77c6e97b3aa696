"""Qwen3: Llama plus an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from typing import Any

from v1engine.model.layers.layernorm import RMSNorm
from v1engine.model.layers.rotary_embedding import RotaryEmbedding
from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str):
        super().__init__(config, layer_idx, rotary_emb, prefix)
        # q/k [num_tokens, heads, head_size]: `qk_norm` normalizes over head_size, per head.
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
