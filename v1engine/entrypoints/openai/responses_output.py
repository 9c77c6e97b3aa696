"""A chat reply as a Responses API response: its reasoning, text and tool calls become output
items, and, when streamed, the Responses API's events.

`ResponseBuilder` takes the reply in pieces (a streamed chat's deltas, or a whole reply as one
piece), so that a response is built one way whether or not it streams. Events follow OpenAI's
order: `response.created`, `response.in_progress`; per output item `output_item.added`, its
content part's `added`, the deltas, the `done`s; and `response.completed` (or
`response.incomplete` when `max_output_tokens` cut the reply), each numbered by
`sequence_number`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel

from v1engine.entrypoints.openai.protocol import (
    ChatChoice,
    ChatStreamChoice,
    ChatTokenLogprob,
    UsageInfo,
)
from v1engine.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponsesResponse,
    ResponseUsage,
)
from v1engine.entrypoints.openai.protocol_structured import DeltaToolCall
from v1engine.entrypoints.openai.tool_calls import tool_call_deltas


class ResponseBuilder:
    """Builds `response`'s output from the reply's pieces, and the events that stream them
    (kept only when `streaming`; `take_events` hands them over as server-sent events)."""

    def __init__(self, response: ResponsesResponse, streaming: bool, logprobs: bool) -> None:
        self.response = response
        self.streaming = streaming
        self.logprobs = logprobs  # whether the output text carries its tokens' logprobs
        self._events: list[str] = []
        self._sequence_number = 0
        self._open: OutputItem | None = None  # the item the next delta of its kind extends

    def take_events(self) -> list[str]:
        events, self._events = self._events, []
        return events

    def start(self) -> None:
        self._emit("response.created", response=self.response)
        self._emit("response.in_progress", response=self.response)

    def add_stream_choice(self, choice: ChatStreamChoice) -> None:
        """One streamed chat delta."""
        delta = choice.delta
        logprobs = choice.logprobs and choice.logprobs.content
        self._add(delta.reasoning, delta.content, logprobs, delta.tool_calls or [])

    def add_choice(self, choice: ChatChoice) -> None:
        """A whole chat reply: one delta holding all of it."""
        message = choice.message
        logprobs = choice.logprobs and choice.logprobs.content
        calls = tool_call_deltas(message.tool_calls)
        self._add(message.reasoning, message.content, logprobs, calls)

    def _add(
        self,
        reasoning: str | None,
        content: str | None,
        logprobs: list[ChatTokenLogprob] | None,
        calls: list[DeltaToolCall],
    ) -> None:
        if reasoning:
            self.add_reasoning(reasoning)
        if content:
            self.add_text(content, logprobs)
        for call in calls:  # a call's head (with its id), then pieces of its arguments
            if call.id is not None:
                self.add_call(call.id, call.function.name or "")
            if call.function.arguments:
                self.add_arguments(call.function.arguments)

    def add_reasoning(self, delta: str) -> None:
        item = self._open
        if not isinstance(item, ReasoningItem):
            item = self._open_item(ReasoningItem(id=_item_id("rs"), status="in_progress"))
            item.content.append(ReasoningText(text=""))
            self._emit_part("response.content_part.added", item, item.content[0])
        item.content[0].text += delta
        self._emit("response.reasoning_text.delta", **self._at(item), content_index=0, delta=delta)

    def add_text(self, delta: str, logprobs: list[ChatTokenLogprob] | None) -> None:
        item = self._open if isinstance(self._open, MessageItem) else self._open_message()
        part = item.content[0]
        part.text += delta
        if part.logprobs is not None and logprobs:
            part.logprobs.extend(logprobs)
        self._emit(
            "response.output_text.delta",
            **self._at(item),
            content_index=0,
            delta=delta,
            logprobs=logprobs or [],
        )

    def add_call(self, call_id: str, name: str) -> None:
        item = FunctionCallItem(
            id=_item_id("fc"), call_id=call_id, name=name, arguments="", status="in_progress"
        )
        self._open_item(item)

    def add_arguments(self, delta: str) -> None:
        item = self._open
        assert isinstance(item, FunctionCallItem), "arguments come after their call's head"
        item.arguments += delta
        self._emit("response.function_call_arguments.delta", **self._at(item), delta=delta)

    def finish(self, finish_reason: str | None, usage: UsageInfo | None) -> ResponsesResponse:
        """Closes the output (a reply with neither text nor calls still gets its empty
        message, as OpenAI sends one) and completes the response: "incomplete" when the reply
        ran out of `max_output_tokens`."""
        output = self.response.output
        if not any(isinstance(item, MessageItem | FunctionCallItem) for item in output):
            self._open_message()
        incomplete = finish_reason == "length"
        self._close(incomplete)
        response = self.response
        response.status = "incomplete" if incomplete else "completed"
        if incomplete:
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        if usage is not None:
            response.usage = _usage(usage)
        self._emit(f"response.{response.status}", response=response)
        return response

    def _open_message(self) -> MessageItem:
        item = self._open_item(MessageItem(id=_item_id("msg"), status="in_progress"))
        item.content.append(OutputText(text="", logprobs=[] if self.logprobs else None))
        self._emit_part("response.content_part.added", item, item.content[0])
        return item

    def _open_item(self, item: Any) -> Any:
        self._close(incomplete=False)
        self.response.output.append(item)
        self._emit("response.output_item.added", output_index=self._open_index, item=item)
        self._open = item
        return item

    def _close(self, incomplete: bool) -> None:
        """Ends the open item (its `done` events); `incomplete`: the reply was cut in it."""
        item, self._open = self._open, None
        if item is None:
            return
        item.status = "incomplete" if incomplete else "completed"
        if isinstance(item, FunctionCallItem):
            self._emit(
                "response.function_call_arguments.done",
                **self._at(item),
                name=item.name,
                arguments=item.arguments,
            )
        else:
            part = item.content[0]
            if isinstance(item, MessageItem):
                extra = {"logprobs": part.logprobs or []}
                self._emit("response.output_text.done", **self._at(item), text=part.text, **extra)
            else:
                self._emit("response.reasoning_text.done", **self._at(item), text=part.text)
            self._emit_part("response.content_part.done", item, part)
        self._emit("response.output_item.done", output_index=self._open_index, item=item)

    @property
    def _open_index(self) -> int:
        """The open (or closing) item's index: it is always the last item of the output."""
        return len(self.response.output) - 1

    def _at(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self._open_index}

    def _emit_part(self, kind: str, item: OutputItem, part: BaseModel) -> None:
        self._emit(kind, **self._at(item), content_index=0, part=part)

    def _emit(self, kind: str, **fields: Any) -> None:
        if not self.streaming:
            return
        data = {"type": kind, "sequence_number": self._sequence_number}
        for name, value in fields.items():
            data[name] = _plain(value)
        self._sequence_number += 1
        self._events.append(f"event: {kind}\ndata: {json.dumps(data)}\n\n")


def _plain(value: Any) -> Any:
    """A field of an event as JSON values (a model as it is at this moment)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: UsageInfo) -> ResponseUsage:
    details = usage.prompt_tokens_details
    cached = 0 if details is None else details.cached_tokens
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


def assistant_turn(response: ResponsesResponse) -> dict[str, Any]:
    """The response's output as the chat message a follow-up (previous_response_id) sees."""
    text, reasoning, calls = "", "", []
    for item in response.output:
        if isinstance(item, MessageItem):
            text += "".join(part.text for part in item.content)
        elif isinstance(item, ReasoningItem):
            reasoning += "".join(part.text for part in item.content)
        else:
            function = {"name": item.name, "arguments": item.arguments}
            calls.append({"id": item.call_id, "type": "function", "function": function})
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning"] = reasoning
    return turn
