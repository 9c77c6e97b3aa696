"""Supported architectures, keyed by the name in a checkpoint's config.json `architectures`.

Entries are import paths so that reading the registry (e.g. while validating a config in the
engine process) does not import the models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

_MODELS = {
    "LlamaForCausalLM": "v1engine.model.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "v1engine.model.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "v1engine.model.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "v1engine.model.models.qwen3:Qwen3ForCausalLM",
}

# Base models (transformers' AutoModel: no LM head, tensor names without "model."), which serve
# embeddings only (--runner pooling): each runs as its family's causal class, the LM head tied to
# the embedding so that it costs nothing (see `load_model`).
_BASE_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}

# GGUF metadata carries a model_type but no `architectures`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS | _BASE_MODELS)


def is_base_model(architecture: str) -> bool:
    """Whether the architecture has no LM head (it can embed, not generate)."""
    return architecture in _BASE_MODELS


def architecture_for_model_type(model_type: str | None) -> str | None:
    return _MODEL_TYPE_TO_ARCH.get(model_type or "")


def check_architecture(architecture: str) -> None:
    if architecture not in _MODELS and architecture not in _BASE_MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported architectures: "
            f"{supported_architectures()}"
        )


def get_model_class(architecture: str) -> type[nn.Module]:
    check_architecture(architecture)
    module_name, class_name = _MODELS[_BASE_MODELS.get(architecture, architecture)].split(":")
    return getattr(importlib.import_module(module_name), class_name)
