"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): Llama whose checkpoints store q/k/v fused as
`qkv_proj` and gate/up as `gate_up_proj` (our own fused parameters' names: each tensor is split
into the shards our loaders take), with longrope (its short factors: served up to the original
context, `original_max_position_embeddings`) and, in Phi-4-mini, RoPE over the first
`partial_rotary_factor` of each head."""

from __future__ import annotations

from v1engine.model.models.llama import LlamaForCausalLM, get_head_size
from v1engine.model.weight_utils import WeightSource, narrow_weight


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_special_weight(self, name: str, loaded: WeightSource) -> bool:
        config = self.config
        if name.endswith(".self_attn.qkv_proj.weight"):
            head_size = get_head_size(config)
            q, kv = config.num_attention_heads * head_size, config.num_key_value_heads * head_size
            parts = [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
        elif name.endswith(".mlp.gate_up_proj.weight"):
            size = config.intermediate_size
            parts = [(0, 0, size), (1, size, size)]
        else:
            return False
        param = self.get_parameter(name)
        for shard_id, start, size in parts:
            param.weight_loader(param, narrow_weight(loaded, 0, start, size), shard_id)
        return True

    def expected_checkpoint_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters()]  # fused as ours are
