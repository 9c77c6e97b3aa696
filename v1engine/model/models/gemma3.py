"""Gemma 3, text only (`Gemma3ForCausalLM`: gemma-3-270m, -1b, and the text towers'
checkpoints), as HF's Gemma3TextModel computes it: Gemma 2's layout (gemma2.py) with query and
key heads normalized before RoPE (as Qwen3's), and one RoPE per kind of layer
(`rope_parameters` by kind: 10k for the local layers, 1M, perhaps linearly scaled, for the
global ones). Its generative configs set no soft-capping; where one does, it applies as Gemma 2's.
"""

from __future__ import annotations

from typing import Any

from v1engine.model.layers.layernorm import GemmaRMSNorm
from v1engine.model.layers.rotary_embedding import RotaryEmbedding
from v1engine.model.models.gemma2 import Gemma2Attention, Gemma2ForCausalLM


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str):
        super().__init__(config, layer_idx, rotary_emb, prefix)
        self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = Gemma3Attention
