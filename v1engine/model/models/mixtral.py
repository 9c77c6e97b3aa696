"""Mixtral (`MixtralForCausalLM`: Mixtral 8x7B, 8x22B): Mistral whose every MLP is a mixture of
`num_local_experts` experts, the top `num_experts_per_tok` per token, their softmax weights
renormalized over those. Its checkpoints name the block `block_sparse_moe` and an expert's
projections `w1` (gate), `w3` (up) and `w2` (down)."""

from __future__ import annotations

from typing import Any

from torch import nn

from v1engine.model.layers.fused_moe import SparseMoeBlock
from v1engine.model.models.mistral import MistralForCausalLM
from v1engine.model.models.moe import MoeCheckpointMixin, num_experts


class MixtralForCausalLM(MoeCheckpointMixin, MistralForCausalLM):
    moe_block = "block_sparse_moe"
    expert_projections = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            num_experts(config),
            config.num_experts_per_tok,
            renormalize=True,
        )
