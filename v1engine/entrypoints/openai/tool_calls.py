"""Tool calls without a parser, as vLLM makes them: `tool_choice` "required" or a named function
constrains the output to the tools' JSON schemas, and the output is read back as tool calls.

"required": a JSON array of `{"name": <a tool's name>, "parameters": <its arguments>}` (at most
one item when `parallel_tool_calls` is false); a named function: its arguments object. "none"
leaves the output free; "auto" leaves it free too and needs the server's tool-call parser
(`--enable-auto-tool-choice --tool-call-parser hermes`, see tool_parsers.py) to find the calls
in the text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.forced_calls import ForcedCall, ForcedCallReader, new_call_id
from v1engine.entrypoints.openai.protocol import ChatCompletionRequest, ChatDelta, ChatStreamChoice
from v1engine.entrypoints.openai.protocol_structured import (
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from v1engine.entrypoints.openai.serving_options import ServingOptions
from v1engine.entrypoints.openai.structured import Constraint
from v1engine.entrypoints.openai.tool_parser_mistral import MistralCallReader
from v1engine.entrypoints.openai.tool_parser_qwen3_coder import Qwen3CoderCallReader, Schemas
from v1engine.entrypoints.openai.tool_parsers import (
    CALL_IDS,
    TOOL_CALL_PARSERS,
    GraniteCallReader,
    HermesCallReader,
    LeadingCallReader,
    Llama3JsonCallReader,
    Phi4MiniJsonCallReader,
    PythonicCallReader,
    content_end,
)
from v1engine.outputs import CompletionOutput

# vLLM's answer to "auto" when the server runs without a parser.
AUTO_NEEDS_PARSER = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
# Any parameters at all, for a function that declares none.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolMode:
    """How a chat request's tools shape its output: `constraint` for "required" and a named
    function (`named`: its name), none for "auto", whose calls `parser` finds in the text."""

    constraint: Constraint | None
    named: str | None = None
    parser: str | None = None
    # "auto": each function's parameter schema, for the parsers that type values by it.
    schemas: Schemas = field(default_factory=dict)


def tool_mode(request: ChatCompletionRequest, options: ServingOptions) -> ToolMode | None:
    """The request's ToolMode, or None when its output is free text.

    Raises:
        APIError: 400 for "auto" without the server's parser, a tool_choice without tools, or
            an unknown function name.
    """
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if request.tools else "none"
    if choice == "none":
        return None
    if not request.tools:
        raise APIError(f"tool_choice {_describe(choice)} needs tools", param="tool_choice")
    schemas = {t.function.name: t.function.parameters or _ANY_OBJECT for t in request.tools}
    if choice == "auto":
        if options.tool_call_parser is None:
            raise APIError(AUTO_NEEDS_PARSER, param="tool_choice")
        return ToolMode(None, parser=options.tool_call_parser, schemas=schemas)
    whitespace = {"disable_any_whitespace": options.disable_any_whitespace}
    if choice == "required":
        schema = _required_schema(schemas, request.parallel_tool_calls)
        return ToolMode(("tool_choice", {"json": schema, **whitespace}))
    name = choice.function.name
    if name not in schemas:
        raise APIError(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(map(repr, schemas))})",
            param="tool_choice",
        )
    return ToolMode(("tool_choice", {"json": schemas[name], **whitespace}), name)


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _required_schema(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in schemas.items()
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return array


def parse_tool_calls(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]] | None:
    """`(content, tool calls)` of a finished output, or None when it holds no calls (none the
    parser finds, for "auto"; no call named yet, for the forced choices): then it is all
    content. A forced call cut by max_tokens keeps the arguments written so far, as OpenAI
    returns them."""
    if mode.parser is not None:
        content, calls = TOOL_CALL_PARSERS[mode.parser](text, mode.schemas)
        if not calls:
            return None
        call_id = CALL_IDS.get(mode.parser, new_call_id)
        tool_calls = [_tool_call(call_id(), name, arguments) for name, arguments in calls]
        return content, tool_calls
    reader = ForcedCallReader(mode.named)
    reader.feed(text)
    return (None, _tool_calls(reader.calls)) if reader.calls else None


class ToolCallStream:
    """One choice's reply streamed under a tool mode: `feed` returns the content that may go out
    now and the tool-call deltas. With a parser: the content that is surely not a call (see
    `tool_parsers.content_end`) and the calls as they are written (`_STREAMED_READERS`). Forced
    calls: each call's head as soon as its name is written, then its arguments as they come
    (`forced_calls.py`). A reply that named no call ends as content; a call already streamed
    stays sent even if the rest of the reply turns out malformed."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.num_sent = 0  # text[:num_sent] went out as content
        self.calls: list[ToolCall] = []
        self._reader: CallReader = (
            ForcedCallReader(mode.named)
            if mode.parser is None
            else _STREAMED_READERS[mode.parser](mode.schemas)
        )

    def feed(self, delta: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        deltas = _piece_deltas(self._reader.feed(delta))
        # A forced reply is calls from its first character; a parser's is content up to where
        # a call may begin.
        end = 0 if self.mode.parser is None else content_end(self.mode.parser, self.text)
        if finished:
            if self.mode.parser is not None:
                deltas += self._fill_missing_arguments()
            self.calls = _tool_calls(self._reader.calls)
            if not self.calls:
                end = len(self.text)  # the reply held no call: it is all content
        content = self.text[self.num_sent : end]
        self.num_sent = max(self.num_sent, end)
        return content, deltas

    def _fill_missing_arguments(self) -> list[DeltaToolCall]:
        """A parsed call written without arguments gets `{}`, as the whole reply's parse reads
        it (a forced call cut by max_tokens keeps what was written, even nothing)."""
        deltas = []
        for index, call in enumerate(self._reader.calls):
            if not call.arguments:
                call.arguments = "{}"
                deltas += _call_deltas(index, None, call.arguments)
        return deltas


# What reads a reply's calls while it is written: `feed(delta)` returns the new pieces and
# `calls` the calls so far (forced_calls.ForcedCallReader, or a parser's reader).
CallReader = (
    ForcedCallReader
    | HermesCallReader
    | LeadingCallReader
    | MistralCallReader
    | PythonicCallReader
    | Qwen3CoderCallReader
)
# Each parser's reader.
_STREAMED_READERS: dict[str, Callable[[Schemas], CallReader]] = {
    "granite": lambda _: GraniteCallReader(),
    "hermes": lambda _: HermesCallReader(),
    "llama3_json": lambda _: Llama3JsonCallReader(),
    "mistral": lambda _: MistralCallReader(),
    "phi4_mini_json": lambda _: Phi4MiniJsonCallReader(),
    "pythonic": lambda _: PythonicCallReader(),
    "qwen3_coder": Qwen3CoderCallReader,  # types the values by the request's schemas
}


def _piece_deltas(pieces: list[tuple[int, ForcedCall | None, str]]) -> list[DeltaToolCall]:
    """The deltas of a call reader's pieces (`ForcedCallReader.feed`)."""
    deltas = []
    for index, new, arguments in pieces:
        head = None if new is None else (new.id, new.name)
        deltas += _call_deltas(index, head, arguments)
    return deltas


def tool_stream_choices(
    completions: list[CompletionOutput], mode: ToolMode, streams: dict[int, ToolCallStream]
) -> list[ChatStreamChoice]:
    """Per choice: its content as soon as it is surely not a call and its tool-call deltas as
    they come (`ToolCallStream`), then its finish. Each goes in its own chunk."""
    choices = []
    for output in completions:
        index = output.index
        stream = streams.setdefault(index, ToolCallStream(mode))
        finished = output.finish_reason is not None
        content, call_deltas = stream.feed(output.text, finished)
        if content:
            choices.append(ChatStreamChoice(index=index, delta=ChatDelta(content=content)))
        choices.extend(
            ChatStreamChoice(index=index, delta=ChatDelta(tool_calls=[call_delta]))
            for call_delta in call_deltas
        )
        if not finished:
            continue
        reason = calls_finish_reason(output) if stream.calls else output.finish_reason
        finish = ChatStreamChoice(
            index=index, delta=ChatDelta(), finish_reason=reason, stop_reason=output.stop_reason
        )
        choices.append(finish)
    return choices


def calls_finish_reason(output: CompletionOutput) -> str:
    """A reply with tool calls ends with "tool_calls", or "length" where max_tokens cut it (its
    last call's arguments are then incomplete), as OpenAI says."""
    return "length" if output.finish_reason == "length" else "tool_calls"


def tool_call_deltas(calls: list[ToolCall]) -> list[DeltaToolCall]:
    """Streamed as OpenAI streams calls: per call, a delta with its id, type and name, then its
    arguments (whose deltas, concatenated, are the call's arguments)."""
    deltas = []
    for index, call in enumerate(calls):
        deltas += _call_deltas(index, (call.id, call.function.name), call.function.arguments)
    return deltas


def _call_deltas(index: int, head: tuple[str, str] | None, arguments: str) -> list[DeltaToolCall]:
    """Call `index`'s deltas: its head (`(id, name)`, when it starts here), then `arguments`."""
    deltas = []
    if head is not None:
        name = DeltaFunctionCall(name=head[1], arguments="")
        deltas.append(DeltaToolCall(index=index, id=head[0], type="function", function=name))
    if arguments:
        deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments)))
    return deltas


def _tool_call(call_id: str, name: str, arguments: str) -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))


def _tool_calls(calls: list[ForcedCall]) -> list[ToolCall]:
    return [_tool_call(c.id, c.name, c.arguments) for c in calls]


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as the chat template's `tools` variable."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def decoded_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier assistant turn's tool call with its JSON arguments decoded to an object, as
    chat templates iterate them (left as sent when they are not JSON)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
