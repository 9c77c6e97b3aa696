"""SmolLM3: Llama whose layers listed as 0 in `no_rope_layers` (every fourth, by default) use no
position embedding at all (NoPE): their queries and keys attend unrotated. Those layers keep a
decode step off the CPU decoder stack, which rotates in every layer."""

from __future__ import annotations

from typing import Any

from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM


class SmolLM3Attention(LlamaAttention):
    @staticmethod
    def uses_rope(config: Any, layer_idx: int) -> bool:
        return bool(config.no_rope_layers[layer_idx])


class SmolLM3ForCausalLM(LlamaForCausalLM):
    attention_cls = SmolLM3Attention
