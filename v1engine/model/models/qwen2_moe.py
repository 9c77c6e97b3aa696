"""Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 whose sparse
layers (`moe.is_sparse_layer`) add to their routed experts a shared expert, a dense MLP of
`shared_expert_intermediate_size` that every token runs, weighted by a sigmoid gate."""

from __future__ import annotations

from typing import Any

from torch import nn

from v1engine.model.models.moe import MoeCheckpointMixin, qwen_moe_mlp
from v1engine.model.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(MoeCheckpointMixin, Qwen2ForCausalLM):
    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_idx, shared_expert=True)
