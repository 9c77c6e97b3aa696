"""Mistral: Llama with sliding-window attention.

Nothing to override: `get_sliding_window` in llama.py already gives each layer's `Attention` the
config's `sliding_window` (Mistral applies it to every layer), and the attention backends mask
keys older than the window.
"""

from __future__ import annotations

from v1engine.model.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
