"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B, and smaller ones): Qwen3
whose MLPs are sparse mixtures of experts (`layers/fused_moe.py`): every
`decoder_sparse_step`-th layer not in `mlp_only_layers` routes each token to
`num_experts_per_tok` of `num_experts` experts of `moe_intermediate_size`; the others keep a dense
MLP of `intermediate_size`. A checkpoint holds each expert's projections apart
(`mlp.experts.<e>.gate_proj.weight`, ...); they are stacked per layer as they load."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from v1engine.model.layers.fused_moe import EXPERT_PROJECTIONS, SparseMoeBlock
from v1engine.model.models.llama import LlamaMLP
from v1engine.model.models.qwen3 import Qwen3ForCausalLM
from v1engine.model.weight_utils import WeightSource

_EXPERT_TENSOR = re.compile(r"(.+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _num_experts(config: Any) -> int:
    # transformers 5 writes config.json's `num_experts` as `num_local_experts`.
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)


def _is_sparse(config: Any, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        _num_experts(config) > 0
        and layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and (layer_idx + 1) % step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    supports_cuda_graphs = False  # which experts run depends on the tokens

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        if not _is_sparse(config, layer_idx):
            return LlamaMLP(config)
        return SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            _num_experts(config),
            config.num_experts_per_tok,
            renormalize=config.norm_topk_prob,
        )

    def load_special_weight(self, name: str, loaded: WeightSource) -> bool:
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            return False
        block = self.get_submodule(match.group(1))
        expert = int(match.group(2))
        if not isinstance(block, SparseMoeBlock) or expert >= block.num_experts:
            raise ValueError(
                f"checkpoint tensor {name!r} names an expert the model does not have; the "
                "checkpoint does not match its config.json"
            )
        block.load_expert_weight(expert, match.group(3), loaded)
        return True

    def expected_checkpoint_names(self) -> list[str]:
        names = [n for n in super().expected_checkpoint_names() if not n.endswith((".w13", ".w2"))]
        for prefix, module in self.named_modules():
            if isinstance(module, SparseMoeBlock):
                names += [
                    f"{prefix}.experts.{expert}.{projection}.weight"
                    for expert in range(module.num_experts)
                    for projection in EXPERT_PROJECTIONS
                ]
        return names
