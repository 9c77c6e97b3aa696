"""What every mixture-of-experts causal LM here shares (Qwen3-MoE, Qwen2-MoE, Mixtral): which
layers are sparse, and how a checkpoint's expert tensors, kept apart per expert
(`<layer>.<block>.experts.<e>.<projection>.weight`), load into a layer's stacked experts
(`layers/fused_moe.SparseMoeBlock`, always the layer's `mlp` here)."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from v1engine.model.layers.fused_moe import EXPERT_PROJECTIONS, SparseMoeBlock
from v1engine.model.models.llama import LlamaMLP
from v1engine.model.weight_utils import WeightSource, default_weight_loader


def num_experts(config: Any) -> int:
    # Qwen's config.json says `num_experts`, Mixtral's `num_local_experts` (and transformers 5
    # writes Qwen3-MoE's that way too).
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Qwen's rule (Mixtral's configs have neither key: every layer is sparse): every
    `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        num_experts(config) > 0
        and layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and (layer_idx + 1) % step == 0
    )


def qwen_moe_mlp(config: Any, layer_idx: int, shared_expert: bool = False) -> nn.Module:
    """A Qwen MoE layer's MLP: a dense one of `intermediate_size` where `is_sparse_layer` says
    not, else `num_experts` experts of `moe_intermediate_size` (and with `shared_expert`,
    Qwen2-MoE's, a dense one of `shared_expert_intermediate_size` besides)."""
    if not is_sparse_layer(config, layer_idx):
        return LlamaMLP(config)
    return SparseMoeBlock(
        config.hidden_size,
        config.moe_intermediate_size,
        num_experts(config),
        config.num_experts_per_tok,
        renormalize=config.norm_topk_prob,
        shared_expert=(
            LlamaMLP(config, config.shared_expert_intermediate_size) if shared_expert else None
        ),
    )


class MoeCheckpointMixin:
    """Mixed into a LlamaForCausalLM subclass whose sparse layers' `mlp` is a SparseMoeBlock."""

    supports_cuda_graphs = False  # which experts run depends on the tokens
    moe_block = "mlp"  # the checkpoint's name of a layer's MoE module (Mixtral's differs)
    # The checkpoint's name of each expert projection -> EXPERT_PROJECTIONS' (Mixtral's differ).
    expert_projections = {name: name for name in EXPERT_PROJECTIONS}

    def load_special_weight(self, name: str, loaded: WeightSource) -> bool:
        block = re.escape(self.moe_block)
        match = re.fullmatch(rf"(.+)\.{block}\.(?:gate|experts\.(\d+)\.(\w+))\.weight", name)
        if match is None:
            return False
        moe = self.get_submodule(f"{match.group(1)}.mlp")
        expert, projection = match.group(2), self.expert_projections.get(match.group(3) or "")
        if not isinstance(moe, SparseMoeBlock) or (
            expert is not None and (projection is None or int(expert) >= moe.num_experts)
        ):
            raise ValueError(
                f"checkpoint tensor {name!r} names an expert or router the model does not have; "
                "the checkpoint does not match its config.json"
            )
        if expert is None:
            default_weight_loader(moe.gate.weight, loaded)  # the router
        else:
            moe.load_expert_weight(int(expert), projection, loaded)
        return True

    def expected_checkpoint_names(self) -> list[str]:
        ours, theirs = set(), []
        for prefix, module in self.named_modules():
            if isinstance(module, SparseMoeBlock):
                ours |= {f"{prefix}.w13", f"{prefix}.w2", f"{prefix}.gate.weight"}
                stored = f"{prefix.removesuffix('.mlp')}.{self.moe_block}"
                theirs.append(f"{stored}.gate.weight")
                theirs += [
                    f"{stored}.experts.{expert}.{projection}.weight"
                    for expert in range(module.num_experts)
                    for projection in self.expert_projections
                ]
        return [n for n in super().expected_checkpoint_names() if n not in ours] + theirs
