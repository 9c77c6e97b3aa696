"""Structured outputs and tool calls through `python -m v1engine.serve`, with the official client,
on a random 2-layer llama with SmolLM2's tokenizer: OpenAI's `response_format` (json_schema,
json_object, `parse` with a pydantic model), vLLM's `guided_*` and `structured_outputs` extras on
both endpoints, 400s that name the request's field while the server keeps serving, and
`tool_choice` "required" / a named function read back as tool calls, whole and streamed.

The server runs with `--structured-outputs-disable-any-whitespace` (a random model left free to
write whitespace may never close its JSON), a tool-aware `--chat-template`, and the hermes parser
for `tool_choice: "auto"` (whose calls a regex makes the random model write). The schemas bound
strings with patterns, not maxLength (xgrammar 0.2.8's length-bounded strings let raw control
characters through).
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.openai.server_utils import serve_module
from tests.timeouts import scaled
from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol import ChatCompletionRequest
from v1engine.entrypoints.openai.serving_options import ServingOptions
from v1engine.entrypoints.openai.tool_calls import tool_mode
from v1engine.entrypoints.openai.tool_parsers import parse_hermes
from v1engine.serve import make_arg_parser

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the weather like?"}]
_SHORT = {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"}
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "name": _SHORT,
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "name", "count", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": _SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# Says which tools the request gave, and an assistant's calls and the tool's answers; `persona`
# is a variable only chat_template_kwargs set.
TEMPLATE = """\
{%- if persona %}PERSONA {{ persona }}
{% endif %}
{%- if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{%- for c in m.tool_calls or [] %} CALL {{ c.function.name }} {{ c.function.arguments | tojson }}
{%- endfor %}
{%- if m.role == 'tool' %} RESULT {{ m.tool_call_id }}:{% endif %} {{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    flags = ["--served-model-name", MODEL, "--chat-template", str(template)]
    flags += ["--structured-outputs-disable-any-whitespace", "--enable-auto-tool-choice"]
    flags += ["--tool-call-parser", "hermes"]
    for remote in serve_module(tiny_model, tmp_path_factory, *flags, tp=1):
        yield remote
    log = remote.log_text()
    assert "Traceback" not in log
    for field in ("response_format", "guided_", "structured_outputs", "tool_choice", "tools"):
        assert not re.search(f"but ignored: {{[^}}]*'{field}", log), field


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=scaled(60)) as c:
        yield c


def chat(client, max_tokens: int = 200, temperature: float = 0.0, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=temperature, **kwargs
    )


def test_response_format_json_schema_validates(client) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    choice = chat(client, response_format=response_format, n=2, temperature=1.0, seed=3).choices
    for c in choice:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_completions_take_response_format_and_guided_fields(client) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    out = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=200, extra_body={"response_format": response_format}
    )
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    choices = ["yes", "no", "maybe"]
    out = client.completions.create(
        model=MODEL, prompt=["a", "b"], max_tokens=20, extra_body={"guided_choice": choices}
    )
    assert [c.text in choices for c in out.choices] == [True, True]


def test_parse_returns_a_pydantic_object(client) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0.0, response_format=Pet,
        extra_body={"guided_decoding_backend": "xgrammar"},
    )  # fmt: skip
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.legs, int)


def test_json_object_is_a_json_object(client) -> None:
    # A random model need not close a free-form object soon: a short grammar-guided output is
    # either whole JSON (it stopped) or was cut off by max_tokens.
    out = chat(client, response_format={"type": "json_object"}).choices[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)
    else:
        assert out.finish_reason == "length" and out.message.content.startswith("{")


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"guided_regex": r"[A-Z][a-z]{1,4}-[0-9]{2}"}, re.compile(r"[A-Z][a-z]{1,4}-[0-9]{2}")),
        ({"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z")'}}, {"xy", "xz"}),
        ({"structured_outputs": {"choice": ["on", "off"]}}, {"on", "off"}),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ],
)
def test_vllm_extras_constrain_the_chat(client, extra, check) -> None:
    text = chat(client, extra_body=extra).choices[0].message.content
    if isinstance(check, re.Pattern):
        assert check.fullmatch(text), text
    elif isinstance(check, set):
        assert text in check
    else:
        assert check(text), text


TAGGED = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["x"],
    "additionalProperties": False,
}


def test_a_structural_tag_constrains_the_tagged_text(client) -> None:
    # xgrammar's form: the reply is the tag (its JSON with at most one space at a time).
    content = {"type": "json_schema", "json_schema": TAGGED, "max_whitespace_cnt": 1}
    tag = {"type": "tag", "begin": "<f>", "content": content, "end": "</f>"}
    response_format = {"type": "structural_tag", "format": tag}
    text = chat(client, extra_body={"response_format": response_format}).choices[0].message.content
    body = re.fullmatch(r"<f>(.*)</f>", text, re.DOTALL)
    assert body, text
    jsonschema.validate(json.loads(body.group(1)), TAGGED)
    # vLLM's older form: free text, and a schema inside each tag a trigger opens.
    structures = [{"begin": "<f>", "schema": TAGGED, "end": "</f>"}]
    legacy = {"type": "structural_tag", "structures": structures, "triggers": ["<f"]}
    free = chat(client, max_tokens=20, extra_body={"structured_outputs": {
        "structural_tag": json.dumps(legacy)}}).choices[0].message.content  # fmt: skip
    assert free
    for segment in re.findall(r"<f>(.*?)</f>", free, re.DOTALL):
        jsonschema.validate(json.loads(segment), TAGGED)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"bogus": 1, "regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern"),
]  # fmt: skip


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_an_invalid_constraint_is_a_400_naming_the_field(client, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=5, extra_body=extra)
    error = info.value.body
    assert error["param"] == param, error
    assert error["code"] == 400 and "StructuredOutputsParams" not in error["message"], error
    assert chat(client, max_tokens=2).choices[0].message.content is not None


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_tool_choice_required_calls_tools_with_valid_arguments(client) -> None:
    for parallel in (True, False):
        out = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        calls = _calls(choice.message)
        assert calls and (parallel or len(calls) == 1)
        for (name, arguments), call in zip(calls, choice.message.tool_calls):
            jsonschema.validate(arguments, SCHEMAS[name])
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")


def test_named_tool_choice_calls_that_function(client) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = chat(client, tools=TOOLS, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls"
    ((name, arguments),) = _calls(choice.message)
    assert name == "get_time"
    jsonschema.validate(arguments, TIME)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {
    "name": "get_weather"}}])  # fmt: skip
@pytest.mark.parametrize("cut", [False, True])  # True: cut inside the first call's arguments
def test_streamed_tool_calls_concatenate_to_the_whole_result(client, tool_choice, cut):
    # "required" writes `[{"name":"get_weather","parameters":` first.
    max_tokens = (6 if isinstance(tool_choice, dict) else 20) if cut else 200
    reply = chat(client, max_tokens, tools=TOOLS, tool_choice=tool_choice).choices[0]
    whole = reply.message
    calls: dict[int, dict] = {}
    finish_reasons, argument_chunks = [], 0
    for chunk in chat(client, max_tokens, tools=TOOLS, tool_choice=tool_choice, stream=True):
        for choice in chunk.choices:
            finish_reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                argument_chunks += bool(delta.function.arguments)
    expected_finish = "length" if cut else "tool_calls"
    assert [f for f in finish_reasons if f] == [reply.finish_reason] == [expected_finish]
    streamed = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert all(call["id"].startswith("chatcmpl-tool-") for call in calls.values())
    # The arguments come as they are written, not whole at the end.
    assert argument_chunks > len(calls)
    if cut:  # one call, its arguments begun but not whole JSON
        ((name, arguments),) = streamed
        assert arguments.startswith("{")
        with pytest.raises(ValueError):
            json.loads(arguments)


def test_auto_without_the_parser_flags_is_vllms_400() -> None:
    needs_parser = (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    for tool_choice in ("auto", None):  # None: "auto", as tools are given
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice}
        with pytest.raises(APIError, match=re.escape(needs_parser)) as info:
            tool_mode(ChatCompletionRequest.model_validate(body), ServingOptions())
        assert info.value.param == "tool_choice"
    args = make_arg_parser().parse_args(["--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ServingOptions.from_cli_args(args)


def test_bad_tool_choices_are_400s(client) -> None:
    unknown = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(openai.BadRequestError, match="nope") as info:
        chat(client, tools=TOOLS, tool_choice=unknown)
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        chat(client, tool_choice="required")


HERMES_CALL = (
    r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
)


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_tool_calls_carry_every_tokens_logprobs_once(client, tool_choice) -> None:
    """As plain text does: each token's logprob goes with the chunk of the step that made it,
    or, where that step sent nothing (a call not yet named), the choice's next chunk."""
    kwargs = dict(tools=TOOLS, tool_choice=tool_choice, logprobs=True, top_logprobs=2)
    if tool_choice == "auto":
        kwargs["extra_body"] = {"guided_regex": HERMES_CALL}
    whole = chat(client, **kwargs).choices[0]
    expected = [(t.token, t.logprob) for t in whole.logprobs.content]
    streamed, num_tool_chunks = [], 0
    for chunk in chat(client, stream=True, stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            num_tool_chunks += bool(choice.delta.tool_calls)
            for token in choice.logprobs.content if choice.logprobs else []:
                assert len(token.top_logprobs) == 2
                streamed.append((token.token, token.logprob))
        if chunk.usage is not None:
            assert len(streamed) == chunk.usage.completion_tokens
    assert num_tool_chunks > 1 and [t for t, _ in streamed] == [t for t, _ in expected]
    assert [lp for _, lp in streamed] == pytest.approx([lp for _, lp in expected], abs=1e-3)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_finds_hermes_calls_in_the_text(client, stream) -> None:
    kwargs = dict(tools=TOOLS, tool_choice="auto", extra_body={"guided_regex": HERMES_CALL})
    if not stream:
        choice = chat(client, **kwargs).choices[0]
        content, calls, finish_reason = (
            choice.message.content,
            _calls(choice.message),
            choice.finish_reason,
        )
    else:
        content, arguments, finish_reason, name = "", "", None, ""
        for chunk in chat(client, stream=True, **kwargs):
            for c in chunk.choices:
                content += c.delta.content or ""
                finish_reason = finish_reason or c.finish_reason
                for delta in c.delta.tool_calls or []:
                    name += delta.function.name or ""
                    arguments += delta.function.arguments or ""
        calls = [(name, json.loads(arguments))]
    assert content == "Sure." and finish_reason == "tool_calls"
    assert [name for name, _ in calls] == ["get_time"]
    jsonschema.validate(calls[0][1], TIME)


def test_auto_without_a_call_is_content(client) -> None:
    choice = chat(client, max_tokens=5, tools=TOOLS, tool_choice="auto").choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content


def test_hermes_parser_keeps_malformed_calls_as_content() -> None:
    text = 'hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    text += '<tool_call>{"name": "g"}</tool_call>'
    assert parse_hermes(text) == ("hi", [("f", '{"a": 1}'), ("g", "{}")])
    for bad in ("<tool_call>{oops</tool_call>", '<tool_call>["f"]</tool_call>', "no calls"):
        assert parse_hermes(bad) == (bad, [])


def test_tool_choice_none_and_text_format_leave_the_output_free(client) -> None:
    choice = chat(client, max_tokens=5, tools=TOOLS, tool_choice="none").choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls in (None, [])
    free = chat(client, max_tokens=5).choices[0].message.content
    text = chat(client, max_tokens=5, response_format={"type": "text"}).choices[0]
    assert text.finish_reason == "length" and text.message.content == free


def test_the_chat_template_renders_tools_calls_and_results(server) -> None:
    messages = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=scaled(60)) as http:
        body = {"model": MODEL, "messages": messages, "tools": TOOLS}
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
        # The chat endpoint takes the same conversation.
        body = {"model": MODEL, "messages": messages, "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert text.startswith("TOOLS: get_weather get_time<|im_start|>user What is the weather")
    assert 'CALL get_weather {"city": "Paris"}' in text
    assert "<|im_start|>tool RESULT call_1: sunny<|im_end|>" in text


def test_the_chat_endpoint_takes_the_template_options_tokenize_takes(server) -> None:
    partial = MESSAGES + [{"role": "assistant", "content": "It is"}]
    cases = {
        "persona": {"messages": MESSAGES, "chat_template_kwargs": {"persona": "a pirate"}},
        "continued": {
            "messages": partial,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        "special tokens": {"messages": MESSAGES, "add_special_tokens": True},
    }
    with httpx.Client(base_url=server.url, timeout=scaled(60)) as http:
        texts = {}
        for name, options in cases.items():
            tokens = http.post("/tokenize", json={"model": MODEL, **options}).json()["tokens"]
            body = {"model": MODEL, "max_tokens": 1, **options}
            reply = http.post("/v1/chat/completions", json=body).json()
            assert reply["usage"]["prompt_tokens"] == len(tokens), name
            detokenize = {"model": MODEL, "tokens": tokens}
            texts[name] = http.post("/detokenize", json=detokenize).json()["prompt"]
    assert texts["persona"].startswith("PERSONA a pirate\n<|im_start|>user")
    assert texts["continued"].endswith("<|im_start|>assistant It is")
    log = server.log_text()
    for field in ("chat_template_kwargs", "continue_final_message", "add_special_tokens"):
        assert not re.search(f"but ignored: {{[^}}]*'{field}", log), field
