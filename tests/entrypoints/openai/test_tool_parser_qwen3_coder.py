"""The qwen3_coder tool-call parser: Qwen3-Coder's XML-like calls, their values typed by the
request's tool schemas as vLLM types them, what stays content, a reader's calls however the
reply is cut, and the chat endpoint's `tool_calls`, whole and streamed, over a fake engine
replaying such a reply token by token."""

from __future__ import annotations

import json
import random

import pytest

from tests.entrypoints.openai.scripted_engine import scripted_chat, stream_deltas
from v1engine.entrypoints.openai.serving_options import ServingOptions
from v1engine.entrypoints.openai.tool_parser_qwen3_coder import (
    Qwen3CoderCallReader,
    parse_qwen3_coder,
)
from v1engine.entrypoints.openai.tool_parsers import content_end

PROPERTIES = {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "ratio": {"type": "number"},
    "metric": {"type": "boolean"},
    "tags": {"type": "array"},
    "options": {"type": "object"},
    "limit": {"type": ["integer", "null"]},
    "count": {"type": "integer"},
}
SCHEMAS = {"weather": {"type": "object", "properties": PROPERTIES}, "now": {"type": "object"}}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]


def _call(name: str, **parameters: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER_CALL = _call("weather", city="Paris", days="3")
TYPED_CALL = _call(
    "weather",
    city="007",
    days="3",
    ratio="2.0",
    metric="True",
    tags="['a', 1]",
    options='{"x": [1, null]}',
    limit="null",
    count="007",
    unit="C",
)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (WEATHER_CALL, None, [("weather", {"city": "Paris", "days": 3})]),
        (
            "Let me check.\n\n" + WEATHER_CALL + "\n" + _call("now"),
            "Let me check.",
            [("weather", {"city": "Paris", "days": 3}), ("now", {})],
        ),
        (
            TYPED_CALL,
            None,
            [
                (
                    "weather",
                    # unit: not in the schema, so text; "007" stays a string.
                    {
                        "city": "007",
                        "days": 3,
                        "ratio": 2,
                        "metric": True,
                        "tags": ["a", 1],
                        "options": {"x": [1, None]},
                        "limit": None,
                        "count": 7,  # an integer, where JSON would not read "007"
                        "unit": "C",
                    },
                )
            ],
        ),
        # A value is read to its closing tag, whatever it holds; a reply may end without
        # </tool_call>.
        (
            "<tool_call>\n<function=now>\n<parameter=city>\na</function>b\n</parameter>\n"
            "</function>",
            None,
            [("now", {"city": "a</function>b"})],
        ),
        # Multi-line text keeps its inner newlines; numbers that do not read stay text.
        (
            _call("weather", city="line 1\nline 2\n", days="three"),
            None,
            [("weather", {"city": "line 1\nline 2\n", "days": "three"})],
        ),
    ],
)
def test_calls_are_read_with_their_values_typed_by_the_schema(text, content, calls):
    got_content, got_calls = parse_qwen3_coder(text, SCHEMAS)
    assert got_content == content
    assert [(name, json.loads(arguments)) for name, arguments in got_calls] == calls


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        "Use <tool_call> tags to call tools.",
        "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n",  # cut off
        '<tool_call>{"name": "weather"}</tool_call>',  # hermes', not this format
    ],
)
def test_anything_else_stays_content(text):
    assert parse_qwen3_coder(text, SCHEMAS) == (text, [])


def test_content_streams_up_to_where_a_call_may_begin():
    assert content_end("qwen3_coder", "Let me check. <tool") == len("Let me check.")
    assert content_end("qwen3_coder", "Sure " + WEATHER_CALL) == len("Sure")


def test_a_readers_calls_do_not_depend_on_how_the_reply_is_cut():
    """Fed whole or cut anywhere, the reader reads the same calls, and its pieces add up to
    them: a head when the function's tag is whole, then a parameter at a time."""
    reply = "Hi " + TYPED_CALL + "\n" + _call("now")
    whole = Qwen3CoderCallReader(SCHEMAS)
    whole.feed(reply)
    expected = [(call.name, call.arguments) for call in whole.calls]
    assert [name for name, _ in expected] == ["weather", "now"]
    assert expected[1][1] == "{}"
    rng = random.Random(0)
    for _ in range(50):
        reader, cuts = Qwen3CoderCallReader(SCHEMAS), sorted(rng.sample(range(1, len(reply)), 12))
        arguments: dict[int, list[str]] = {}
        for start, end in zip([0, *cuts], [*cuts, len(reply)]):
            for index, _, piece in reader.feed(reply[start:end]):
                arguments.setdefault(index, []).append(piece)
        assert [(call.name, call.arguments) for call in reader.calls] == expected
        assert ["".join(arguments[i]) for i in range(2)] == [a for _, a in expected]
        assert len([p for p in arguments[0] if p]) == 10  # 9 parameters, then "}"


@pytest.mark.parametrize("stream", [False, True])
def test_the_chat_endpoint_returns_the_typed_calls(tokenizer, stream):
    options = ServingOptions(tool_call_parser="qwen3_coder")
    reply = "Let me check.\n" + WEATHER_CALL
    response = scripted_chat(tokenizer, options, reply, stream, tools=TOOLS)
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me check."
        (call,) = choice["message"]["tool_calls"]
        name, arguments = call["function"]["name"], call["function"]["arguments"]
    else:
        deltas = stream_deltas(response)
        assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
        calls = [c for d in deltas for c in d.get("tool_calls") or []]
        assert len([c for c in calls if c.get("id")]) == 1
        name = "".join(c["function"].get("name") or "" for c in calls)
        arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    assert (name, json.loads(arguments)) == ("weather", {"city": "Paris", "days": 3})
