"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B, and smaller ones): Qwen3
whose sparse layers (`moe.is_sparse_layer`) route each token to `num_experts_per_tok` of
`num_experts` experts of `moe_intermediate_size` (`layers/fused_moe.py`); the others keep a dense
MLP of `intermediate_size`."""

from __future__ import annotations

from typing import Any

from torch import nn

from v1engine.model.models.moe import MoeCheckpointMixin, qwen_moe_mlp
from v1engine.model.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoeCheckpointMixin, Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_idx)
