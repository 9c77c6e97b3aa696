"""The API server's app and AsyncLLM in-process, over a fake engine client: the paths that are
hard to time against a real engine (its death mid-request, a stop string the core does not see, a
cancelled stream, a refused n > 1 child). No processes are started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import traceback

import httpx
import pytest

from tests.timeouts import scaled
from v1engine.config import EngineConfig
from v1engine.core_protocol import EngineCoreInfo
from v1engine.engine.async_llm import AsyncLLM
from v1engine.engine.core_process import EngineDeadError, summarize_dead_reason
from v1engine.engine.metrics import ServerMetrics
from v1engine.engine_args import EngineArgs
from v1engine.entrypoints.openai.api_server import build_app, build_state
from v1engine.entrypoints.openai.http_options import HTTPOptions
from v1engine.entrypoints.openai.limits import RequestLimits
from v1engine.entrypoints.openai.protocol import CompletionResponse
from v1engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from v1engine.entrypoints.openai.serving_options import ServingOptions
from v1engine.executor.errors import RemoteFailure, WorkerError
from v1engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason
from v1engine.sampling_params import SamplingParams
from v1engine.serve import make_arg_parser


class FakeClient:
    """The AsyncMPClient surface: records adds and aborts; the test feeds outputs."""

    info = EngineCoreInfo(num_blocks=64, block_size=16, max_model_len=2048, vocab_size=49152)

    def __init__(self, refuse_after: int | None = None) -> None:
        self.added: list = []
        self.aborted: list[str] = []
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.refuse_after = refuse_after

    async def add_request(self, request) -> None:
        if self.refuse_after is not None and len(self.added) >= self.refuse_after:
            raise ValueError("request refused")
        self.added.append(request)

    async def abort_requests(self, request_ids) -> None:
        self.aborted.extend(request_ids)

    async def get_output(self) -> EngineCoreOutputs:
        item = await self.outputs.get()
        if isinstance(item, Exception):
            raise item
        return item

    def push(self, request_id: str, token_ids: list[int], finish: str | None = None) -> None:
        reason = None if finish is None else FinishReason(finish)
        output = EngineCoreOutput(request_id, token_ids, finish_reason=reason)
        self.outputs.put_nowait(EngineCoreOutputs(outputs=[output]))

    async def wait_added(self, count: int) -> list:
        while len(self.added) < count:
            await asyncio.sleep(0.01)
        return self.added


def _make(tokenizer, client: FakeClient) -> tuple[AsyncLLM, httpx.AsyncClient, list]:
    dead_calls: list[bool] = []
    engine = AsyncLLM(client, tokenizer, EngineConfig(), ServerMetrics("m", 2048))
    engine.start(on_dead=lambda: dead_calls.append(True))
    app = build_app(build_state(engine, tokenizer, ["m"], "/model"))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")
    return engine, http, dead_calls


def _finished(engine: AsyncLLM, outcome: str) -> float:
    registry = engine.metrics.registry
    labels = {"model_name": "m", "finished_reason": outcome}
    return registry.get_sample_value("vllm:request_success_total", labels)


def _body(stream: bool = False, **extra) -> dict:
    return {"model": "m", "prompt": "hello", "max_tokens": 50, "stream": stream, **extra}


def test_engine_death_fails_requests_turns_health_503_and_stops_the_server(tokenizer):
    async def scenario():
        client = FakeClient()
        engine, http, dead_calls = _make(tokenizer, client)
        whole = asyncio.create_task(http.post("/v1/completions", json=_body()))
        stream = asyncio.create_task(http.post("/v1/completions", json=_body(stream=True)))
        added = await client.wait_added(2)
        for request in added:
            client.push(request.request_id, [28])
        await asyncio.sleep(0.05)
        client.outputs.put_nowait(EngineDeadError("worker rank 1 died"))
        whole, stream = await whole, await stream
        health = await http.get("/health")
        late = await http.post("/v1/completions", json=_body())
        await engine.stop()
        return whole, stream, health, late, dead_calls

    whole, stream, health, late, dead_calls = asyncio.run(scenario())
    assert whole.status_code == 503 and whole.json()["error"]["code"] == 503
    assert "worker rank 1 died" in whole.json()["error"]["message"]
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == 503
    assert events[-1] == "[DONE]"
    assert health.status_code == 503 and late.status_code == 503
    assert dead_calls == [True]


def test_a_background_response_fails_with_the_engines_death_in_its_error(tokenizer):
    async def scenario():
        client = FakeClient()
        engine, http, _ = _make(tokenizer, client)
        body = {"model": "m", "input": "hello", "background": True}
        started = (await http.post("/v1/responses", json=body)).json()
        await client.wait_added(1)
        client.outputs.put_nowait(EngineDeadError("worker rank 1 died"))
        loop, url = asyncio.get_running_loop(), f"/v1/responses/{started['id']}"
        deadline = loop.time() + scaled(30)
        while (polled := (await http.get(url)).json())["status"] in ("queued", "in_progress"):
            assert loop.time() < deadline, polled
            await asyncio.sleep(0.01)
        await engine.stop()
        return started, polled

    started, polled = asyncio.run(scenario())
    assert started["status"] == "queued"
    assert polled["status"] == "failed" and "worker rank 1 died" in polled["error"]["message"]
    assert polled["error"]["code"] == "server_error"


def _worker_fault() -> None:
    raise RuntimeError("boom reading /srv/models/x.bin")


def test_a_dead_engines_reason_reaches_clients_as_one_line_without_paths():
    # The shape the engine core sends: a crashed loop's traceback around a worker's.
    try:
        _worker_fault()
    except RuntimeError as e:
        failure = RemoteFailure.from_exception(1, e)
    try:
        raise WorkerError("execute_model", [failure])
    except WorkerError:
        reason = f"the engine core died: the engine core loop crashed:\n{traceback.format_exc()}"
    summary = summarize_dead_reason(reason)
    assert summary == (
        "the engine core died: the engine core loop crashed: WorkerError: "
        "collective_rpc('execute_model') failed on rank 1: rank 1: RuntimeError: boom reading "
        "<path>"
    )
    assert summarize_dead_reason(summary) == summary


def test_stop_string_finishes_the_request_and_aborts_it_in_the_core(tokenizer):
    token_ids = tokenizer.encode(" one two three four")

    async def scenario():
        client = FakeClient()
        engine, http, _ = _make(tokenizer, client)
        response = asyncio.create_task(http.post("/v1/completions", json=_body(stop="three")))
        (request,) = await client.wait_added(1)
        for token_id in token_ids:
            client.push(request.request_id, [token_id])
        response = await response
        await engine.stop()
        return response, request, client, engine

    response, request, client, engine = asyncio.run(scenario())
    choice = response.json()["choices"][0]
    assert choice["text"] == " one two " and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "three"
    assert client.aborted == [request.request_id]
    assert _finished(engine, "stop") == 1


def test_leaving_a_stream_early_aborts_the_request(tokenizer):
    async def scenario():
        client = FakeClient()
        engine, _, _ = _make(tokenizer, client)
        outputs = await engine.add_request(
            "r", "hi", [1, 2], SamplingParams(max_tokens=50), "delta"
        )
        (request,) = client.added

        async def read() -> None:
            async for _ in outputs:
                pass

        reader = asyncio.create_task(read())
        client.push(request.request_id, [28])
        await asyncio.sleep(0.05)
        reader.cancel()  # what Starlette does when the client disconnects
        await asyncio.gather(reader, return_exceptions=True)
        await asyncio.sleep(0.01)
        await engine.stop()
        return client, engine

    client, engine = asyncio.run(scenario())
    assert client.aborted == ["0_r"]
    assert not engine.output_processor.has_unfinished_requests()
    assert _finished(engine, "abort") == 1


def test_a_refused_child_leaves_nothing_running(tokenizer):
    async def scenario():
        client = FakeClient(refuse_after=1)
        engine, http, _ = _make(tokenizer, client)
        response = await http.post("/v1/completions", json=_body(n=2))
        await asyncio.sleep(0.01)
        await engine.stop()
        return response, client, engine

    response, client, engine = asyncio.run(scenario())
    assert response.status_code == 400 and "refused" in response.json()["error"]["message"]
    assert client.aborted == [client.added[0].request_id]
    assert not engine.output_processor.has_unfinished_requests()
    assert not engine._queues


class BrokenClient(FakeClient):
    async def add_request(self, request) -> None:
        raise RuntimeError("a bug in /srv/v1engine/engine/core_client.py")


def test_an_unexpected_error_is_a_short_500_logged_once(tokenizer):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("v1engine").addHandler(handler)

    async def scenario():
        engine, http, _ = _make(tokenizer, BrokenClient())
        response = await http.post("/v1/completions", json=_body())
        health = await http.get("/health")
        await engine.stop()
        return response, health

    try:
        response, health = asyncio.run(scenario())
    finally:
        logging.getLogger("v1engine").removeHandler(handler)
    assert response.status_code == 500 and health.status_code == 200
    error = response.json()["error"]
    assert error["message"] == "internal server error; the server log has the details"
    assert error["code"] == 500 and error["type"] == "server_error"
    (logged,) = [record for record in records if record.exc_info]
    assert logged.getMessage() == "unexpected error serving POST /v1/completions"


def test_a_stream_that_fails_ends_with_an_error_event(tokenizer, monkeypatch):
    async def failing_chunks(self, request_id, outputs, request):
        yield CompletionResponse(id=request_id, model="m", choices=[])
        raise RuntimeError("a bug in /srv/v1engine/entrypoints/openai/serving_completion.py")

    monkeypatch.setattr(OpenAIServingCompletion, "_stream_chunks", failing_chunks)

    async def scenario():
        engine, http, _ = _make(tokenizer, FakeClient())
        response = await http.post("/v1/completions", json=_body(stream=True))
        await engine.stop()
        return response

    response = asyncio.run(scenario())
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"] == []
    error = json.loads(events[1])["error"]
    assert error["message"] == "internal server error; the server log has the details"
    assert error["code"] == 500 and set(error) == {"message", "type", "param", "code"}
    assert events[2:] == ["[DONE]"]


def test_docs_can_be_switched_off_and_carry_the_proxys_root_path(tokenizer):
    async def get(http_options: HTTPOptions, root_path: str, *paths: str) -> list[httpx.Response]:
        engine = AsyncLLM(FakeClient(), tokenizer, EngineConfig(), ServerMetrics("m", 2048))
        app = build_app(build_state(engine, tokenizer, ["m"], "/model"), http_options)
        transport = httpx.ASGITransport(app, root_path=root_path)  # as uvicorn's --root-path
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return [await http.get(path) for path in paths]

    args = make_arg_parser().parse_args(["--root-path", "/llm", "--disable-fastapi-docs"])
    options = HTTPOptions.from_cli_args(args)
    assert (args.root_path, options.disable_docs) == ("/llm", True)
    paths = ("/openapi.json", "/docs", "/redoc", "/health", "/v1/models")
    codes = [r.status_code for r in asyncio.run(get(options, "/llm", *paths))]
    assert codes == [404, 404, 404, 200, 200]
    schema, docs = asyncio.run(get(HTTPOptions(), "/llm", "/openapi.json", "/docs"))
    assert schema.json()["servers"] == [{"url": "/llm"}] and "/llm/openapi.json" in docs.text


def test_the_deprecated_disable_log_requests_is_taken_as_vllm_takes_it(caplog):
    parser = make_arg_parser()
    options = ServingOptions.from_cli_args(parser.parse_args(["--disable-log-requests"]))
    assert options.log_requests is False
    assert "--disable-log-requests is deprecated" in caplog.text
    both = parser.parse_args(["--disable-log-requests", "--enable-log-requests"])
    with pytest.raises(ValueError, match="contradict each other; drop one"):
        ServingOptions.from_cli_args(both)


def test_every_engine_arg_and_request_limit_is_a_flag():
    parser = make_arg_parser()
    args = parser.parse_args([])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    args = parser.parse_args(["--tensor-parallel-size", "2", "--no-enable-prefix-caching"])
    assert EngineArgs.from_cli_args(args).tensor_parallel_size == 2
    assert EngineArgs.from_cli_args(args).enable_prefix_caching is False
    limits = RequestLimits.from_cli_args(parser.parse_args(["--max-n", "4"]))
    assert limits == RequestLimits(max_n=4)
    assert RequestLimits.from_cli_args(args) == RequestLimits()
    with pytest.raises(ValueError, match="--max-request-body-bytes must be >= 1"):
        RequestLimits(max_request_body_bytes=0)
    # --max-logprobs is the engine's (it holds every request to it), read by the limits too.
    args = parser.parse_args(["--max-logprobs", "-1"])
    assert EngineArgs.from_cli_args(args).max_logprobs == -1
    assert RequestLimits.from_cli_args(args).max_logprobs == -1
    options = ServingOptions.from_cli_args(parser.parse_args(["--max-stored-responses", "7"]))
    assert options.max_stored_responses == 7
    assert ServingOptions.from_cli_args(args) == ServingOptions()
    with pytest.raises(ValueError, match="--max-stored-responses must be >= 0, got -1"):
        ServingOptions.from_cli_args(parser.parse_args(["--max-stored-responses", "-1"]))
