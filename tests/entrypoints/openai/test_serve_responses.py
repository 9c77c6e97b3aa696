"""OpenAI's Responses API on a real `python -m v1engine.serve`, through the real `openai` client
(`client.responses`), on a random 2-layer llama with SmolLM2's tokenizer.

A response is a chat completion underneath, so the checks compare the two: the same greedy text
and token counts as /v1/chat/completions for the same conversation, whole and streamed (with
the Responses API's events in OpenAI's order, numbered, and adding up to the final response);
input items (messages, function calls and their outputs, instructions, a previous response's
conversation) render the prompt that the equivalent chat messages render (/tokenize counts it);
`text.format` and tool choices constrain the output; stored responses can be retrieved, chained
and deleted; background responses are polled to the same reply, or cancelled (aborted in the
engine); bad input is a 400 or 404 naming the field while the server keeps serving.
"""

from __future__ import annotations

import json
import re
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.entrypoints.openai.server_utils import metric, openai_client, serve_module
from tests.entrypoints.openai.test_serve_structured import SCHEMA, TEMPLATE, TOOLS, WEATHER
from tests.timeouts import scaled

MODEL = "tiny"
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}
# The Responses API's flat form of the chat tools.
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    flags = ["--served-model-name", MODEL, "--chat-template", str(template)]
    flags += ["--structured-outputs-disable-any-whitespace"]
    for remote in serve_module(tiny_model, tmp_path_factory, *flags, tp=1):
        yield remote
    log = remote.log_text()
    assert "Traceback" not in log
    assert "but ignored" not in log


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, max_completion_tokens=12, **kwargs
    )


def _num_prompt_tokens(server, messages, **kwargs) -> int:
    body = {"model": MODEL, "messages": messages, **kwargs}
    return httpx.post(server.url + "/tokenize", json=body).json()["count"]


def test_a_response_is_the_chat_completion_of_its_input(client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = _chat(client, messages)
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi", **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens == 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The random model never stops on its own: max_output_tokens cuts the reply.
    assert response.status == "incomplete" and item.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.instructions, response.max_output_tokens) == ("Be brief.", 12)


def test_a_stream_sends_openais_events_adding_up_to_the_response(client) -> None:
    whole = client.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True, **GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == whole.output_text
    assert {e.item_id for e in events[3:-2]} == {events[-2].item.id, final.output[0].id}
    assert final.usage.output_tokens == 12


def test_input_items_render_as_their_chat_messages(client, server) -> None:
    call = {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # earlier thinking: dropped
        {"type": "function_call", "call_id": "call_1", **call},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": "Thanks"},
    ]
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "function": call}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    response = client.responses.create(
        model=MODEL, input=items, instructions="Answer in French.", store=False, **GREEDY
    )
    assert response.usage.input_tokens == _num_prompt_tokens(server, messages)
    assert response.output_text == _chat(client, messages).choices[0].message.content


def test_previous_response_id_continues_the_conversation_without_its_instructions(
    client, server
) -> None:
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi", **GREEDY)
    second = client.responses.create(
        model=MODEL, input="More", previous_response_id=first.id, **GREEDY
    )
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More"},
    ]
    assert second.usage.input_tokens == _num_prompt_tokens(server, messages)
    assert second.output_text == _chat(client, messages).choices[0].message.content
    # A chain of three carries both earlier turns.
    third = client.responses.create(
        model=MODEL, input="Again", previous_response_id=second.id, **GREEDY
    )
    messages += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Again"},
    ]
    assert third.usage.input_tokens == _num_prompt_tokens(server, messages)


def test_stored_responses_are_retrieved_and_deleted(client) -> None:
    created = client.responses.create(model=MODEL, input="Hi", **GREEDY)
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    client.responses.delete(created.id)
    for call in (
        lambda: client.responses.retrieve(created.id),
        lambda: client.responses.delete(created.id),
    ):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            call()
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id=created.id)
    assert info.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def _poll(client, response_id: str, timeout_s: float):
    deadline = time.monotonic() + scaled(timeout_s)
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def test_a_background_response_is_polled_to_the_reply_it_would_have_given(client) -> None:
    whole = client.responses.create(model=MODEL, input="Hi there", **GREEDY)
    started = client.responses.create(model=MODEL, input="Hi there", background=True, **GREEDY)
    assert started.status == "queued" and started.background and not started.output
    done = _poll(client, started.id, 120)
    assert done.status == whole.status and done.output_text == whole.output_text
    assert done.usage.output_tokens == whole.usage.output_tokens
    # Stored with its conversation: it can be continued.
    assert client.responses.create(
        model=MODEL, input="And?", previous_response_id=done.id, **GREEDY
    ).output_text
    with pytest.raises(openai.BadRequestError, match="is already (completed|incomplete)"):
        client.responses.cancel(done.id)


def test_a_cancelled_background_response_stops_in_the_engine(client, server) -> None:
    long = {"temperature": 0.0, "max_output_tokens": 200}
    started = client.responses.create(model=MODEL, input="Tell me", background=True, **long)
    with pytest.raises(openai.BadRequestError, match="only a completed") as info:
        client.responses.create(model=MODEL, input="x", previous_response_id=started.id)
    assert info.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client.responses.cancel(started.id).status == "cancelled"  # again: the same
    assert client.responses.retrieve(started.id).status == "cancelled"
    deadline = time.monotonic() + scaled(30)
    while metric(server, 'vllm:num_requests_running{model_name="tiny"}') > 0:
        assert time.monotonic() < deadline, "the cancelled request still runs in the engine"
        time.sleep(0.05)
    plain = client.responses.create(model=MODEL, input="Hi", **GREEDY)
    with pytest.raises(openai.BadRequestError, match="background: false"):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


def test_text_format_json_schema_constrains_the_output(client) -> None:
    text = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}}
    response = client.responses.create(
        model=MODEL, input="Describe a thing", text=text, temperature=0.0, max_output_tokens=200
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    unit: Literal["celsius", "fahrenheit"]


def test_parse_returns_a_pydantic_object(client) -> None:
    response = client.responses.parse(
        model=MODEL, input="Weather?", text_format=Weather, temperature=0.0, max_output_tokens=200
    )
    assert isinstance(response.output_parsed, Weather)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_function_calls(client, stream) -> None:
    kwargs = dict(model=MODEL, input="Weather?", tools=FLAT_TOOLS, tool_choice="required")
    kwargs.update(temperature=0.0, max_output_tokens=200)
    if not stream:
        response = client.responses.create(**kwargs)
    else:
        events = list(client.responses.create(stream=True, **kwargs))
        response = events[-1].response
        arguments = {}
        for event in events:
            if event.type == "response.function_call_arguments.delta":
                arguments[event.item_id] = arguments.get(event.item_id, "") + event.delta
        done = {e.item_id: e.arguments for e in events if e.type.endswith("arguments.done")}
        assert arguments == done and set(done) == {item.id for item in response.output}
    assert response.status == "completed" and response.output
    for item in response.output:
        assert item.type == "function_call" and item.status == "completed"
        assert item.name in ("get_weather", "get_time") and item.call_id
        schema = WEATHER if item.name == "get_weather" else TOOLS[1]["function"]["parameters"]
        jsonschema.validate(json.loads(item.arguments), schema)


def test_a_named_function_choice_calls_that_function(client, server) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Weather?",
        tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.0,
        max_output_tokens=200,
    )
    (item,) = response.output
    assert item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    # The call's output continues the stored conversation, the call in its assistant turn.
    answer = {"type": "function_call_output", "call_id": item.call_id, "output": "Sunny"}
    follow_up = client.responses.create(
        model=MODEL, input=[answer], previous_response_id=response.id, **GREEDY
    )
    call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": item.call_id, "content": "Sunny"},
    ]
    assert follow_up.usage.input_tokens == _num_prompt_tokens(server, messages)


def test_logprobs_come_with_the_output_text_when_included(client) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Hi",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        **GREEDY,
    )
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens
    assert "".join(lp.token for lp in logprobs) == response.output_text
    for lp in logprobs:
        assert len(lp.top_logprobs) == 2 and lp.logprob == max(t.logprob for t in lp.top_logprobs)
    plain = client.responses.create(model=MODEL, input="Hi", **GREEDY)
    assert plain.output[0].content[0].logprobs is None


@pytest.mark.parametrize(
    "body, param, match",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "input"),
        ({"input": [{"type": "web_search_call"}]}, "input", "web_search_call"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "role"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input",
            "call_id",
        ),
        ({"input": "x", "background": True, "store": False}, "background", "store: true"),
        ({"input": "x", "background": True, "stream": True}, "background", "no stream"),
        ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens", "context length"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format", "schema"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, body, param, match) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(match)) as info:
        client.responses.create(model=MODEL, **body)
    assert info.value.body["param"] == param
    assert client.responses.create(model=MODEL, input="ok", **GREEDY).output_text


def test_an_unknown_model_is_a_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="nope", input="x")
    assert info.value.body["param"] == "model"


def test_zz_the_server_stops_cleanly_with_a_background_response_running(client) -> None:
    # Last in the module: the fixture then stops the server, which must exit 0 without a
    # traceback while this response still runs (it is cancelled and aborted in the engine).
    long = {"temperature": 0.0, "max_output_tokens": 200}
    started = client.responses.create(model=MODEL, input="Go on", background=True, **long)
    assert client.responses.retrieve(started.id).status in ("queued", "in_progress")
