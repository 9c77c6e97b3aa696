"""The Responses API's pieces without a server: input items as chat messages, the request as
a chat request, and the store of finished responses (its bound and its order)."""

from __future__ import annotations

import pytest

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol_responses import ResponsesRequest, ResponsesResponse
from v1engine.entrypoints.openai.responses_input import chat_request, input_messages
from v1engine.entrypoints.openai.serving_responses import ResponseStore


def _call(call_id: str, name: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}


def test_a_replys_calls_join_its_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look."},
        _call("a", "f"),
        _call("b", "g"),
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {
            "type": "function_call_output",
            "call_id": "b",
            "output": [{"type": "input_text", "text": "2"}],
        },
        _call("c", "f"),  # after the outputs: a new turn
    ]
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[1]["content"] == "Let me look."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["a", "b"]
    assert messages[3] == {"role": "tool", "tool_call_id": "b", "content": "2"}
    assert messages[4] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def test_text_parts_join_as_a_chat_messages_do() -> None:
    parts = [{"type": "input_text", "text": "Tell me"}, {"type": "input_text", "text": "a story"}]
    assert input_messages([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "Tell me\na story"}
    ]


@pytest.mark.parametrize(
    "item, match",
    [
        ({"role": "user", "content": 3}, r"input\[0\]\.content must be a string"),
        ({"role": "user", "content": ["x"]}, r"input\[0\]\.content\[0\]: only text content parts"),
        ({"role": "user", "content": [{"type": "input_text"}]}, "'input_text' part needs a string"),
        ({"type": "function_call_output", "output": "x"}, r"input\[0\]\.call_id must be"),
        ({"type": "item_reference", "id": "x"}, "'item_reference', which this server"),
    ],
)
def test_a_bad_item_is_named(item, match) -> None:
    with pytest.raises(APIError, match=match) as info:
        input_messages([item])
    assert info.value.param == "input"


def test_the_request_becomes_chats() -> None:
    request = ResponsesRequest.model_validate(
        {
            "input": "Hi",
            "instructions": "Be brief.",
            "max_output_tokens": 5,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "top_logprobs": 3,
            "top_k": 4,
            "unknown": 1,
            "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
            "reasoning": {"effort": "high", "summary": "auto"},
        }
    )
    chat = chat_request(request, input_messages(request.input))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert chat.max_completion_tokens == 5 and chat.top_k == 4
    assert chat.tools[0].function.name == "f" and chat.tool_choice.function.name == "f"
    assert chat.response_format.json_schema.json_schema == {"type": "object"}
    assert (chat.logprobs, chat.top_logprobs) == (True, 3)
    assert chat.reasoning_effort == "high"
    # The Responses request's, logged by chat's check: what it cannot honour too.
    assert chat.ignored_fields == [
        "unknown",
        "include.reasoning.encrypted_content",
        "reasoning.summary",
    ]


def _response(response_id: str) -> ResponsesResponse:
    return ResponsesResponse(id=response_id, model="m", status="completed")


def test_the_store_keeps_the_last_used_responses() -> None:
    store = ResponseStore(capacity=2)
    for response_id in ("a", "b"):
        store.put(_response(response_id), [{"role": "user", "content": response_id}])
    assert store.get("a")[1] == [{"role": "user", "content": "a"}]  # a is now the newest
    store.put(_response("c"), [])
    with pytest.raises(APIError, match="no stored response has the id 'b'") as info:
        store.get("b", "previous_response_id")
    assert info.value.status == 404 and info.value.param == "previous_response_id"
    assert store.get("a")[0].id == "a" and store.get("c")[0].id == "c"
    store.delete("a")
    with pytest.raises(APIError):
        store.delete("a")
    empty = ResponseStore(capacity=0)
    empty.put(_response("a"), [])
    with pytest.raises(APIError):
        empty.get("a")
