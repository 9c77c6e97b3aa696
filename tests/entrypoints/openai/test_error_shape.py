"""Every error any endpoint of a real server returns has one shape, vLLM's:
`{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status as an int.

The engine's death (503, also as a stream's error event before [DONE]) is walked in
test_api_server.py and test_serve_faults.py, where it can be provoked.
"""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.openai.server_utils import serve_module

API_KEY = "test-key"
MODEL = "tiny"
MAX_BODY_BYTES = 64 << 10
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
LONG = "hi " * 300  # over the 256-token context
LONG_CHAT = [{"role": "user", "content": LONG}]
IMAGE = [{"role": "user", "content": [{"type": "image_url"}]}]

# (id, method, path, headers, body: a dict sent as JSON or raw bytes, status)
CASES = [
    ("unknown route", "GET", "/nope", AUTH, None, 404),
    ("unknown /v1 route", "POST", "/v1/nope", AUTH, {}, 404),
    ("GET on a POST route", "GET", C, AUTH, None, 405),
    ("POST on a GET route", "POST", "/v1/models", AUTH, {}, 405),
    ("GET on /tokenize", "GET", "/tokenize", {}, None, 405),
    ("no API key", "GET", "/v1/models", {}, None, 401),
    ("wrong API key", "POST", C, {"Authorization": "Bearer nope"}, {"prompt": "hi"}, 401),
    ("malformed JSON", "POST", C, JSON, b'{"prompt": ', 400),
    ("invalid UTF-8", "POST", C, JSON, b'{"prompt": "\xff\xfe"}', 400),
    ("body not an object", "POST", CHAT, JSON, b"[1, 2]", 400),
    ("empty body", "POST", "/tokenize", {"Content-Type": "application/json"}, b"", 400),
    ("wrong field type", "POST", C, AUTH, {"prompt": "hi", "max_tokens": "x"}, 400),
    ("missing field", "POST", CHAT, AUTH, {"model": MODEL}, 400),
    ("bad sampling value", "POST", C, AUTH, {"prompt": "hi", "temperature": -1}, 400),
    ("over a request limit", "POST", C, AUTH, {"prompt": "hi", "n": 10**6}, 400),
    ("body too large", "POST", C, JSON, b" " * (MAX_BODY_BYTES + 1), 413),
    ("body too large, tokenize", "POST", "/tokenize", {}, b" " * (MAX_BODY_BYTES + 1), 413),
    ("unknown model, completions", "POST", C, AUTH, {"model": "x", "prompt": "hi"}, 404),
    ("unknown model, chat", "POST", CHAT, AUTH, {"model": "x", "messages": HI}, 404),
    ("unknown model, tokenize", "POST", "/tokenize", {}, {"model": "x", "prompt": "hi"}, 404),
    ("unknown model, detokenize", "POST", "/detokenize", {}, {"model": "x", "tokens": [1]}, 404),
    ("unknown model, retrieve", "GET", "/v1/models/x", AUTH, None, 404),
    ("context length, completions", "POST", C, AUTH, {"prompt": LONG, "max_tokens": 1}, 400),
    ("context length, chat", "POST", CHAT, AUTH, {"messages": LONG_CHAT}, 400),
    ("max_tokens over the context", "POST", C, AUTH, {"prompt": "hi", "max_tokens": 1000}, 400),
    ("token id outside the vocabulary", "POST", C, AUTH, {"prompt": [10**6]}, 400),
    ("detokenize outside the vocabulary", "POST", "/detokenize", {}, {"tokens": [-1]}, 400),
    ("unsupported content part", "POST", CHAT, AUTH, {"messages": IMAGE}, 400),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    args = ("--api-key", API_KEY, "--served-model-name", MODEL)
    args += ("--max-request-body-bytes", str(MAX_BODY_BYTES))
    yield from serve_module(tiny_model, tmp_path_factory, *args, tp=1)


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "status"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_every_error_has_the_one_shape(server, method, path, headers, body, status):
    if isinstance(body, bytes):
        kwargs = {"content": body}
    else:
        kwargs = {} if body is None else {"json": body}
    response = httpx.request(method, server.url + path, headers=headers, timeout=60, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(response.json()) == {"error"}
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["code"], int)
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["param"] is None or isinstance(error["param"], str)


def test_the_server_still_serves(server):
    response = httpx.post(
        server.url + C, headers=AUTH, json={"model": MODEL, "prompt": "ok", "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
