"""Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 whose sparse
layers (`moe.is_sparse_layer`) add to their routed experts a shared expert, a dense MLP of
`shared_expert_intermediate_size` that every token runs, weighted by a sigmoid gate."""

from __future__ import annotations

from typing import Any

from torch import nn

from v1engine.model.layers.fused_moe import SparseMoeBlock
from v1engine.model.models.llama import LlamaMLP
from v1engine.model.models.moe import MoeCheckpointMixin, is_sparse_layer, num_experts
from v1engine.model.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(MoeCheckpointMixin, Qwen2ForCausalLM):
    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config)
        return SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            num_experts(config),
            config.num_experts_per_tok,
            renormalize=config.norm_topk_prob,
            shared_expert=LlamaMLP(config, config.shared_expert_intermediate_size),
        )
