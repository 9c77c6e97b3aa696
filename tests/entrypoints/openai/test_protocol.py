"""The request models without a server: request JSON -> SamplingParams, the fields a request
ignores, the logprobs shapes the responses use, and an echo response assembled from engine
outputs (built here, so that it is tested before the engine computes prompt logprobs)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.limits import RequestLimits
from v1engine.entrypoints.openai.logprobs import (
    completion_logprobs,
    prompt_logprobs_field,
    prompt_rows,
)
from v1engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from v1engine.entrypoints.openai.serving_chat import _chat_logprobs
from v1engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from v1engine.entrypoints.openai.serving_outputs import merge_async_iterators
from v1engine.outputs import CompletionOutput, Logprob, RequestOutput
from v1engine.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "hi"}]
# Every sampling field, none at its default; the SamplingParams values each must give.
SAMPLING_JSON = {
    "n": 3,
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 7,
    "stop": ["x", "yz"],
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "logit_bias": {"5": 100, "17": -2.5},
    "top_k": 4,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "min_tokens": 2,
    "ignore_eos": True,
    "stop_token_ids": [9, 10],
    "include_stop_str_in_output": True,
    "allowed_token_ids": [1, 2, 3],
    "bad_words": ["foo", "bar baz"],
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 12,
    "prompt_logprobs": 2,
}
SAMPLING_VALUES = {
    **SAMPLING_JSON,
    "logit_bias": {5: 100.0, 17: -2.5},
}


def _params(request: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    return request.to_sampling_params(default_max_tokens=100)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_sampling_field_reaches_sampling_params(endpoint):
    if endpoint == "completions":
        request = CompletionRequest.model_validate({"prompt": "hi", **SAMPLING_JSON})
    else:
        request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **SAMPLING_JSON})
    params = _params(request)
    for name, value in SAMPLING_VALUES.items():
        assert getattr(params, name) == value, name
    assert request.ignored_fields == []


def test_defaults_are_sampling_params_defaults():
    params = _params(CompletionRequest.model_validate({"prompt": "hi"}))
    defaults = SamplingParams()
    for name in SAMPLING_VALUES:
        assert getattr(params, name) == getattr(defaults, name), name
    assert params.max_tokens == 16 and params.logprobs is None


@pytest.mark.parametrize("key", ["abc", "1.5", ""])
def test_logit_bias_key_that_is_not_a_token_id_names_logit_bias(key):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {key: 1.0}})
    assert info.value.errors()[0]["loc"][0] == "logit_bias"


def test_echo_asks_for_prompt_logprobs_and_max_tokens_0_scores_only():
    echo = CompletionRequest.model_validate({"prompt": "hi", "echo": True, "logprobs": 3})
    assert _params(echo).prompt_logprobs == 3 and _params(echo).logprobs == 3
    assert not echo.scores_prompt_only
    score = CompletionRequest.model_validate(
        {"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0}
    )
    assert score.scores_prompt_only and _params(score).max_tokens == 1
    explicit = CompletionRequest.model_validate(
        {"prompt": "hi", "echo": True, "logprobs": 1, "prompt_logprobs": 4}
    )
    assert _params(explicit).prompt_logprobs == 4
    plain = CompletionRequest.model_validate({"prompt": "hi", "logprobs": 2})
    assert _params(plain).prompt_logprobs is None
    echo_only = CompletionRequest.model_validate({"prompt": "hi", "echo": True})
    assert _params(echo_only).prompt_logprobs is None


def test_chat_logprobs_and_max_completion_tokens():
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, "max_tokens": 5}
    params = _params(ChatCompletionRequest.model_validate(body))
    assert params.logprobs == 2 and params.max_tokens == 5
    params = _params(ChatCompletionRequest.model_validate({**body, "max_completion_tokens": 7}))
    assert params.max_tokens == 7
    params = _params(ChatCompletionRequest.model_validate({"messages": MESSAGES}))
    assert params.logprobs is None and params.max_tokens == 100


def test_unknown_fields_are_listed_once_sorted_top_level_and_in_stream_options():
    body = {
        "prompt": "hi",
        "zeta": 1,
        "alpha": {"nested": True},
        "echo": True,
        "best_of": 1,
        "suffix": None,
    }
    assert CompletionRequest.model_validate(body).ignored_fields == ["alpha", "zeta"]
    chat = {
        "messages": [{"role": "user", "content": "hi", "tool_calls": []}],
        "response_format": {"type": "text"},  # known: structured outputs
        "echo": True,  # a completions field, unknown to chat
    }
    assert ChatCompletionRequest.model_validate(chat).ignored_fields == ["echo"]
    # stream_options is where a misspelt usage flag would hide (continuous_usage_stats is known).
    options = {"include_usage": True, "continuous_usage_stats": True, "include_usages": True}
    streamed = {"prompt": "hi", "stream": True, "stream_options": options, "zeta": 1}
    fields = CompletionRequest.model_validate(streamed).ignored_fields
    assert fields == ["zeta", "stream_options.include_usages"]


# -- logprobs shapes ------------------------------------------------------------------------------
def _row(entries: dict[int, tuple[float, int, str]]) -> dict[int, Logprob]:
    return {t: Logprob(lp, rank, text) for t, (lp, rank, text) in entries.items()}


def test_echoed_prompt_rows_start_without_a_logprob_and_offsets_run_on():
    prompt_token_ids = [10, 11, 12]
    prompt_logprobs = [
        None,
        _row({11: (-0.5, 1, " b")}),
        # The prompt's own token ranks 3rd; the top-1 is another one.
        _row({12: (-float("inf"), 3, " c"), 99: (-0.1, 1, " z")}),
    ]
    rows = prompt_rows(prompt_token_ids, prompt_logprobs, lambda token_id: "a", False)
    assert [r.token for r in rows] == ["a", " b", " c"]
    assert [r.logprob for r in rows] == [None, -0.5, -9999.0]  # -inf is not JSON
    assert rows[0].top_logprobs is None
    assert list(rows[2].top_logprobs) == [" z", " c"]  # best rank first
    result = completion_logprobs(rows, text_offset=5)
    assert result.text_offset == [5, 6, 8]
    assert result.token_logprobs[0] is None and result.top_logprobs[0] is None


def test_prompt_logprobs_field_has_vllms_shape():
    field = prompt_logprobs_field([None, _row({7: (-1.25, 2, "x"), 3: (-0.5, 1, "y")})])
    assert field[0] is None
    assert {k: v.model_dump() for k, v in field[1].items()} == {
        "7": {"logprob": -1.25, "rank": 2, "decoded_token": "x"},
        "3": {"logprob": -0.5, "rank": 1, "decoded_token": "y"},
    }


# -- merging a batch's streams --------------------------------------------------------------------
async def _ticks(name: str, delays: list[float], closed: list[str]):
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
    finally:
        closed.append(name)


def test_merge_interleaves_all_items_with_their_iterator_index():
    async def main():
        closed: list[str] = []
        merged = merge_async_iterators(
            [_ticks("a", [0, 0.02, 0], closed), _ticks("b", [0.01, 0], closed)]
        )
        return [item async for item in merged], closed

    items, closed = asyncio.run(main())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert [item for i, item in items if i == 0] == ["a0", "a1", "a2"]
    assert sorted(closed) == ["a", "b"]


def test_closing_the_merge_early_closes_every_stream():
    async def main():
        closed: list[str] = []
        merged = merge_async_iterators([_ticks("a", [0, 10], closed), _ticks("b", [10], closed)])
        first = await anext(merged)
        await merged.aclose()
        await asyncio.sleep(0)  # the cancelled waits run their clean-up
        return first, closed

    first, closed = asyncio.run(main())
    assert first == (0, "a0") and sorted(closed) == ["a", "b"]


def test_an_error_in_one_stream_ends_the_merge_and_closes_the_others():
    async def failing():
        yield "x"
        raise ValueError("boom")

    async def main():
        closed: list[str] = []
        items = []
        with pytest.raises(ValueError, match="boom"):
            async for item in merge_async_iterators([failing(), _ticks("b", [10], closed)]):
                items.append(item)
        await asyncio.sleep(0)
        return items, closed

    items, closed = asyncio.run(main())
    assert items == [(0, "x")] and closed == ["b"]


# -- an echo response, assembled from engine outputs ---------------------------------------------
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_response_puts_prompt_rows_first_and_drops_the_scoring_token(tiny_model, max_tokens):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    serving = OpenAIServingCompletion(None, tokenizer, ["tiny"], 256, RequestLimits())
    ids = tokenizer.encode("Hello big world")
    prompt_logprobs = [None] + [
        _row({t: (-1.0, 3, tokenizer.decode([t])), 5: (-0.5, 1, "x")}) for t in ids[1:]
    ]
    generated = CompletionOutput(0, " yes", [7], -0.2, [_row({7: (-0.2, 1, " yes")})], "stop")
    final = RequestOutput("r", None, ids, [generated], True, prompt_logprobs=prompt_logprobs)
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens}
    response = serving._response("cmpl-1", [final], CompletionRequest.model_validate(body))
    choice = response.choices[0]
    tail = [" yes"] if max_tokens else []
    assert choice.text == "Hello big world" + "".join(tail)
    assert choice.logprobs.tokens == ["Hello", " big", " world", *tail]
    assert choice.logprobs.text_offset[:3] == [0, 5, 9]
    assert choice.logprobs.token_logprobs[:3] == [None, -1.0, -1.0]
    assert choice.logprobs.top_logprobs[1] == {"x": -0.5, " big": -1.0}
    assert choice.prompt_logprobs[0] is None and set(choice.prompt_logprobs[1]) == {
        str(ids[1]),
        "5",
    }
    assert choice.finish_reason == ("stop" if max_tokens else "length")
    assert response.usage.completion_tokens == max_tokens


def test_minus_one_logprobs_follow_the_engines_rule_for_the_vocabulary():
    # As the engine counts it: -1 is the vocabulary's size, within any limit at least as large.
    RequestLimits(max_logprobs=100).check_num_logprobs(-1, "logprobs", vocab_size=50)
    with pytest.raises(APIError, match=r"--max-logprobs -1 \(or >= 200\)"):
        RequestLimits(max_logprobs=100).check_num_logprobs(-1, "logprobs", vocab_size=200)


def test_minus_one_logprobs_are_every_tokens_on_a_server_without_a_limit():
    with pytest.raises(APIError, match="needs a server started with --max-logprobs -1") as info:
        RequestLimits().check_num_logprobs(-1, "top_logprobs")
    assert info.value.param == "top_logprobs"
    unlimited = RequestLimits(max_logprobs=-1)
    unlimited.check_num_logprobs(-1, "top_logprobs")
    unlimited.check_num_logprobs(10**6, "logprobs")
    with pytest.raises(APIError, match="must be >= 0, or -1"):
        unlimited.check_num_logprobs(-2, "logprobs")
    # A chat's top_logprobs=-1 lists every candidate the engine sent (the whole vocabulary).
    row = {t: Logprob(logprob=-float(t), rank=t + 1, decoded_token=f"t{t}") for t in range(7)}
    output = CompletionOutput(0, "t3", [3], None, [row])
    request = ChatCompletionRequest(messages=MESSAGES, logprobs=True, top_logprobs=-1)
    (token,) = _chat_logprobs(output, request).content
    assert token.token == "t3" and [t.token for t in token.top_logprobs] == [
        f"t{t}" for t in range(7)
    ]
    assert request.to_sampling_params(8).logprobs == -1
