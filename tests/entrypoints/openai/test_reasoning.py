"""Reasoning parsers: the split of a reply into `reasoning` and `content` (whole, and streamed
cut at every point, tags included), and the chat endpoint's use of it in-process over a fake
engine that replays scripted tokens of SmolLM2's tokenizer (whose vocabulary spells `<think>` in
several tokens, so the stream must hold back a tag's beginning)."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from tests.entrypoints.openai.scripted_engine import scripted_chat, stream_deltas
from tests.entrypoints.openai.test_api_server import FakeClient
from v1engine.config import EngineConfig
from v1engine.engine.async_llm import AsyncLLM
from v1engine.engine.metrics import ServerMetrics
from v1engine.entrypoints.openai.api_server import build_app, build_state
from v1engine.entrypoints.openai.reasoning import (
    ReasoningStream,
    opens_thinking,
    split_reasoning,
)
from v1engine.entrypoints.openai.serving_options import ServingOptions

# (text, whether the output starts inside the thinking, reasoning, content)
CASES = [
    ("<think>plan</think>answer", False, "plan", "answer"),
    ("no tags at all", False, None, "no tags at all"),
    ("thinking only", True, "thinking only", ""),
    ("plan</think>answer", True, "plan", "answer"),
    ("<think>plan</think>answer", True, "plan", "answer"),
    ("\n <think>x</think>y", False, "x", "y"),
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", ""),
    ("a</think>b</think>c", True, "a", "b</think>c"),
    ("<thi", False, None, "<thi"),
    ("x <think>late</think>", False, None, "x <think>late</think>"),
    ("</thin", True, "</thin", ""),
    ("<think></think>", False, "", ""),
]


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_a_whole_reply_splits_at_the_tags(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_a_stream_cut_anywhere_splits_the_same(text, opened, reasoning, content):
    for cuts in itertools.combinations(range(len(text) + 1), 2):
        pieces = [text[: cuts[0]], text[cuts[0] : cuts[1]], text[cuts[1] :]]
        stream = ReasoningStream(opened)
        deltas = [stream.feed(p, finished=i == 2) for i, p in enumerate(pieces)]
        assert "".join(r for r, _ in deltas) == (reasoning or ""), (pieces, deltas)
        assert "".join(c for _, c in deltas) == content, (pieces, deltas)


def test_where_each_parser_starts_the_thinking():
    assert opens_thinking("deepseek_r1", "<|user|>hi<|assistant|>")
    assert opens_thinking("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("qwen3", None)


def _chat(tokenizer, parser: str, pieces: list[str], stream: bool, **extra):
    options = ServingOptions(reasoning_parser=parser)
    return scripted_chat(tokenizer, options, "".join(pieces), stream, **extra)


REPLY = ["<think>", "The user greets me.", "</think>", "Hello! How can I help?"]


def test_the_chat_reply_carries_its_thinking_in_reasoning(tokenizer):
    message = _chat(tokenizer, "qwen3", REPLY, stream=False).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (
        "The user greets me.",
        "Hello! How can I help?",
    )
    # deepseek_r1: the thinking is open from the start; a reply cut before </think> is all
    # reasoning, with no content.
    cut = _chat(tokenizer, "deepseek_r1", REPLY[1:2], stream=False).json()
    message = cut["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("The user greets me.", None)
    # qwen3 without a <think> of the output or the prompt: all content.
    plain = _chat(tokenizer, "qwen3", REPLY[3:], stream=False).json()["choices"][0]["message"]
    assert (plain["reasoning"], plain["content"]) == (None, "Hello! How can I help?")


def test_the_chat_stream_sends_thinking_then_content_with_no_tag(tokenizer):
    deltas = stream_deltas(_chat(tokenizer, "qwen3", REPLY, stream=True))
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ("The user greets me.", "Hello! How can I help?")
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning") for d in deltas[first_content:])


def test_a_constrained_reply_is_all_content(tokenizer):
    # The grammar governs the whole output, so nothing of it is thinking.
    response = _chat(
        tokenizer,
        "deepseek_r1",
        ['{"a": 1}'],
        stream=False,
        response_format={"type": "json_object"},
    )
    message = response.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, '{"a": 1}')


def test_an_earlier_turns_thinking_reaches_the_template_under_both_names(tokenizer):
    template = "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.reasoning }}]{% endfor %}"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning": "be kind"},
        {"role": "assistant", "content": "hello", "reasoning_content": "be brief"},
    ]

    async def scenario():
        engine = AsyncLLM(FakeClient(), tokenizer, EngineConfig(), ServerMetrics("m", 2048))
        options = ServingOptions(chat_template=template)
        app = build_app(build_state(engine, tokenizer, ["m"], "/model", options=options))
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/tokenize", json={"messages": messages})

    tokens = asyncio.run(scenario()).json()["tokens"]
    assert tokenizer.decode(tokens) == "[|][be kind|be kind][be brief|be brief]"


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_leaves_the_thinking_out(tokenizer, stream):
    response = _chat(tokenizer, "qwen3", REPLY, stream, include_reasoning=False)
    if not stream:
        message = response.json()["choices"][0]["message"]
        reasoning, content = message["reasoning"], message["content"]
    else:
        deltas = stream_deltas(response)
        reasoning = "".join(d.get("reasoning") or "" for d in deltas) or None
        content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == (None, "Hello! How can I help?")


# Shows what the template got: the variables, then the last message.
EFFORT_TEMPLATE = (
    "{% if enable_thinking is defined %}thinking={{ enable_thinking }};{% endif %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }};{% endif %}"
    "{{ messages[-1]['content'] }}"
)


@pytest.mark.parametrize(
    "body, prompt",
    [
        ({}, "hi"),
        ({"reasoning_effort": "low"}, "thinking=True;effort=low;hi"),
        ({"reasoning_effort": "none"}, "thinking=False;effort=none;hi"),
        # The request's own template variables win.
        (
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
            "thinking=True;effort=none;hi",
        ),
    ],
)
def test_reasoning_effort_reaches_the_chat_template_as_vllm_passes_it(tokenizer, body, prompt):
    options, added = ServingOptions(chat_template=EFFORT_TEMPLATE), []
    response = scripted_chat(tokenizer, options, "ok", False, added=added, **body)
    assert response.status_code == 200
    assert tokenizer.decode(added[0].prompt_token_ids) == prompt


def test_an_unknown_reasoning_effort_is_a_400_naming_it(tokenizer):
    options = ServingOptions(chat_template=EFFORT_TEMPLATE)
    response = scripted_chat(tokenizer, options, "ok", False, reasoning_effort="extreme")
    assert response.status_code == 400
    assert "reasoning_effort" in response.json()["error"]["message"]
