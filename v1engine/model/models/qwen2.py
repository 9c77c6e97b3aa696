"""Qwen2: Llama with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import Any

from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
