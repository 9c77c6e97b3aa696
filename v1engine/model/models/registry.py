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
    "Gemma2ForCausalLM": "v1engine.model.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "v1engine.model.models.gemma3:Gemma3ForCausalLM",
    "GPT2LMHeadModel": "v1engine.model.models.gpt2:GPT2LMHeadModel",
    "GPTNeoXForCausalLM": "v1engine.model.models.gpt_neox:GPTNeoXForCausalLM",
    "GraniteForCausalLM": "v1engine.model.models.granite:GraniteForCausalLM",
    "LlamaForCausalLM": "v1engine.model.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "v1engine.model.models.mistral:MistralForCausalLM",
    "MixtralForCausalLM": "v1engine.model.models.mixtral:MixtralForCausalLM",
    "Olmo2ForCausalLM": "v1engine.model.models.olmo2:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": "v1engine.model.models.olmo2:Olmo3ForCausalLM",
    "Phi3ForCausalLM": "v1engine.model.models.phi3:Phi3ForCausalLM",
    "PhiForCausalLM": "v1engine.model.models.phi:PhiForCausalLM",
    "Qwen2ForCausalLM": "v1engine.model.models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "v1engine.model.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "v1engine.model.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "v1engine.model.models.qwen3_moe:Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM": "v1engine.model.models.smollm3:SmolLM3ForCausalLM",
    "Starcoder2ForCausalLM": "v1engine.model.models.starcoder2:Starcoder2ForCausalLM",
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

# Sequence classifiers (transformers' AutoModelForSequenceClassification: `model.*` tensors and a
# `score` head of [num_labels, hidden_size]), which classify only (--runner pooling, task
# "classify"): each runs as its family's causal class, headless as a base model, with the
# `score` head added by `load_model`.
_CLASSIFIERS = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
_HEADLESS = _BASE_MODELS | _CLASSIFIERS

# GGUF metadata carries a model_type but no `architectures`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS | _HEADLESS)


def is_base_model(architecture: str) -> bool:
    """Whether the architecture is a base model: no LM head, no `model.` prefix (it embeds)."""
    return architecture in _BASE_MODELS


def is_classifier(architecture: str) -> bool:
    """Whether the architecture is a sequence classifier (it classifies)."""
    return architecture in _CLASSIFIERS


def has_lm_head(architecture: str) -> bool:
    """Whether the architecture has an LM head (it can generate)."""
    return architecture not in _HEADLESS


def architecture_for_model_type(model_type: str | None) -> str | None:
    return _MODEL_TYPE_TO_ARCH.get(model_type or "")


def check_architecture(architecture: str) -> None:
    if architecture not in _MODELS and architecture not in _HEADLESS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported architectures: "
            f"{supported_architectures()}"
        )


def get_model_class(architecture: str) -> type[nn.Module]:
    check_architecture(architecture)
    module_name, class_name = _MODELS[_HEADLESS.get(architecture, architecture)].split(":")
    return getattr(importlib.import_module(module_name), class_name)
