"""What `LLM`'s methods share about their inputs: vLLM's `use_tqdm`, and prompts and per-prompt
values given as one or as a list."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from v1engine.engine.processor import PromptType
from v1engine.outputs import RequestOutput

# vLLM's `use_tqdm`: show a progress bar or not, or a callable that makes it (e.g.
# `functools.partial(tqdm, leave=False)`), called with `total` and `desc`.
UseTqdm = bool | Callable[..., tqdm]


def progress_bar(use_tqdm: UseTqdm, total: int, desc: str) -> tqdm:
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc)
    return tqdm(total=total, desc=desc, disable=not use_tqdm)


class RequestProgress:
    """A progress bar of finished requests (`progress_bar`); for generated ones its postfix is
    vLLM's speed estimate: prompt and output tokens per second since the bar started."""

    def __init__(self, use_tqdm: UseTqdm, total: int, desc: str) -> None:
        self.bar = progress_bar(use_tqdm, total, desc)
        self.prompt_tokens = self.output_tokens = 0

    def __enter__(self) -> RequestProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def finished(self, output: Any) -> None:
        self.bar.update(1)
        if self.bar.disable or not isinstance(output, RequestOutput):
            return
        self.prompt_tokens += len(output.prompt_token_ids or ())
        self.output_tokens += sum(len(completion.token_ids) for completion in output.outputs)
        elapsed_s = max(self.bar.format_dict["elapsed"], 1e-9)
        self.bar.set_postfix_str(
            f"est. speed input: {self.prompt_tokens / elapsed_s:.2f} toks/s, "
            f"output: {self.output_tokens / elapsed_s:.2f} toks/s",
            refresh=False,
        )


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
