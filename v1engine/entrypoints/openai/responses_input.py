"""A Responses API request as a chat completion request: its `input` items become chat messages
and its fields chat's, so that a response is generated exactly as a chat completion is (the same
template, tools, constraints, reasoning split and limits).

Input items: messages (`{"role", "content"}`, content a string or text parts), the model's
earlier `function_call`s and the caller's `function_call_output`s; earlier `reasoning` items
are dropped, as chat templates drop past turns' thinking.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol import ChatCompletionRequest
from v1engine.entrypoints.openai.protocol_responses import ResponsesRequest
from v1engine.entrypoints.openai.serving_chat import join_text_parts

# A chat message, as ChatCompletionRequest reads it.
Message = dict[str, Any]

_ROLES = ("user", "system", "developer", "assistant")
# Chat's names for the fields a chat-side check may name, in the Responses API's terms.
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "include",
}


def chat_request(request: ResponsesRequest, conversation: list[Message]) -> ChatCompletionRequest:
    """The chat request that generates `request`'s response: its instructions as the system
    message, then `conversation` (a previous response's, then the request's input).

    Raises:
        APIError: 400 naming the field at fault.
    """
    messages = [] if request.instructions is None else [_system(request.instructions)]
    messages += conversation
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
        "logprobs": request.wants_logprobs,
        "top_logprobs": (request.top_logprobs or 0) if request.wants_logprobs else None,
        "tools": None if request.tools is None else [_chat_tool(t) for t in request.tools],
        "tool_choice": _chat_tool_choice(request.tool_choice),
        "response_format": _response_format(request),
        "reasoning_effort": request.reasoning and request.reasoning.effort,
    }
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", "request_id", "seed"):
        fields[name] = getattr(request, name)
    for name in ("stop", "top_k", "min_p", "repetition_penalty", "ignore_eos"):
        fields[name] = getattr(request, name)
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise APIError(f"input: {e}", param="input") from e
    chat._ignored_fields = request.ignored_fields  # logged once, by the chat-side check
    return chat


def in_responses_terms(error: APIError) -> APIError:
    """`error` of a chat-side check, with its `param` named as the Responses API names it."""
    error.param = _PARAMS.get(error.param, error.param)
    return error


def input_messages(items: str | list[dict[str, Any]]) -> list[Message]:
    """The chat messages of a request's `input`.

    Raises:
        APIError: 400 naming the item that is malformed or of a type this server does not take.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[Message] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":
            raise APIError(
                f"{where} is of type {kind!r}, which this server does not take; send messages, "
                "function_call and function_call_output items",
                param="input",
            )
    return messages


def _system(text: str) -> Message:
    return {"role": "system", "content": text}


def _message(item: dict[str, Any], where: str) -> Message:
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(
            f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param="input"
        )
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _add_call(messages: list[Message], item: dict[str, Any], where: str) -> None:
    """An earlier call of the model goes on the assistant turn it ends (one turn holds a
    reply's parallel calls), or on a new one."""
    name, arguments = _string(item, "name", where), _string(item, "arguments", where)
    function = {"name": name, "arguments": arguments}
    call = {"id": _string(item, "call_id", where), "type": "function", "function": function}
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    messages[-1].setdefault("tool_calls", []).append(call)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{where}.{key} must be a string, got {value!r}", param="input")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content, a string or a list of text parts, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of parts", param="input")
    return join_text_parts(content, where, "input")  # as a chat message's parts


def _chat_tool(tool: Any) -> dict[str, Any]:
    function = tool.model_dump(exclude_none=True, exclude={"type"})
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text_format = None if request.text is None else request.text.format
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.json_schema is None:
        raise APIError("text.format of type json_schema needs a schema", param="text.format")
    schema_format = text_format.as_json_schema_format().model_dump(by_alias=True)
    return {"type": "json_schema", "json_schema": schema_format}
