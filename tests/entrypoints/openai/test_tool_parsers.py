"""The `llama3_json`, `pythonic`, `mistral`, `granite` and `phi4_mini_json` tool-call parsers: what
they read as calls and what they leave as content (never running anything), and the chat
endpoint's `tool_calls`, whole and streamed, over a fake engine replaying such replies token by
token (the hermes parser runs on a real server in test_serve_structured.py); and, for every
parser, that a stream sends content as it comes, up to where a call may begin, and each call as
it is written."""

from __future__ import annotations

import json
import random

import pytest

from tests.entrypoints.openai.scripted_engine import scripted_chat, stream_deltas
from v1engine.entrypoints.openai.serving_options import ServingOptions
from v1engine.entrypoints.openai.tool_parser_mistral import MistralCallReader, parse_mistral
from v1engine.entrypoints.openai.tool_parsers import (
    GraniteCallReader,
    HermesCallReader,
    Llama3JsonCallReader,
    Phi4MiniJsonCallReader,
    PythonicCallReader,
    content_end,
    parse_granite,
    parse_llama3_json,
    parse_phi4_mini_json,
    parse_pythonic,
)

WEATHER = {"city": "Paris", "days": 3}
HERMES_CALL = json.dumps({"name": "weather", "arguments": WEATHER})


# (parser, a whole reply of calls, the calls it reads)
CALLS = [
    (
        parse_llama3_json,
        json.dumps({"name": "weather", "parameters": WEATHER}),
        [("weather", WEATHER)],
    ),
    (
        parse_llama3_json,
        '<|python_tag|>{"name": "weather", "arguments": {"city": "Paris", "days": 3}}',
        [("weather", WEATHER)],
    ),
    (parse_llama3_json, '{"name": "a", "parameters": {}}; {"name": "b"}', [("a", {}), ("b", {})]),
    (
        parse_llama3_json,
        ' {"name": "a", "parameters": {"x": [1, null]}} ',
        [("a", {"x": [1, None]})],
    ),
    (parse_pythonic, "[weather(city='Paris', days=3)]", [("weather", WEATHER)]),
    (
        parse_pythonic,
        '<|python_start|>[weather(city="Paris", days=3), now()]<|python_end|>',
        [("weather", WEATHER), ("now", {})],
    ),
    (
        parse_pythonic,
        "[f(a=[1, {'b': None}], c=True, d=-2.5)]",
        [("f", {"a": [1, {"b": None}], "c": True, "d": -2.5})],
    ),
    # Mistral 7B Instruct v0.3's array, then the v11+ tokenizers' `name{...}` and `name[ARGS]`.
    (
        parse_mistral,
        '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]',
        [("weather", WEATHER)],
    ),
    (
        parse_mistral,
        '[TOOL_CALLS]weather{"city": "Paris", "days": 3}[TOOL_CALLS]now{}',
        [("weather", WEATHER), ("now", {})],
    ),
    (parse_mistral, '[TOOL_CALLS]f[ARGS]{"a": [1, {"b": null}]}', [("f", {"a": [1, {"b": None}]})]),
    (parse_mistral, '[TOOL_CALLS] {"name": "now", "arguments": {}}', [("now", {})]),
    (
        parse_granite,
        '<|tool_call|>[{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]',
        [("weather", WEATHER)],
    ),
    (parse_granite, ' [{"name": "a", "arguments": {}}, {"name": "b"}]', [("a", {}), ("b", {})]),
    (
        parse_phi4_mini_json,
        'functools[{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]',
        [("weather", WEATHER)],
    ),
]
# (parser, a reply it must leave as content)
NOT_CALLS = [
    (parse_llama3_json, "Paris is sunny."),
    (parse_llama3_json, 'Sure: {"name": "weather", "parameters": {}}'),  # a call inside text
    (parse_llama3_json, '{"name": "weather", "parameters": {}} and more'),
    (parse_llama3_json, '{"name": "weather", "parameters": {"city": "Par'),  # cut by max_tokens
    (parse_llama3_json, '{"parameters": {}}'),
    (parse_llama3_json, "[1, 2]"),
    (parse_pythonic, "It is sunny in Paris."),
    (parse_pythonic, "[weather('Paris')]"),  # positional arguments
    (parse_pythonic, "[weather(city=__import__('os').getcwd())]"),  # not a literal: never run
    (parse_pythonic, "[weather(**kwargs)]"),
    (parse_pythonic, "[weather(city=b'Paris')]"),  # bytes are not JSON
    (parse_pythonic, "[weather(city={'a', 'b'})]"),  # nor are sets
    (parse_pythonic, "[os.system(cmd='ls')]"),  # an attribute, not a function name
    (parse_pythonic, "[weather(city='Paris')"),  # cut by max_tokens
    (parse_pythonic, "[]"),
    (parse_pythonic, "[" * 5000 + "]" * 5000),  # too deep for the parser: content, not a crash
    (parse_mistral, "It is sunny in Paris."),
    (parse_mistral, "[TOOL_CALLS] not a call"),
    (parse_mistral, '[TOOL_CALLS]weather{"city": "Par'),  # cut by max_tokens
    (parse_mistral, '[TOOL_CALLS]weather["Paris"]'),
    (parse_mistral, "[TOOL_CALLS] [1, 2]"),
    (parse_granite, "It is sunny in Paris."),
    (parse_granite, '<|tool_call|>[{"name": "weather", "arguments": {"city": "Par'),
    (parse_granite, "<|tool_call|>[]"),
    (parse_phi4_mini_json, '[{"name": "weather", "arguments": {}}]'),  # no functools
    (parse_phi4_mini_json, "functools is a Python module."),
]


@pytest.mark.parametrize("parse, text, calls", CALLS)
def test_a_parser_reads_a_whole_reply_of_calls(parse, text, calls):
    content, parsed = parse(text)
    assert content is None
    assert [(name, json.loads(arguments)) for name, arguments in parsed] == calls


@pytest.mark.parametrize("parse, text", NOT_CALLS)
def test_a_parser_leaves_anything_else_as_content(parse, text):
    assert parse(text) == (text, [])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize(
    "parser, reply",
    [
        ("llama3_json", '{"name": "weather", "parameters": {"city": "Paris", "days": 3}}'),
        ("pythonic", "[weather(city='Paris', days=3)]"),
        ("granite", '[{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]'),
        (
            "phi4_mini_json",
            'functools[{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]',
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_the_chat_endpoint_returns_the_parsed_calls(tokenizer, parser, reply, stream):
    options = ServingOptions(tool_call_parser=parser)
    response = scripted_chat(tokenizer, options, reply, stream, tools=TOOLS)
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        name, arguments = call["function"]["name"], call["function"]["arguments"]
    else:
        deltas = stream_deltas(response)
        assert not any(d.get("content") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls") or []]
        name = "".join(c["function"].get("name") or "" for c in calls)
        arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    assert (name, json.loads(arguments)) == ("weather", WEATHER)


def test_a_reply_without_calls_stays_content(tokenizer):
    options = ServingOptions(tool_call_parser="pythonic")
    response = scripted_chat(tokenizer, options, "It is sunny.", False, tools=TOOLS)
    choice = response.json()["choices"][0]
    assert choice["message"] == {**choice["message"], "content": "It is sunny.", "tool_calls": []}
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "parser, text, end",
    [
        ("hermes", "Sure, let me", len("Sure, let me")),
        ("hermes", "Sure. ", len("Sure.")),  # trailing whitespace may precede a call
        ("hermes", "Sure. <tool_c", len("Sure.")),  # the start of a marker is held
        ("hermes", 'Sure. <tool_call>{"name"', len("Sure.")),
        ("llama3_json", "  ", 0),  # undecided
        ("llama3_json", "<|python_t", 0),
        ("llama3_json", '{"name": "weather"', 0),  # perhaps a call: held to the end
        ("llama3_json", "It is", len("It is")),
        ("pythonic", "[weather(", 0),
        ("pythonic", "The answer", len("The answer")),
        ("mistral", "Sure. [TOOL_", len("Sure.")),
        ("granite", "<|tool_", 0),
        ("granite", "It is", len("It is")),
        ("phi4_mini_json", "func", 0),
        ("phi4_mini_json", "It is", len("It is")),
        ("mistral", "Sure. [TOOL_CALLS]weather", len("Sure.")),
    ],
)
def test_a_stream_sends_what_is_surely_content(parser, text, end):
    assert content_end(parser, text) == end


@pytest.mark.parametrize(
    "parser, reply, content, called",
    [
        (
            "hermes",
            f"Let me check the weather. <tool_call>{HERMES_CALL}</tool_call>",
            "Let me check the weather.",
            True,
        ),
        ("hermes", "It is sunny in Paris today.", "It is sunny in Paris today.", False),
        ("pythonic", "It is sunny in Paris today.", "It is sunny in Paris today.", False),
        ("pythonic", "[weather(city='Paris', days=3)]", "", True),
    ],
)
def test_streamed_content_goes_out_before_the_reply_ends(tokenizer, parser, reply, content, called):
    options = ServingOptions(tool_call_parser=parser)
    deltas = stream_deltas(scripted_chat(tokenizer, options, reply, True, tools=TOOLS))
    pieces = [d["content"] for d in deltas if d.get("content")]
    assert "".join(pieces) == content
    if content:
        assert len(pieces) > 1  # streamed token by token, not sent whole at the end
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert bool(calls) == called
    if called:  # the content went out before the calls
        first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
        assert all(not d.get("content") for d in deltas[first_call:])


def test_auto_without_a_parser_is_refused_before_the_engine(tokenizer):
    response = scripted_chat(tokenizer, ServingOptions(), "unused", False, tools=TOOLS)
    assert response.status_code == 400 and "--tool-call-parser" in response.text


HERMES_REPLY = f"Let me check. <tool_call>\n{HERMES_CALL}\n</tool_call>"
LLAMA3_CALL = json.dumps({"name": "weather", "parameters": WEATHER})


def _chunks(response) -> list[dict]:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def _finish_reasons(response) -> list[str]:
    return [c["choices"][0]["finish_reason"] for c in _chunks(response) if c["choices"]]


@pytest.mark.parametrize(
    "parser, reply, content, in_pieces",
    [
        (
            "hermes",
            HERMES_REPLY + '\n<tool_call>{"name": "now"}</tool_call>',
            "Let me check.",
            True,
        ),
        ("llama3_json", "<|python_tag|>" + LLAMA3_CALL + '; {"name": "now"}', "", True),
        ("pythonic", "[weather(city='Paris', days=3), now()]", "", False),
    ],
)
def test_calls_stream_as_they_are_written(tokenizer, parser, reply, content, in_pieces):
    options = ServingOptions(tool_call_parser=parser)
    usage = {"include_usage": True, "continuous_usage_stats": True}
    response = scripted_chat(tokenizer, options, reply, True, tools=TOOLS, stream_options=usage)
    chunks = [c for c in _chunks(response) if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == content
    calls = [
        (c["usage"], d) for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []
    ]
    heads = [(d["index"], d["type"], d["function"]["name"]) for _, d in calls if d.get("id")]
    assert heads == [(0, "function", "weather"), (1, "function", "now")]
    # The first call went out while the reply was still being written.
    num_tokens = chunks[-1]["usage"]["completion_tokens"]
    assert calls[0][0]["completion_tokens"] < num_tokens
    pieces: dict[int, list[str]] = {0: [], 1: []}
    for _, delta in calls:
        if delta["function"].get("arguments"):
            pieces[delta["index"]].append(delta["function"]["arguments"])
    # hermes and llama3_json send the arguments in pieces, as the model wrote them (pythonic
    # ones whole, as JSON); a call written without arguments has `{}`, as the whole reply's
    # parse reads it.
    assert (len(pieces[0]) > 1) == in_pieces
    assert json.loads("".join(pieces[0])) == WEATHER and pieces[1] == ["{}"]
    if in_pieces:
        assert "".join(pieces[0]) == json.dumps(WEATHER)
    assert [r for r in _finish_reasons(response) if r] == ["tool_calls"]
    whole = scripted_chat(tokenizer, options, reply, False, tools=TOOLS).json()["choices"][0]
    assert whole["message"]["content"] == (content or None)
    parsed = [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]
    ]
    assert [(name, json.loads(args)) for name, args in parsed] == [
        ("weather", WEATHER),
        ("now", {}),
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "parser, reply",
    [
        ("hermes", "Sure. <tool_call>{oops</tool_call>"),
        # The first call is not a literal one: the later one is not streamed either.
        ("pythonic", "[weather(city=__import__('os').getcwd()), now()]"),
    ],
)
def test_a_reply_that_cannot_be_read_whole_stays_content(tokenizer, parser, reply, stream):
    options = ServingOptions(tool_call_parser=parser)
    response = scripted_chat(tokenizer, options, reply, stream, tools=TOOLS)
    if stream:
        deltas = stream_deltas(response)
        assert "".join(d.get("content") or "" for d in deltas) == reply
        assert not any(d.get("tool_calls") for d in deltas)
        assert [r for r in _finish_reasons(response) if r] == ["stop"]
    else:
        choice = response.json()["choices"][0]
        assert choice["message"]["content"] == reply and not choice["message"]["tool_calls"]


READER_REPLIES = [
    (
        HermesCallReader,
        'Hi <tool_call>\n{"name": "a", "arguments": {"s": "x</tool_call y", "n": [1, {"k": "}"}]}}'
        '\n</tool_call>\n<tool_call>{"name": "b"}</tool_call>',
    ),
    (
        Llama3JsonCallReader,
        '<|python_tag|> {"name": "a", "parameters": {"s": ";{"}}; {"name": "b"}',
    ),
    (PythonicCallReader, "<|python_start|>[a(s='x)\\'', n=[1, {'k': ')'}]), b()]<|python_end|>"),
    (MistralCallReader, 'Hi [TOOL_CALLS]a{"s": "x}", "n": [1, {"k": "}"}]}\n[TOOL_CALLS]b[ARGS]{}'),
    (MistralCallReader, '[TOOL_CALLS] [{"name": "a", "arguments": {"s": "]"}}, {"name": "b"}]'),
    (GraniteCallReader, '<|tool_call|> [{"name": "a", "arguments": {"s": "]}"}}, {"name": "b"}]'),
    (Phi4MiniJsonCallReader, 'functools[{"name": "a", "arguments": {"n": [1]}}, {"name": "b"}]'),
]


@pytest.mark.parametrize("reader_class, reply", READER_REPLIES)
def test_a_readers_calls_do_not_depend_on_how_the_reply_is_cut(reader_class, reply):
    """Fed whole or cut anywhere, a reader reads the same calls, and its pieces add up to them."""
    whole = reader_class()
    whole.feed(reply)
    expected = [(call.name, call.arguments) for call in whole.calls]
    assert [name for name, _ in expected] == ["a", "b"]
    rng = random.Random(0)
    for _ in range(50):
        reader, cuts = reader_class(), sorted(rng.sample(range(1, len(reply)), 8))
        arguments: dict[int, str] = {}
        for start, end in zip([0, *cuts], [*cuts, len(reply)]):
            for index, _, piece in reader.feed(reply[start:end]):
                arguments[index] = arguments.get(index, "") + piece
        assert [(call.name, call.arguments) for call in reader.calls] == expected
        assert [arguments.get(i, "") for i in range(len(expected))] == [a for _, a in expected]


def test_mistral_calls_are_read_from_its_special_token_with_mistral_ids(tiny_model):
    """`[TOOL_CALLS]` is a special token of Mistral's tokenizers: the request keeps special tokens
    in its text so the parser sees it (as vLLM's), and each call gets a Mistral id (9 letters and
    digits: Mistral's chat templates refuse others when the calls come back)."""
    from transformers import AddedToken, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    options = ServingOptions(tool_call_parser="mistral")
    reply = 'Let me check.[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}]'
    whole = scripted_chat(tokenizer, options, reply, False, tools=TOOLS).json()["choices"][0]
    assert whole["message"]["content"] == "Let me check."
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert len(call["id"]) == 9 and call["id"].isalnum()
    deltas = stream_deltas(scripted_chat(tokenizer, options, reply, True, tools=TOOLS))
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    (head,) = [c for c in calls if c.get("id")]
    assert len(head["id"]) == 9 and head["function"]["name"] == "weather"
    arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    assert json.loads(arguments) == {"city": "Paris"}
