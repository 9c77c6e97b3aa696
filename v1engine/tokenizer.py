"""The model's tokenizer, loaded from disk (never from a hub): the front end's, and the engine
core's for structured outputs (so both packages import it from here, a leaf)."""

from __future__ import annotations

from typing import Any

from v1engine.config import ModelConfig


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The tokenizer of `model_config.tokenizer`, else of the model (a GGUF file's tokenizer
    comes from its cached conversion).

    Raises:
        ValueError: the checkpoint has no tokenizer files; pass `skip_tokenizer_init=True` and
            token-id prompts, or point `tokenizer` at a directory that has one.
    """
    from transformers import AutoTokenizer

    from v1engine.model.hf_config import prepare_checkpoint

    source = model_config.tokenizer or model_config.model
    if source is None:
        raise ValueError("no model and no tokenizer configured; set model= or tokenizer=")
    path = prepare_checkpoint(source)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"cannot load a tokenizer from {path!r} ({e}); give tokenizer=<dir with tokenizer "
            "files>, or skip_tokenizer_init=True with token-id prompts"
        ) from e


def eos_token_id(tokenizer: Any, hf_config: Any) -> int | None:
    """The id that ends generation: the tokenizer's, else the model config's (first if many)."""
    token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if token_id is None:
        token_id = getattr(hf_config, "eos_token_id", None)
    if isinstance(token_id, (list, tuple)):
        token_id = token_id[0] if token_id else None
    return token_id
