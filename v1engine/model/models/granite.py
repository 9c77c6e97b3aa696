"""Granite (IBM Granite 3.x, `GraniteForCausalLM`): Llama with four scalars from its config,
set on Llama's modules: the embeddings are multiplied by `embedding_multiplier`, the attention
logits by `attention_multiplier` (instead of 1/sqrt(head size)), each block's output by
`residual_multiplier` before its residual add (which keeps a step off the CPU decoder stack),
and the logits divided by `logits_scaling`."""

from __future__ import annotations

from typing import Any

import torch

from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM


class GraniteAttention(LlamaAttention):
    @staticmethod
    def softmax_scale(config: Any, head_size: int) -> float:
        return config.attention_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    attention_cls = GraniteAttention

    def __init__(
        self, hf_config: Any, dtype: torch.dtype = torch.float32, has_lm_head: bool = True
    ) -> None:
        super().__init__(hf_config, dtype, has_lm_head)
        self.model.embedding_multiplier = hf_config.embedding_multiplier
        for layer in self.model.layers:
            layer.residual_multiplier = hf_config.residual_multiplier
        self.logits_scaling = hf_config.logits_scaling
