"""`--reasoning-parser deepseek_r1` on a real `python -m v1engine.serve`, through the real `openai`
client: DeepSeek-R1's thinking is open from the reply's first token, and the tiny random model
never writes `</think>`, so its whole greedy reply is `reasoning` (the same text /v1/completions
generates from the same rendered prompt), streamed or not, with no content; a constrained reply
is all content where the tokenizer spells `</think>` in several tokens (SmolLM2's), and where it
is one token (a tokenizer given `<think>` and `</think>` as added tokens) the grammar starts after
it: a reply pushed to `</think>` first by logit_bias, which no JSON grammar allows first, goes on
as JSON in `content`. The split itself is tested token by token in test_reasoning.py.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.openai.server_utils import make_tiny_checkpoint, openai_client, serve_module

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    args = ("--served-model-name", MODEL, "--reasoning-parser", "deepseek_r1")
    yield from serve_module(tiny_model, tmp_path_factory, *args, tp=1)


def _generated_text(client, tokenizer) -> str:
    """What the model writes after the chat prompt, read from /v1/completions (no parser)."""
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    token_ids = tokenizer.encode(prompt, add_special_tokens=False)
    return client.completions.create(model=MODEL, prompt=token_ids, **GREEDY).choices[0].text


def test_the_reply_is_all_reasoning_until_think_ends(client, tokenizer):
    expected = _generated_text(client, tokenizer)
    assert expected and "</think>" not in expected
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    message = reply.choices[0].message
    assert (message.reasoning, message.content) == (expected, None)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **GREEDY)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == expected
    assert not any(d.content for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_puts_the_thinking_in_a_reasoning_item(client, tokenizer, stream):
    expected = _generated_text(client, tokenizer)
    kwargs = dict(model=MODEL, input=MESSAGES, max_output_tokens=12, temperature=0)
    if not stream:
        response = client.responses.create(**kwargs)
    else:
        events = list(client.responses.create(stream=True, **kwargs))
        response = events[-1].response
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == expected
        assert not [e for e in events if e.type == "response.output_text.delta"]
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == expected
    # Cut while thinking: the reply's message is empty.
    assert message.type == "message" and response.output_text == ""


def test_a_json_constrained_reply_is_all_content(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        **GREEDY,
    )
    message = reply.choices[0].message
    # Any JSON value (perhaps cut by max_tokens): here an object or an array.
    assert message.reasoning is None and message.content.lstrip()[0] in "[{"


CHOICE = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """A tiny model whose tokenizer spells <think> and </think> as one token each."""
    from transformers import AutoTokenizer

    from v1engine.model.hf_config import default_model_path, prepare_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(prepare_checkpoint(default_model_path()))
    tokenizer.add_tokens(["<think>", "</think>"])
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("thinking")), tokenizer)
    args = ("--served-model-name", MODEL, "--reasoning-parser", "deepseek_r1")
    for remote in serve_module(path, tmp_path_factory, *args, tp=1):
        yield remote, tokenizer.convert_tokens_to_ids("</think>")


@pytest.mark.parametrize("stream", [False, True])
def test_a_constrained_reply_thinks_first_then_follows_its_grammar(thinking_server, stream):
    server, think_end = thinking_server
    structured = {"json": CHOICE, "disable_any_whitespace": True}
    reply = openai_client(server).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        logit_bias={str(think_end): 100},  # </think> first, then whatever the grammar allows
        extra_body={"structured_outputs": structured},
        stream=stream,
        **{**GREEDY, "max_tokens": 30},
    )
    if not stream:
        message = reply.choices[0].message
        reasoning, content = message.reasoning, message.content
    else:
        deltas = [chunk.choices[0].delta for chunk in reply if chunk.choices]
        reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    assert reasoning == ""  # the thinking ended at once, at the forced </think>
    jsonschema.validate(json.loads(content), CHOICE)
