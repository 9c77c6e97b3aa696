"""Malformed and abusive requests against a real `python -m v1engine.serve` subprocess: each gets a
4xx whose message names the field or limit at fault (never a 500, never a hang), and /health keeps
answering within a second throughout, even while a request that takes seconds to tokenize runs.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.entrypoints.openai.server_utils import serve_module
from tests.timeouts import scaled

MODEL = "tiny"
VOCAB_SIZE = 49152  # SmolLM2's, which the tiny checkpoint shares
C, CHAT = "/v1/completions", "/v1/chat/completions"
VALID = {
    C: {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
}


def _nested_json(depth: int) -> bytes:
    return b'{"model": "tiny", "max_tokens": 1, "prompt": ' + b"[" * depth + b"]" * depth + b"}"


def _chunks():
    """9 MiB without a Content-Length (chunked), so only counting the bytes can stop it."""
    for _ in range(9):
        yield b" " * (1 << 20)


_TEN_MB = json.dumps({"prompt": "x " * (5 << 20)}).encode()
_TOO_DEEP = _nested_json(10_000)
_BAD_UTF8 = b'{"model": "tiny", "prompt": "\xff\xfe"}'
_NAN = b'{"prompt": "hi", "temperature": NaN}'
_INF = b'{"messages": [{"role": "user", "content": "x"}], "repetition_penalty": Infinity}'
_IMAGE = [{"role": "user", "content": [{"type": "image_url"}]}]

# (id, endpoint, fields replacing a valid body's (or the raw body), the error's param, then
# words its message must contain). Status 400 unless STATUS says otherwise.
CASES = [
    ("token id negative", C, {"prompt": [-1]}, "prompt", "[-1]", "vocabulary"),
    ("token id huge", C, {"prompt": [10**30]}, "prompt", "vocabulary"),
    ("token id = vocab size", C, {"prompt": [5, VOCAB_SIZE]}, "prompt", f"[0, {VOCAB_SIZE})"),
    ("n huge", C, {"n": 1_000_000}, "n", "1000000", "128", "--max-n"),
    ("n zero", CHAT, {"n": 0}, "n", "n must be >= 1"),
    ("logprobs huge", C, {"logprobs": 10**9}, "logprobs", "20", "--max-logprobs"),
    ("logprobs negative", C, {"logprobs": -2}, "logprobs", "logprobs must be >= 0, or -1"),
    # vLLM's -1 (every token's) is over a server's default limit too.
    ("logprobs -1", C, {"logprobs": -1}, "logprobs", "-1", "--max-logprobs -1"),
    (
        "top_logprobs huge",
        CHAT,
        {"logprobs": True, "top_logprobs": 10**9},
        "top_logprobs",
        "--max-logprobs",
    ),
    ("top_logprobs alone", CHAT, {"top_logprobs": 2}, "top_logprobs", "logprobs=true"),
    (
        "1000 stop strings",
        C,
        {"stop": [f"s{i}" for i in range(1000)]},
        "stop",
        "1000",
        "--max-stop-sequences",
    ),
    (
        "stop string of 10k chars",
        C,
        {"stop": "x" * 10_000},
        "stop",
        "10000",
        "--max-stop-sequence-chars",
    ),
    (
        "1000 stop token ids",
        CHAT,
        {"stop_token_ids": list(range(1000))},
        "stop_token_ids",
        "--max-stop-sequences",
    ),
    ("stop token id negative", C, {"stop_token_ids": [-1]}, "stop_token_ids", "vocabulary"),
    ("empty stop string", C, {"stop": [""]}, "stop", "empty"),
    ("max_tokens negative", C, {"max_tokens": -1}, "max_tokens", "max_tokens must be >= 1"),
    ("max_tokens huge", CHAT, {"max_tokens": 10**30}, "max_tokens", "maximum context length"),
    ("temperature negative", C, {"temperature": -0.5}, "temperature", "must be >= 0"),
    ("temperature NaN", C, _NAN, "temperature", "finite number"),
    ("repetition_penalty Infinity", CHAT, _INF, "repetition_penalty", "finite number"),
    ("top_p zero", CHAT, {"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ("presence_penalty 5", C, {"presence_penalty": 5}, "presence_penalty", "[-2, 2]"),
    ("seed over int64", C, {"seed": 2**64}, "seed", "9223372036854775807"),
    ("unknown model", C, {"model": "gpt-17"}, "model", "gpt-17", "does not exist"),
    ("empty prompt", C, {"prompt": ""}, "prompt", "prompt is empty"),
    ("empty token list", C, {"prompt": []}, "prompt", "prompt is empty"),
    ("prompt too long", C, {"prompt": [7] * 300}, "prompt", "300 tokens", "is 256 tokens"),
    ("empty messages", CHAT, {"messages": []}, "messages", "messages must not be empty"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard"}]}, "messages", "role", "'user'"),
    ("image content part", CHAT, {"messages": _IMAGE}, "messages", "text content parts"),
    ("best_of", C, {"best_of": 5}, "best_of", "best_of is not supported"),
    (
        "include_reasoning without a parser",
        CHAT,
        {"include_reasoning": False},
        "include_reasoning",
        "--reasoning-parser",
    ),
    ("an empty prompt in a batch", C, {"prompt": ["a", ""]}, "prompt", "prompt 1 of the batch"),
    # Wrong JSON types, one main field each.
    ("prompt: int", C, {"prompt": 5}, "prompt", "valid string"),
    ("prompt: mixed list", C, {"prompt": [1, "a"]}, "prompt", "prompt.list[int].1"),
    ("messages: str", CHAT, {"messages": "hi"}, "messages", "valid list"),
    (
        "content: int",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        "messages",
        "messages.0.content",
    ),
    ("model: list", CHAT, {"model": ["tiny"]}, "model", "valid string"),
    ("max_tokens: str", C, {"max_tokens": "lots"}, "max_tokens", "valid integer"),
    ("n: str", CHAT, {"n": "many"}, "n", "valid integer"),
    ("temperature: str", C, {"temperature": "hot"}, "temperature", "valid number"),
    ("stream: str", C, {"stream": "maybe"}, "stream", "valid boolean"),
    ("stop: int", C, {"stop": 5}, "stop", "stop.str"),
    ("logprobs: dict", CHAT, {"logprobs": {}}, "logprobs", "valid boolean"),
    ("stream_options: str", CHAT, {"stream_options": "x"}, "stream_options", "valid dict"),
    # Bodies that are not a usable JSON object.
    ("body of 10 MB", C, _TEN_MB, None, "10485", "--max-request-body-bytes"),
    ("chunked body of 9 MiB", C, _chunks, None, "more than 8388608", "--max-request-body-bytes"),
    ("invalid UTF-8", C, _BAD_UTF8, None, "not valid UTF-8"),
    ("JSON nested 10,000 deep", C, _TOO_DEEP, None, "nested too deeply"),
    ("truncated JSON", C, b'{"prompt": ', None, "malformed JSON"),
    ("JSON array body", CHAT, b"[1, 2]", None, "must be a JSON object", "a JSON list"),
    ("empty body", CHAT, b"", None, "body is empty"),
]
STATUS = {"unknown model": 404, "body of 10 MB": 413, "chunked body of 9 MiB": 413}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # The loop runs once; it ends once the server has stopped cleanly.
    for remote in serve_module(tiny_model, tmp_path_factory, "--served-model-name", MODEL, tp=1):
        yield remote
    assert "Traceback" not in remote.log_text()  # no bad input reached an unexpected error


def _assert_healthy(client: httpx.Client) -> None:
    start = time.monotonic()
    assert client.get("/health").status_code == 200
    assert time.monotonic() - start < scaled(1.0)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_bad_request_gets_a_4xx_naming_what_is_wrong(server, case):
    name, path, body, param, *words = case
    with httpx.Client(base_url=server.url, timeout=scaled(60)) as client:
        if isinstance(body, dict):
            response = client.post(path, json={**VALID[path], **body})
        else:
            content = body() if callable(body) else body
            headers = {"Content-Type": "application/json"}
            response = client.post(path, content=content, headers=headers)
        error = response.json()["error"]
        assert response.status_code == STATUS.get(name, 400), error
        for word in words:
            assert word in error["message"], error
        assert error["param"] == param, error
        assert "Traceback" not in error["message"] and ".py" not in error["message"]
        _assert_healthy(client)


def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    # Just under the body limit: seconds of tokenizing, in a thread, then a 400 (too long).
    body = json.dumps({**VALID[C], "prompt": "hello world " * 690_000}).encode()
    assert len(body) < 8 << 20

    async def scenario() -> tuple[httpx.Response, list[float]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=scaled(120)) as client:
            headers = {"Content-Type": "application/json"}
            slow = asyncio.create_task(client.post(C, content=body, headers=headers))
            latencies = []
            while not slow.done():
                start = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.05)
            return await slow, latencies

    response, latencies = asyncio.run(scenario())
    assert response.status_code == 400
    assert "maximum context length is 256" in response.json()["error"]["message"]
    assert len(latencies) > 1, "the huge prompt was answered before /health was asked"
    assert max(latencies) < scaled(1.0), latencies


def test_the_server_still_serves(server):
    body = {**VALID[C], "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(server.url + C, json=body, timeout=scaled(60))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
