"""The sampling defaults a model's creator ships in its `generation_config.json`, applied as vLLM
applies them by default (`--generation-config auto`): a request (HTTP) or an `LLM.generate` call
without sampling params takes the file's temperature, top_p, top_k, min_p and repetition_penalty
where it sets none of its own, and the file's `max_new_tokens` caps every request's output.

Only values that differ from transformers' own defaults count (vLLM reads the file's diff against
them), so a file that merely restates `top_k: 50` changes nothing. `--generation-config vllm`
ignores the file; a folder path reads that folder's file instead of the model's.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from v1engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1engine.config import ModelConfig

FILE_NAME = "generation_config.json"
# The file's key -> (our SamplingParams field, transformers' GenerationConfig default).
_FIELDS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}


def load_sampling_defaults(source: str, model: str | None) -> dict[str, Any]:
    """SamplingParams field -> the recommended value, from `source`: "auto" (the file of
    `model`, an HF directory or a GGUF file's cached conversion), "vllm" (none), or a folder
    holding the file. Empty where the model has no such file.

    Raises:
        ValueError: `source` is a folder without the file, or the file is not a JSON object or
            holds a value SamplingParams refuses.
    """
    if source == "vllm" or (source == "auto" and model is None):
        return {}
    folder = os.path.expanduser(source)
    if source == "auto" and model is not None:
        from v1engine.model.hf_config import prepare_checkpoint

        folder = prepare_checkpoint(model)
    path = os.path.join(folder, FILE_NAME)
    if not os.path.isfile(path):
        if source == "auto":
            return {}
        raise ValueError(
            f"generation_config {source!r} has no {FILE_NAME}; give a folder that has one, "
            "'auto' (the model's own) or 'vllm' (none: the API's defaults)"
        )
    with open(path, encoding="utf-8") as f:
        values = json.load(f)
    if not isinstance(values, dict):
        raise ValueError(f"{path} is not a JSON object")
    defaults = {
        field: values[key]
        for key, (field, default) in _FIELDS.items()
        if values.get(key) is not None and values[key] != default
    }
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}; fix the file or pass generation_config='vllm'") from e
    return defaults


def describe(model_config: ModelConfig) -> str:
    """The log line a front end writes at start-up when the model overrides the defaults."""
    defaults = model_config.sampling_defaults
    settings = ", ".join(f"{name}={value}" for name, value in sorted(defaults.items()))
    source = model_config.generation_config
    where = "the model's" if source == "auto" else os.path.join(source, "")
    return (
        f"sampling defaults from {where}{FILE_NAME}: {settings} (for requests that set none "
        "of their own; --generation-config vllm ignores the file)"
    )
