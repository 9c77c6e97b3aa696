"""The model's tokenizer, loaded from disk (never from a hub): the front end's, and the engine
core's for structured outputs (so both packages import it from here, a leaf)."""

from __future__ import annotations

import importlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from v1engine.config import ModelConfig
from v1engine.process import ENGINE_CORE_STARTUP_TIMEOUT_S


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The tokenizer of `model_config.tokenizer`, else of the model (a GGUF file's tokenizer
    comes from its cached conversion).

    Raises:
        ValueError: the checkpoint has no tokenizer files; pass `skip_tokenizer_init=True` and
            token-id prompts, or point `tokenizer` at a directory that has one. Or its tokenizer
            class is its own code and `trust_remote_code` is off.
    """
    from transformers import AutoTokenizer

    from v1engine.model.hf_config import prepare_checkpoint, untrusted_code_error

    source = model_config.tokenizer or model_config.model
    if source is None:
        raise ValueError("no model and no tokenizer configured; set model= or tokenizer=")
    path = prepare_checkpoint(source)
    config = _stand_in_config(path, model_config) if source == model_config.model else None
    try:
        return AutoTokenizer.from_pretrained(
            path,
            local_files_only=True,
            config=config,
            trust_remote_code=model_config.trust_remote_code,
        )
    except (OSError, ValueError, TypeError) as e:
        if not model_config.trust_remote_code and "trust_remote_code" in str(e):
            raise untrusted_code_error(path, "tokenizer class") from None
        raise ValueError(
            f"cannot load a tokenizer from {path!r} ({e}); give tokenizer=<dir with tokenizer "
            "files>, or skip_tokenizer_init=True with token-id prompts"
        ) from e


def _stand_in_config(path: str, model_config: ModelConfig) -> Any:
    """What AutoTokenizer needs of the model's transformers config, built from the config we
    already read, when `tokenizer_config.json` names the tokenizer class: AutoTokenizer would
    otherwise import the model's config class only to look at its type, and that import pulls
    in transformers' modeling stack (1 of the 3 s the default model's tokenizer took). None
    (AutoTokenizer reads the config itself) when the class comes from the config."""
    from transformers import PretrainedConfig

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            declares_class = bool(json.load(f).get("tokenizer_class"))
    except (OSError, ValueError, AttributeError):
        return None
    hf_config = model_config.hf_config
    if not declares_class or hf_config is None:
        return None
    config = PretrainedConfig(**vars(hf_config))
    config.model_type = getattr(hf_config, "model_type", "")  # a class attribute otherwise
    config._name_or_path = path
    return config


class BackgroundTokenizerLoad:
    """`load_tokenizer` on a thread, so that its seconds of transformers imports overlap the
    engine's start-up (the caller mostly waits on its workers then). Use as a context manager:
    leaving it waits for a load still running, so no thread outlives the caller's start-up.

    Args:
        model_config: whose tokenizer to load.
        skip: load nothing; `result()` returns None (`skip_tokenizer_init`).
        preload: a module the thread imports first (the HTTP server's app, so its imports overlap
            the start-up too). The thread then imports transformers as well: with `preload` the
            caller promises that its own thread imports nothing meanwhile (the server's thread
            only waits for the engine core's process).
    """

    def __init__(
        self, model_config: ModelConfig, skip: bool = False, preload: str | None = None
    ) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="v1engine-tokenizer")
        self._future = None
        if skip:
            return
        if preload is None:
            # The package itself is imported here, not on the thread: code on this thread may
            # run `from transformers import ...` meanwhile (xgrammar did, at the engine core's
            # import), and a thread that finds the package half-initialized by another gets an
            # ImportError. Its submodules, the seconds, import safely on either thread.
            import transformers  # noqa: F401

        self._future = self._pool.submit(_import_then_load, preload, model_config)

    def result(self) -> Any:
        """The tokenizer (None when skipped); raises what `load_tokenizer` raised."""
        if self._future is None:
            return None
        # A local load, which ran while the engine started: the engine's start-up bound is ample.
        try:
            return self._future.result(timeout=ENGINE_CORE_STARTUP_TIMEOUT_S)
        except FutureTimeoutError:
            raise RuntimeError(
                f"the tokenizer did not load within {ENGINE_CORE_STARTUP_TIMEOUT_S:.0f} s"
            ) from None

    def __enter__(self) -> BackgroundTokenizerLoad:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(cancel_futures=True)


def eos_token_id(tokenizer: Any, hf_config: Any) -> int | None:
    """The id that ends generation: the tokenizer's, else the model config's (first if many)."""
    token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if token_id is None:
        token_id = getattr(hf_config, "eos_token_id", None)
    if isinstance(token_id, (list, tuple)):
        token_id = token_id[0] if token_id else None
    return token_id


def _import_then_load(module: str | None, model_config: ModelConfig) -> Any:
    if module is not None:
        importlib.import_module(module)
    return load_tokenizer(model_config)
