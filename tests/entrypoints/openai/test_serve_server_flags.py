"""Request ids and vLLM's server flags against a real `python -m v1engine.serve` and the official
`openai` client: a client's id (body `request_id` or the X-Request-Id header, which wins) names
the response, one id may serve two requests at once, a bad id is a 400 naming where it came from;
--enable-request-id-headers puts an X-Request-Id on every response, --return-tokens-as-token-ids
names every request's logprob tokens by id, --enable-log-requests logs requests (prompts cut to
--max-log-len), --allowed-origins limits CORS to the origins given, --scheduling-policy priority
takes each request's `priority`, --root-path serves behind a proxy's prefix,
--disable-fastapi-docs serves no docs, --profiler-config serves /start_profile and /stop_profile,
dev mode (V1ENGINE_SERVER_DEV_MODE=1) with --enable-sleep-mode serves /sleep, /wake_up,
/is_sleeping, /reset_prefix_cache and /collective_rpc, the periodic stats line (vLLM's "Avg
prompt throughput: ...") reports the work done, and --speculative-config streams the tokens a
step accepts as plain decoding would, counted in vLLM's spec_decode metrics."""

from __future__ import annotations

import concurrent.futures
import glob
import json
import re
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import serve_module
from tests.timeouts import scaled

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
ORIGIN = "https://ui.example"
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("traces"))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, traces):
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": traces})
    flags = ("--profiler-config", profiler)
    flags += ("--enable-request-id-headers", "--return-tokens-as-token-ids")
    flags += ("--enable-log-requests", "--max-log-len", "10")
    flags += ("--allowed-origins", f'["{ORIGIN}"]', "--scheduling-policy", "priority")
    flags += ("--root-path", "/llm", "--disable-fastapi-docs", "--enable-sleep-mode")
    flags += ("--speculative-config", json.dumps(SPECULATIVE))
    yield from serve_module(
        tiny_model,
        tmp_path_factory,
        "--served-model-name",
        MODEL,
        *flags,
        tp=1,
        env={"V1ENGINE_LOG_STATS_INTERVAL": "0.2", "V1ENGINE_SERVER_DEV_MODE": "1"},
    )


def test_behind_a_proxy_that_strips_its_prefix_the_routes_answer(server):
    # --root-path /llm: the proxy serves /llm/... and forwards it without the prefix.
    for path in ("/health", "/v1/models"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert httpx.get(server.url + "/openapi.json").status_code == 404  # no docs


def test_a_profile_of_served_requests_is_written_by_the_worker(server, client, traces):
    assert httpx.post(server.url + "/start_profile").status_code == 200
    again = httpx.post(server.url + "/start_profile")
    assert again.status_code == 400
    assert "a profile is already running" in again.json()["error"]["message"]
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4).usage
    assert httpx.post(server.url + "/stop_profile").status_code == 200
    (trace,) = glob.glob(f"{traces}/rank0.*.pt.trace.json.gz")
    (table,) = glob.glob(f"{traces}/rank0.*.txt")
    assert "Self CPU" in open(table).read()
    assert "no profile is running" in httpx.post(server.url + "/stop_profile").text


def test_dev_mode_puts_the_engine_to_sleep_and_wakes_it(server, client):
    def chat() -> str:
        done = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
        )
        return done.choices[0].message.content

    awake = chat()
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    assert httpx.post(server.url + "/sleep", params={"level": 1}).status_code == 200
    try:
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}
        refused = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
        )
        assert refused.status_code == 503
        assert "asleep" in refused.json()["error"]["message"]
        again = httpx.post(server.url + "/sleep", params={"level": 2})
        assert again.status_code == 400 and "asleep already" in again.text
        bad = httpx.post(server.url + "/wake_up", params={"tags": ["gpu"]})
        assert bad.status_code == 400 and "wake_up tags must be" in bad.text
    finally:
        tags = {"tags": ["weights", "kv_cache"]}
        assert httpx.post(server.url + "/wake_up", params=tags).status_code == 200
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
    assert chat() == awake
    rpc = httpx.post(server.url + "/collective_rpc", json={"method": "check_health"})
    assert rpc.json() == {"results": [None]}
    unknown = httpx.post(server.url + "/collective_rpc", json={"method": "format_disk"})
    assert unknown.status_code == 400 and "unknown RPC method 'format_disk'" in unknown.text


def test_the_clients_id_names_the_response(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"request_id": "job-7"}
    )
    assert chat.id == "chatcmpl-job-7"
    out = client.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=2,
        extra_body={"request_id": "job-8"},
        extra_headers={"X-Request-Id": "trace-9"},  # the header wins, as in vLLM
    )
    assert out.id == "cmpl-trace-9"


def test_one_id_may_serve_two_requests_at_once(client):
    def complete(prompt: str) -> str:
        out = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0.0,
            extra_body={"request_id": "same", "ignore_eos": True},
        )
        return out.id

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(complete, ["a b c", "d e f", "g h i", "j k l"]))
    assert ids == ["cmpl-same"] * 4


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"extra_body": {"request_id": ""}}, "request_id"),
        ({"extra_body": {"request_id": "a\nforged log line"}}, "request_id"),
        ({"extra_headers": {"X-Request-Id": "x" * 300}}, "X-Request-Id"),
    ],
    ids=["empty", "newline", "too long"],
)
def test_a_bad_id_is_a_400_naming_its_source(client, kwargs, param):
    with pytest.raises(openai.BadRequestError, match="1 to 256 printable") as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, **kwargs)
    assert info.value.body["param"] == param


def test_every_response_carries_an_x_request_id(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    given = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "mine"})
    assert given.status_code == 200 and given.headers["x-request-id"] == "mine"
    fresh = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": -1})
    assert fresh.status_code == 400  # errors too
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])
    assert httpx.get(server.url + "/health").headers["x-request-id"]


def test_the_server_flag_names_every_requests_logprob_tokens_by_id(client):
    out = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=3, logprobs=1, extra_body={"ignore_eos": True}
    )
    assert all(re.fullmatch(r"token_id:\d+", t) for t in out.choices[0].logprobs.tokens)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=1
    )
    for entry in chat.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", entry.token)
        assert all(re.fullmatch(r"token_id:\d+", top.token) for top in entry.top_logprobs)


def test_requests_are_logged_with_their_prompt_cut(server, client):
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=1)
    lines = [line for line in server.log_text().splitlines() if out.id in line]
    assert len(lines) == 1, lines
    assert "Received request" in lines[0] and "prompt 'The quick ' (first 10 of 19)" in lines[0]
    assert "max_tokens=1" in lines[0]  # the sampling params


def test_cors_answers_the_allowed_origin_only(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x"}
    url = server.url + "/v1/completions"
    allowed = httpx.options(url, headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(url, headers={"Origin": "https://elsewhere.example", **preflight})
    assert other.status_code == 400
    assert "access-control-allow-origin" not in other.headers
    models = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert models.headers["access-control-allow-origin"] == ORIGIN


def test_the_stats_line_reports_the_generation(server, client):
    client.completions.create(
        model=MODEL, prompt="hi", max_tokens=32, extra_body={"ignore_eos": True}
    )
    busy = re.compile(r"Avg generation throughput: ([1-9]\d*\.\d) tokens/s, Running: \d+ reqs")
    deadline = time.monotonic() + scaled(30)
    while not busy.search(server.log_text()):  # every 0.2 s, one for an interval with tokens
        assert time.monotonic() < deadline, server.log_text()[-3000:]
        time.sleep(0.05)


def test_the_priority_policy_takes_each_requests_priority(client):
    def complete(priority: int) -> str:
        out = client.completions.create(
            model=MODEL,
            prompt="Once upon",
            max_tokens=6,
            temperature=0.0,
            extra_body={"priority": priority, "ignore_eos": True},
        )
        return out.choices[0].text

    assert complete(-3) == complete(0) == complete(7)
    with pytest.raises(openai.BadRequestError, match="does not take priority") as info:
        client.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=2,
            extra_body={"priority": 1, "use_beam_search": True},
        )
    assert info.value.body["param"] == "priority"


def test_speculative_decoding_streams_what_it_accepts(server, client):
    def spec_counts() -> list[float]:
        text = httpx.get(server.url + "/metrics").text
        names = ("num_draft_tokens", "num_accepted_tokens")
        pattern = r'^vllm:spec_decode_{}_total{{model_name="tiny"}} (\S+)$'
        return [float(re.search(pattern.format(n), text, re.M).group(1)) for n in names]

    before = spec_counts()
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "one two three one two three one two three"}],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**request).choices[0].message.content
    chunks = client.chat.completions.create(**request, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    drafted, accepted = (after - b for after, b in zip(spec_counts(), before))
    assert drafted > accepted > 0
