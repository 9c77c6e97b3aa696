"""`python -m v1engine.serve` end to end: a real server subprocess (tiny random llama with SmolLM2's
tokenizer, TP=2 on CPU) driven by the official `openai` client.

One server serves the whole module (started before the first test's leak snapshot); it requires
an API key, so every client here sends one and the 401 tests omit or garble it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import (
    RemoteServer,
    hang_up_once,
    metric,
    openai_client,
    serve_module,
)
from tests.timeouts import scaled

API_KEY = "test-key"
MODEL = "tiny"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
ABORTED = 'vllm:request_success_total{finished_reason="abort",model_name="tiny"}'
FINISHED_BY_LENGTH = 'vllm:request_success_total{finished_reason="length",model_name="tiny"}'
RUNNING = 'vllm:num_requests_running{model_name="tiny"}'
PROMPTS = [f"Prompt number {i}: the quick brown fox" + " jumps" * i for i in range(10)]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from serve_module(
        tiny_model, tmp_path_factory, "--api-key", API_KEY, "--served-model-name", MODEL
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server, API_KEY)


# -- plain endpoints -------------------------------------------------------------------------------
def test_models_health_version_and_startup_line(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ping").status_code == 200  # SageMaker's health check
    assert httpx.post(server.url + "/ping").status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": "0.1.0"}
    line = next(s for s in server.log_text().splitlines() if "listening on" in s)
    for part in ("tensor_parallel_size=2", "device=cpu", "KV cache 2048 blocks", MODEL):
        assert part in line


# -- completions and chat --------------------------------------------------------------------------
def test_completion_text_and_token_prompts(client):
    text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, **GREEDY)
    choice = text.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert text.usage.completion_tokens == 6
    assert text.usage.total_tokens == text.usage.prompt_tokens + 6
    token_ids = [19556, 905, 28, 253]
    ids = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=6, **GREEDY)
    assert ids.usage.prompt_tokens == 4 and ids.choices[0].text


def test_chat_uses_the_chat_template(client):
    tokenizer_prompt_len = 31  # SmolLM2's template: its system prompt plus the user turn
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, **GREEDY
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens == tokenizer_prompt_len
    assert reply.usage.completion_tokens == 5


def test_streaming_equals_whole_with_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, **GREEDY)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_streaming_equals_whole_with_usage(client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_counts_each_choice_so_far(client, endpoint):
    # vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage. The
    # chunks' logprobs count their tokens (a slow reader may get two steps in one chunk).
    options = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=MODEL, max_tokens=5, n=2, stream=True, stream_options=options, **GREEDY)
    if endpoint == "chat":
        messages = [{"role": "user", "content": "Hi"}]
        chunks = list(client.chat.completions.create(messages=messages, logprobs=True, **kwargs))
        assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
        assert [c.usage.completion_tokens for c in chunks[:2]] == [0, 0]  # the role deltas
        chunks = chunks[2:]
    else:
        chunks = list(client.completions.create(prompt=PROMPTS[4], logprobs=0, **kwargs))
    *per_choice, final = chunks
    prompt_tokens = final.usage.prompt_tokens
    counted = {0: 0, 1: 0}
    for chunk in per_choice:
        (choice,) = chunk.choices
        logprobs = choice.logprobs
        counted[choice.index] += len(logprobs.content if endpoint == "chat" else logprobs.tokens)
        assert chunk.usage.prompt_tokens == prompt_tokens
        assert chunk.usage.completion_tokens == counted[choice.index]
        assert chunk.usage.total_tokens == prompt_tokens + counted[choice.index]
    assert counted == {0: 5, 1: 5}
    assert final.choices == [] and final.usage.completion_tokens == 10
    # Without include_usage vLLM sends no usage at all; here that is a 400 naming the options.
    options["include_usage"] = False
    with pytest.raises(openai.BadRequestError, match="send include_usage: true") as info:
        client.completions.create(prompt=PROMPTS[4], **kwargs)
    assert info.value.body["param"] == "stream_options"


def test_n_seed_and_sampling(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, n=3, temperature=1.0, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # the n samples differ (seed + index)
    other = client.completions.create(**{**kwargs, "seed": 8})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
    assert first.usage.completion_tokens == 24


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_n_choices_come_one_per_chunk(client, endpoint):
    # Clients commonly read `chunk.choices[0]`: with n > 1 a chunk holding two choices would
    # lose the second there (OpenAI and vLLM send one choice per chunk).
    kwargs = dict(model=MODEL, max_tokens=6, n=3, temperature=1.0, seed=11)
    if endpoint == "chat":
        create, kwargs["messages"] = (
            client.chat.completions.create,
            [{"role": "user", "content": "Hi"}],
        )
        whole = [c.message.content for c in create(**kwargs).choices]
    else:
        create, kwargs["prompt"] = client.completions.create, PROMPTS[2]
        whole = [c.text for c in create(**kwargs).choices]
    texts = ["", "", ""]
    for chunk in create(**kwargs, stream=True):
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += (choice.delta.content if endpoint == "chat" else choice.text) or ""
    assert texts == whole


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12, **GREEDY)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=12, stop=[stop], **GREEDY
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=12, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[4], max_tokens=4, logprobs=2, **GREEDY
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == out.choices[0].text
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and len(top) == 2 and top[token] == value == max(top.values())
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == entry.top_logprobs[0].logprob


# -- errors ----------------------------------------------------------------------------------------
def test_api_key_is_required(server):
    for key in (None, "wrong"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        response = httpx.get(server.url + "/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == 401
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert httpx.get(server.url + "/health").status_code == 200  # not behind the key


def test_error_statuses(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        client.completions.create(model=MODEL, prompt="hi " * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length") as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1000)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="temperature") as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=0, max_tokens=1
        )
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[10**6], max_tokens=1)
    response = httpx.post(
        server.url + "/v1/completions",
        content=b'{"model": "tiny", "prompt": ',
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert "malformed JSON" in response.json()["error"]["message"]
    # Without --profiler-config there is no profiling route, and without dev mode no control
    # route, as in vLLM.
    for path in ("/start_profile", "/sleep", "/reset_prefix_cache", "/collective_rpc"):
        assert httpx.post(server.url + path).status_code == 404, path
    # None of that disturbed the engine.
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage


# -- disconnects and load --------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(server, stream):
    aborted_before = metric(server, ABORTED)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 240, "stream": stream}
    body.update(ignore_eos=True)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = server.url + "/v1/completions"
    if stream:
        with httpx.stream("POST", url, json=body, headers=headers) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk arrived: the request is running; hang up
    else:
        hang_up_once(  # once it runs: it has 240 tokens to go
            server, "/v1/completions", body, lambda: metric(server, RUNNING) > 0, headers
        )
    deadline = time.monotonic() + scaled(20)
    while metric(server, ABORTED) == aborted_before:
        assert time.monotonic() < deadline, "the disconnected request was never aborted"
        time.sleep(0.1)
    assert metric(server, RUNNING) == 0


def test_200_concurrent_streams_equal_requests_made_alone(server, client):
    alone = {
        p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, **GREEDY).choices[0].text
        for p in PROMPTS
    }
    finished_before = metric(server, FINISHED_BY_LENGTH)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(200)]
    results = asyncio.run(_stream_all(server, prompts))
    assert len(results) == 200
    for prompt, (text, finish_reason, num_tokens) in zip(prompts, results):
        assert (text, finish_reason, num_tokens) == (alone[prompt], "length", 8)
    finished = metric(server, FINISHED_BY_LENGTH) - finished_before
    assert finished == 200


async def _stream_all(server: RemoteServer, prompts: list[str]) -> list[tuple[str, str, int]]:
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    ) as client:

        async def one(prompt: str) -> tuple[str, str, int]:
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
                **GREEDY,
            )
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            return text, finish, chunks[-1].usage.completion_tokens

        return await asyncio.gather(*(one(p) for p in prompts))
