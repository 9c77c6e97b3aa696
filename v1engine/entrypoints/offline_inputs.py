"""What `LLM`'s methods share about their inputs: vLLM's `use_tqdm`, and prompts and per-prompt
values given as one or as a list."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from v1engine.engine.processor import PromptType

# vLLM's `use_tqdm`: show a progress bar or not, or a callable that makes it (e.g.
# `functools.partial(tqdm, leave=False)`), called with `total` and `desc`.
UseTqdm = bool | Callable[..., tqdm]


def progress_bar(use_tqdm: UseTqdm, total: int, desc: str) -> tqdm:
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc)
    return tqdm(total=total, desc=desc, disable=not use_tqdm)


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a text, a dict, or token ids) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def per_prompt(values: Any, single: type | tuple, num_prompts: int, what: str) -> list[Any]:
    """One value per prompt: `values` repeated when it is one `single`, else the list, which
    must hold one per prompt."""
    if isinstance(values, single):
        return [values] * num_prompts
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {what} for {num_prompts} prompts")
    return list(values)
