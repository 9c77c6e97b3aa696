"""vLLM's dialect of the OpenAI API against a real `python -m v1engine.serve` (tiny random
llama with SmolLM2's tokenizer, TP=1 on CPU), driven by the official `openai` client: echo (and
scoring with `max_tokens: 0`), batched prompts, prompt logprobs, vLLM's sampling fields doing
what they say (logit_bias, min_tokens, bad_words, allowed_token_ids), the 400s for fields it cannot
honour, and the one warning for fields it does not know. One server serves the whole module.
"""

from __future__ import annotations

import math
import re

import httpx
import openai
import pytest

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog"
BATCH = ["Once upon a time there was", "1, 2, 3, 4, 5,"]


def _complete(client: openai.OpenAI, prompt, max_tokens: int = 5, extra_body=None, **kwargs):
    """A greedy completion that runs to max_tokens."""
    extra_body = {"ignore_eos": True, **(extra_body or {})}
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body=extra_body,
        **kwargs,
    )


def _counts(usage) -> tuple[int, int, int]:
    # Not cached_tokens: a prompt sent again is served from the prefix cache.
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


# -- echo ------------------------------------------------------------------------------------------
def test_echo_puts_the_prompt_before_the_completion(client, tokenizer):
    plain = _complete(client, PROMPT)
    echo = _complete(client, PROMPT, echo=True)
    assert echo.choices[0].text == PROMPT + plain.choices[0].text
    assert _counts(echo.usage) == _counts(plain.usage)
    token_ids = tokenizer.encode(PROMPT)
    by_ids = _complete(client, token_ids, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(token_ids) + plain.choices[0].text
    stream = _complete(client, PROMPT, echo=True, stream=True)
    chunks = [chunk.choices[0].text for chunk in stream]
    assert chunks[0].startswith(PROMPT)  # the first chunk carries the prompt
    assert "".join(chunks) == echo.choices[0].text


def test_echo_with_max_tokens_0_returns_the_prompt_only(client):
    scored = _complete(client, PROMPT, max_tokens=0, echo=True)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    assert scored.usage.total_tokens == scored.usage.prompt_tokens > 0
    streamed = list(_complete(client, PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == PROMPT


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_with_logprobs_scores_the_prompt_tokens(client, tokenizer, max_tokens):
    num_prompt_tokens = len(tokenizer.encode(PROMPT))
    out = _complete(client, PROMPT, max_tokens=max_tokens, echo=True, logprobs=1)
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(logprobs.tokens) == num_prompt_tokens + max_tokens == len(logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(math.isfinite(v) and v <= 0 for v in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert out.usage.completion_tokens == max_tokens


def test_prompt_logprobs_extra_on_completions_and_chat(client, tokenizer):
    token_ids = tokenizer.encode(PROMPT)
    out = _complete(client, PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].prompt_logprobs
    assert len(entries) == len(token_ids) and entries[0] is None
    for token_id, entry in zip(token_ids[1:], entries[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert all(set(lp) == {"logprob", "rank", "decoded_token"} for lp in entry.values())
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    assert chat.prompt_logprobs[0] is None and all(len(e) == 1 for e in chat.prompt_logprobs[1:])
    # Without the field, both answer a null one.
    assert _complete(client, PROMPT, max_tokens=1).choices[0].prompt_logprobs is None
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert plain.prompt_logprobs is None


# -- batched prompts -------------------------------------------------------------------------------
@pytest.mark.parametrize("as_token_ids", [False, True], ids=["text", "token_ids"])
def test_batched_prompts_are_prompt_major_and_sum_usage(client, tokenizer, as_token_ids):
    prompts = [tokenizer.encode(p) for p in BATCH] if as_token_ids else BATCH
    alone = [_complete(client, p) for p in prompts]
    assert alone[0].choices[0].text != alone[1].choices[0].text  # else the order is untested
    batch = _complete(client, prompts, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    expected = [a.choices[0].text for a in alone for _ in range(2)]
    assert [c.text for c in batch.choices] == expected
    # Each prompt counts once, each of its n completions apart.
    num_prompt = sum(a.usage.prompt_tokens for a in alone)
    num_completion = 2 * sum(a.usage.completion_tokens for a in alone)
    assert _counts(batch.usage) == (num_prompt, num_completion, num_prompt + num_completion)
    stream = _complete(client, prompts, n=2, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == expected
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(batch.usage)


def test_a_bad_prompt_in_a_batch_fails_the_request(client):
    with pytest.raises(openai.BadRequestError, match="prompt 1 of the batch") as info:
        _complete(client, ["fine", ""])
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="empty") as info:
        _complete(client, [])
    assert info.value.body["param"] == "prompt"
    assert _complete(client, ["still", "serving"]).usage.completion_tokens == 10


# -- every field, the 400s, unknown fields ---------------------------------------------------------
def test_every_vllm_sampling_field_is_accepted(server, client):
    extra = {
        "top_k": 5,
        "min_p": 0.01,
        "repetition_penalty": 1.1,
        "min_tokens": 1,
        "ignore_eos": True,
        "stop_token_ids": [99],  # outside allowed_token_ids: it never ends the text
        "include_stop_str_in_output": False,
        "allowed_token_ids": list(range(100, 200)),
        "bad_words": ["zebra"],
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "truncate_prompt_tokens": 5,
        "priority": 0,  # under the default policy (first come, first served) only 0 is taken
        "use_beam_search": False,
        "length_penalty": 1.0,  # beam search's; its default is accepted without it
    }
    kwargs = dict(model=MODEL, max_tokens=3, seed=1, logit_bias={"150": 5}, extra_body=extra)
    kwargs["user"] = "user-1234"  # OpenAI's end-user id: accepted, unused
    num_warnings = server.log_text().count("ignored:")
    out = client.completions.create(prompt=PROMPT, **kwargs)
    assert out.usage.completion_tokens == 3
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=2, **kwargs
    )
    assert chat.usage.completion_tokens == 3
    assert server.log_text().count("ignored:") == num_warnings  # every field is known


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        ({"best_of": 3}, "best_of", "best_of is not supported"),
        ({"suffix": "!"}, "suffix", "suffix is not supported"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream=True"),
        ({"max_tokens": 0}, "max_tokens", "echo"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias", "logit_bias"),
        ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs", "stream"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs", "--max-logprobs"),
        ({"extra_body": {"priority": 1}}, "priority", "--scheduling-policy priority"),
    ],
    ids=[
        "best_of",
        "suffix",
        "stream_options",
        "max_tokens 0",
        "logit_bias",
        "plp+stream",
        "plp",
        "priority",
    ],
)
def test_fields_it_cannot_honour_are_400s_naming_them(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError, match=words) as info:
        client.completions.create(model=MODEL, prompt="hi", **{"max_tokens": 1, **kwargs})
    assert info.value.body["param"] == param


def test_chat_refuses_best_of_and_stream_options_without_stream(client):
    messages = [{"role": "user", "content": "hi"}]
    for extra, param in [
        ({"extra_body": {"best_of": 2}}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **extra)
        assert info.value.body["param"] == param


def test_unknown_fields_are_ignored_with_one_warning(server, client):
    extra = {"frobnicate_a": 1, "frobnicate_b": {"x": [1]}}
    out = _complete(client, PROMPT, max_tokens=1, extra_body={"ignore_eos": True, **extra})
    assert out.usage.completion_tokens == 1
    lines = [line for line in server.log_text().splitlines() if "frobnicate" in line]
    assert len(lines) == 1, lines
    assert "ignored: {'frobnicate_a', 'frobnicate_b'}" in lines[0]


def test_truncate_prompt_tokens_lets_a_long_prompt_in(client):
    out = _complete(
        client,
        [7] * 300,
        max_tokens=2,
        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 10},
    )
    assert out.usage.prompt_tokens == 10 and out.usage.completion_tokens == 2


# -- the sampling fields change the answer ---------------------------------------------------------
def test_logit_bias_forces_a_token(client, tokenizer):
    forced = tokenizer.encode(" banana")[0]
    out = _complete(client, PROMPT, max_tokens=4, logit_bias={str(forced): 100})
    assert out.choices[0].text == tokenizer.decode([forced] * 4)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3,
        temperature=0.0,
        logit_bias={str(forced): 100},
    )
    assert chat.choices[0].message.content == tokenizer.decode([forced] * 3)


def _single_token(tokenizer, word: str) -> int:
    (token_id,) = tokenizer.encode(word)
    return token_id


def test_min_tokens_holds_off_stop_tokens(client, tokenizer):
    # The bias makes " red" greedy's every choice; as a stop token it ends the text at once,
    # unless min_tokens holds it off (masked) for the first 4 tokens.
    red = _single_token(tokenizer, " red")
    extra = {"ignore_eos": False, "stop_token_ids": [red]}
    kwargs = dict(max_tokens=8, logit_bias={str(red): 100})
    plain = _complete(client, PROMPT, extra_body=extra, **kwargs)
    assert plain.usage.completion_tokens == 1 and plain.choices[0].finish_reason == "stop"
    held = _complete(client, PROMPT, extra_body={**extra, "min_tokens": 4}, **kwargs)
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    assert held.choices[0].stop_reason == red


def test_bad_words_never_appear(client, tokenizer):
    red = _single_token(tokenizer, " red")
    kwargs = dict(max_tokens=6, logit_bias={str(red): 100})
    assert _complete(client, PROMPT, **kwargs).choices[0].text == " red" * 6
    banned = _complete(client, PROMPT, logprobs=0, extra_body={"bad_words": ["red"]}, **kwargs)
    tokens = banned.choices[0].logprobs.tokens  # each generated token's text
    assert len(tokens) == 6 and not {" red", "red"} & set(tokens)


def test_allowed_token_ids_restrict_every_token(client, tokenizer):
    allowed = [tokenizer.encode(w)[0] for w in (" red", " green", " blue")]
    out = _complete(client, PROMPT, max_tokens=6, extra_body={"allowed_token_ids": allowed})
    pieces = [tokenizer.decode([t]) for t in allowed]
    text = out.choices[0].text
    for piece in pieces:
        text = text.replace(piece, "")
    assert text == "" and out.usage.completion_tokens == 6


# -- logprobs that name tokens by id ------------------------------------------------------------
def test_return_tokens_as_token_ids_names_every_logprobs_token_by_id(client, tokenizer):
    as_ids = {"return_tokens_as_token_ids": True}
    by_text = _complete(client, PROMPT, logprobs=2, echo=True).choices[0].logprobs
    by_id = _complete(client, PROMPT, logprobs=2, echo=True, extra_body=as_ids).choices[0].logprobs
    ids = [int(re.fullmatch(r"token_id:(\d+)", token).group(1)) for token in by_id.tokens]
    assert ids[: len(tokenizer.encode(PROMPT))] == tokenizer.encode(PROMPT)  # echoed, then 5
    assert [tokenizer.decode([i]) for i in ids] == by_text.tokens
    assert by_id.token_logprobs == by_text.token_logprobs
    for top_by_id, top_by_text in zip(by_id.top_logprobs[1:], by_text.top_logprobs[1:]):
        names = [tokenizer.decode([int(key.removeprefix("token_id:"))]) for key in top_by_id]
        assert set(names) == set(top_by_text) and len(top_by_id) >= len(top_by_text)
    messages = [{"role": "user", "content": PROMPT}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=3, temperature=0.0, logprobs=True)
    chat = client.chat.completions.create(top_logprobs=2, extra_body=as_ids, **kwargs)
    for entry in chat.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", entry.token)
        assert bytes(entry.bytes) == entry.token.encode()
        assert all(top.token.startswith("token_id:") for top in entry.top_logprobs)


# -- prefix-cache salt ---------------------------------------------------------------------------
def test_cache_salt_shares_the_prefix_cache_only_within_a_salt(client):
    prompt = "Salted prefix: " + " ".join(f"word{i}" for i in range(40))  # several blocks

    def cached(salt, api="completions") -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        if api == "chat":
            messages = [{"role": "user", "content": prompt}]
            out = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=1, extra_body=extra
            )
        else:
            out = _complete(client, prompt, max_tokens=1, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-1") == 0
    assert cached("tenant-1") > 0  # the same salt shares
    assert cached("tenant-2") == cached(None) == 0  # another salt, or none, does not
    assert cached("tenant-1", "chat") == 0 < cached("tenant-1", "chat")
    with pytest.raises(openai.BadRequestError) as info:
        cached("")
    assert info.value.body["param"] == "cache_salt"
    with pytest.raises(openai.BadRequestError, match="use_beam_search does not take cache_salt"):
        _complete(client, prompt, extra_body={"cache_salt": "x", "use_beam_search": True}, n=2)


# -- token ids in the response -----------------------------------------------------------------
def test_return_token_ids_gives_the_prompts_and_outputs_ids(client, tokenizer):
    ids = {"return_token_ids": True}
    whole = _complete(client, BATCH, max_tokens=6, n=2, extra_body=ids)
    for choice in whole.choices:
        prompt = BATCH[choice.index // 2]
        assert choice.prompt_token_ids == tokenizer.encode(prompt)
        assert len(choice.token_ids) == 6 and tokenizer.decode(choice.token_ids) == choice.text
    streamed: dict[int, list[int]] = {}
    prompts: dict[int, list] = {}
    for chunk in _complete(client, BATCH, max_tokens=6, n=2, extra_body=ids, stream=True):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).extend(choice.token_ids or [])
            if choice.prompt_token_ids is not None:
                assert choice.index not in prompts  # only in a choice's first chunk
                prompts[choice.index] = choice.prompt_token_ids
    assert streamed == {c.index: c.token_ids for c in whole.choices}
    assert prompts == {c.index: c.prompt_token_ids for c in whole.choices}
    plain = _complete(client, PROMPT).choices[0]
    assert plain.token_ids is None and plain.prompt_token_ids is None


@pytest.mark.parametrize("tools", [False, True])
def test_chat_return_token_ids_add_up_when_streamed(client, tokenizer, tools):
    messages = [{"role": "user", "content": PROMPT}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0.0)
    kwargs["extra_body"] = {"return_token_ids": True, "ignore_eos": True}
    if tools:  # the call's tokens are held back while its name is unfinished
        function = {"name": "f", "parameters": {"type": "object"}}
        kwargs.update(tools=[{"type": "function", "function": function}], tool_choice="required")
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert len(choice.token_ids) == whole.usage.completion_tokens == 8
    assert len(whole.prompt_token_ids) == whole.usage.prompt_tokens
    if not tools:
        assert tokenizer.decode(choice.token_ids) == choice.message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert all(c.prompt_token_ids is None for c in chunks[1:])
    streamed = [t for c in chunks for ch in c.choices for t in (ch.token_ids or [])]
    assert streamed == choice.token_ids


def test_any_origin_may_call_by_default_as_in_vllm(server):
    headers = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(server.url + "/v1/chat/completions", headers=headers)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
