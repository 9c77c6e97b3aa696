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


def load_sampling_defaults(
    source: str, model: str | None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams field -> the recommended value, from `source`: "auto" (the file of
    `model`, an HF directory or a GGUF file's cached conversion), "vllm" (none), or a folder
    holding the file (empty where there is no file), with `overrides` (the file's keys, vLLM's
    --override-generation-config) set over it, whatever their value.

    Raises:
        ValueError: `source` is a folder without the file, the file is not a JSON object, an
            override key is not one of the file's sampling keys, or a value is one
            SamplingParams refuses.
    """
    unknown = sorted(set(overrides or {}) - _FIELDS.keys())
    if unknown:
        raise ValueError(
            f"override_generation_config keys {unknown} are not generation_config.json "
            f"sampling keys; use {', '.join(_FIELDS)}"
        )
    defaults = _file_defaults(source, model)
    if overrides:
        defaults.update({_FIELDS[key][0]: value for key, value in overrides.items()})
        _check(defaults, "override_generation_config", "fix the override")
    return defaults


def _check(defaults: dict[str, Any], where: str, fix: str) -> None:
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}; {fix}") from e


def _file_defaults(source: str, model: str | None) -> dict[str, Any]:
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
    _check(defaults, path, "fix the file or pass generation_config='vllm'")
    return defaults


def describe(model_config: ModelConfig) -> str:
    """The log line a front end writes at start-up when the model overrides the defaults."""
    defaults = model_config.sampling_defaults
    settings = ", ".join(f"{name}={value}" for name, value in sorted(defaults.items()))
    source = model_config.generation_config
    where = "the model's" if source == "auto" else os.path.join(source, "")
    if model_config.override_generation_config:
        where = f"--override-generation-config over {where}"
    return (
        f"sampling defaults from {where}{FILE_NAME}: {settings} (for requests that set none "
        "of their own; --generation-config vllm ignores the file)"
    )
