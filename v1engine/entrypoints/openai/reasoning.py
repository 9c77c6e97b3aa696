"""Reasoning parsers (vLLM's `--reasoning-parser`): a chat reply's thinking, written between
`<think>` and `</think>`, goes to the message's `reasoning` field (vLLM's name since it followed
OpenAI's guidance; DeepSeek's was `reasoning_content`) and the rest to `content`.

Where the thinking starts:
- `deepseek_r1`: at the start of the output (DeepSeek-R1's template opens `<think>` in the prompt;
  an output that opens it again has the tag dropped);
- `qwen3`: where the output opens `<think>`, or at its start when the rendered prompt ends with
  `<think>` (templates that open the thinking themselves); otherwise the output is all content
  (e.g. Qwen3 with `enable_thinking: false`, whose template closes an empty thinking block).
It ends at the first `</think>`; without one, everything after the start is reasoning (cut by
max_tokens, say).

A request with a constraint (a JSON schema, regex, grammar or forced tool call) thinks first and
follows its grammar after `</think>` where the tokenizer spells `</think>` as one token (Qwen3's,
DeepSeek-R1's): the engine core applies the grammar from after that token (see
core/structured_output_manager.py), unless the prompt already closed the thinking (Qwen3 with
`enable_thinking: false`). With another tokenizer the grammar governs the whole output, which is
then all content.

Streaming splits each text delta the same way; text that may be the beginning of a tag is held
back until the next delta (or the end) shows whether it is one.

OpenAI's `reasoning_effort` (chat) / `reasoning.effort` (responses) reaches the chat template as
vLLM passes it: as the variable `reasoning_effort`, with `enable_thinking` false for "none" and
true otherwise (`ChatCompletionRequest.template_variables`); what templates make of it is theirs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from v1engine.engine.detokenizer import partial_stop_len
from v1engine.outputs import CompletionOutput

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def opens_thinking(parser: str, prompt: str | None) -> bool:
    """Whether the output starts inside the thinking (before any tag of its own)."""
    return parser == "deepseek_r1" or (prompt or "").rstrip().endswith(THINK_START)


def closes_thinking(prompt: str | None) -> bool:
    """Whether the prompt ends with the thinking closed (an empty block, thinking turned off)."""
    return (prompt or "").rstrip().endswith(THINK_END)


def think_end_token_id(tokenizer: Any) -> int | None:
    """The id of `</think>` where the tokenizer spells it as one token, else None."""
    token_ids = tokenizer.encode(THINK_END, add_special_tokens=False)
    return token_ids[0] if len(token_ids) == 1 else None


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """`(reasoning or None, content)` of a whole output; `opened`: see `opens_thinking`."""
    stream = ReasoningStream(opened)
    reasoning, content = stream.feed(text, finished=True)
    return (reasoning if stream.reasoned else None), content


@dataclass
class ReasoningStream:
    """One choice's deltas, split as they come: `feed` returns `(reasoning, content)` deltas."""

    opened: bool  # the output starts inside the thinking
    state: str = "start"  # "start" (undecided), "reasoning", "content"
    held: str = ""  # text that may be the beginning of a tag
    reasoned: bool = False  # a reasoning phase was entered

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        reasoning = content = ""
        if self.state == "start":
            text = self._start(text, finished)
        if self.state == "reasoning":
            end = text.find(THINK_END)
            if end >= 0:
                reasoning, text = text[:end], text[end + len(THINK_END) :]
                self.state = "content"
            else:
                keep = 0 if finished else partial_stop_len(text, [THINK_END])
                reasoning, self.held, text = text[: len(text) - keep], text[len(text) - keep :], ""
        if self.state == "content":
            content = text
        return reasoning, content

    def _start(self, text: str, finished: bool) -> str:
        """Decides whether the output opens with `<think>`; returns the text after the tag."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            self._enter("reasoning")
            return stripped[len(THINK_START) :]
        if not finished and THINK_START.startswith(stripped):  # too short to tell yet
            self.held = text
            return ""
        self._enter("reasoning" if self.opened else "content")
        return text

    def _enter(self, state: str) -> None:
        self.state = state
        self.reasoned = self.reasoned or state == "reasoning"


def split_deltas(
    completions: list[CompletionOutput], streams: dict[int, ReasoningStream], opened: bool
) -> tuple[list[CompletionOutput], dict[int, str]]:
    """The step's completions with only their content delta as text, and each one's
    reasoning delta by index (`streams` keeps each choice's state across steps)."""
    split, reasoning = [], {}
    for completion in completions:
        stream = streams.setdefault(completion.index, ReasoningStream(opened))
        finished = completion.finish_reason is not None
        reasoning[completion.index], content = stream.feed(completion.text, finished)
        split.append(dataclasses.replace(completion, text=content))
    return split, reasoning
