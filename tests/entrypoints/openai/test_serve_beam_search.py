"""vLLM's `use_beam_search` against a real `python -m v1engine.serve` (tiny random llama with
SmolLM2's tokenizer, TP=1, fp32) and the official `openai` client: n beams as n choices, the same
as the search spelled out over transformers' logits, streamed whole, the 400s for fields a search
would ignore, and a client that hangs up ending the search."""

from __future__ import annotations

import time

import openai
import pytest

from tests.entrypoints.llm_utils import hf_beam_search
from tests.entrypoints.openai.server_utils import hang_up_once, metric
from tests.model.checkpoints import load_hf_model
from tests.timeouts import scaled
from v1engine.engine.metrics import FINISHED_REASONS

MODEL = "tiny"
RUNNING = 'vllm:num_requests_running{model_name="tiny"}'
FINISHED = 'vllm:request_success_total{{finished_reason="{}",model_name="tiny"}}'
BEAM = {"use_beam_search": True, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_completion_beams_equal_the_search_over_transformers_logits(client, tiny_model, tokenizer):
    prompts = [[1, 500, 600, 700], [2, 42, 43]]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=3, extra_body=BEAM)
    hf_model = load_hf_model(tiny_model)
    expected = []
    for prompt in prompts:
        for tokens, _ in hf_beam_search(hf_model, prompt, width=3, max_tokens=5):
            expected.append(tokenizer.decode(tokens, skip_special_tokens=True))
    assert [c.index for c in out.choices] == list(range(6))  # prompt-major, best first
    assert [c.text for c in out.choices] == expected
    assert all(c.finish_reason == "length" for c in out.choices)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (7, 2 * 3 * 5)


def test_chat_streams_each_beam_whole_as_the_plain_response_has_it(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=4, n=2, extra_body=BEAM)
    plain = client.chat.completions.create(**kwargs)
    assert len(plain.choices) == 2 and plain.usage.completion_tokens == 8
    texts, finishes = {0: "", 1: ""}, {}
    chunks = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage
    assert texts == {c.index: c.message.content for c in plain.choices}
    assert finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 8


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"top_p": 0.5}, "top_p", "does not take top_p"),
        ({"stop": ["x"], "seed": 3}, "seed", "does not take seed, stop"),
        ({"logprobs": 2}, "logprobs", "does not take logprobs"),
        ({"n": 11}, "n", "--max-logprobs"),
        ({"echo": True}, "echo", "echo is not supported"),
        ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty", "beam search only"),
    ],
    ids=["top_p", "stop+seed", "logprobs", "n over max_logprobs", "echo", "length_penalty alone"],
)
def test_fields_a_search_would_ignore_are_400s_naming_them(client, extra, param, words):
    with pytest.raises(openai.BadRequestError, match=words) as info:
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={**BEAM, **extra}
        )
    assert info.value.body["param"] == param


def test_a_client_that_hangs_up_ends_the_search(server, client):
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "n": 4, **BEAM}
    finished_before = metric(server, FINISHED.format("length"))
    hang_up_once(  # once the search's first step is done: 199 are left
        server,
        "/v1/completions",
        body,
        lambda: metric(server, FINISHED.format("length")) > finished_before,
        {"X-Request-Id": "hang-up"},
    )
    # The hang-up is seen when the server logs it. No abort counter is waited for: a search
    # cancelled between two steps has no engine request left to abort.
    deadline = time.monotonic() + scaled(20)
    while "client of cmpl-hang-up" not in server.log_text():
        assert time.monotonic() < deadline, "the server never saw the client leave"
        time.sleep(0.1)
    while metric(server, RUNNING) != 0:
        assert time.monotonic() < deadline, "the search kept running"
        time.sleep(0.1)
    # No further step starts: the next request is the only one that finishes meanwhile.
    finished_before = _finished(server)
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage
    assert _finished(server) == finished_before + 1


def _finished(server) -> float:
    return sum(metric(server, FINISHED.format(reason)) for reason in FINISHED_REASONS)
