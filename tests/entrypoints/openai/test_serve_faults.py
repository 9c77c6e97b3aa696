"""The server under faults, each with its own server subprocess: a worker SIGKILLed while streams
are open, a worker raising in `execute_model`, and SIGTERM during load. Nothing may hang and nothing
may be left behind; clients are told the engine died in one line, and the server log holds the
traceback once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.faulty_worker import FAULT_MESSAGE, TRIGGER
from tests.entrypoints.openai.server_utils import RemoteServer
from tests.timeouts import scaled

MODEL = "tiny"
NUM_STREAMS = 20
_EXTRA = {"ignore_eos": True}


@pytest.fixture
def server(tiny_model, tmp_path):
    remote = RemoteServer(tiny_model, str(tmp_path), "--served-model-name", MODEL)
    try:
        yield remote.wait_ready()
    finally:
        remote.kill()


async def _open_stream(client: openai.AsyncOpenAI, max_tokens: int, started: asyncio.Event):
    """Streams one completion; returns ("done", n_chunks) or ("error", exception)."""
    num_chunks = 0
    try:
        stream = await client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=max_tokens,
            stream=True,
            extra_body=_EXTRA,
        )
        async for _ in stream:
            num_chunks += 1
            started.set()
        return "done", num_chunks
    except (openai.APIError, openai.APIConnectionError) as e:
        return "error", e


async def _complete_whole(client: openai.AsyncOpenAI, max_tokens: int):
    try:
        await client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=max_tokens, extra_body=_EXTRA
        )
        return "done", None
    except openai.APIError as e:
        return "error", e


async def _load_then(server: RemoteServer, max_tokens: int, action) -> list:
    """Opens NUM_STREAMS streams and two whole requests, runs `action` once every stream has
    produced output, and returns every request's result."""
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60
    ) as client:
        events = [asyncio.Event() for _ in range(NUM_STREAMS)]
        tasks = [asyncio.create_task(_open_stream(client, max_tokens, e)) for e in events]
        tasks += [asyncio.create_task(_complete_whole(client, max_tokens)) for _ in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        action()
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)


def test_worker_sigkill_fails_every_request_and_exits_nonzero(server):
    worker = server.worker_pids()[-1]
    results = asyncio.run(_load_then(server, 240, lambda: os.kill(worker, signal.SIGKILL)))
    assert [status for status, _ in results] == ["error"] * (NUM_STREAMS + 2)
    for _, error in results[-2:]:  # the whole (non-streaming) requests: a 503 response
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503
    start = time.monotonic()
    exit_code = server.proc.wait(60)
    assert exit_code == 1, server.log_text()[-3000:]
    assert time.monotonic() - start < scaled(30)
    server.assert_gone()
    assert "engine is dead" in server.log_text()


def test_sigterm_during_load_exits_cleanly(server):
    results = asyncio.run(_load_then(server, 48, lambda: server.proc.send_signal(signal.SIGTERM)))
    # Running responses may finish within the grace period; none may hang.
    assert len(results) == NUM_STREAMS + 2
    assert server.proc.wait(60) == 0, server.log_text()[-3000:]
    server.assert_gone()
    assert "server stopped" in server.log_text()


@pytest.fixture
def slow_server(tiny_model, tmp_path):
    worker_cls = "tests.entrypoints.openai.faulty_worker.SlowWorker"
    args = ("--served-model-name", MODEL, "--worker-cls", worker_cls)
    remote = RemoteServer(tiny_model, str(tmp_path), *args, tp=1)
    try:
        yield remote.wait_ready()
    finally:
        remote.kill()


def test_sigterm_ends_requests_past_the_grace_period_with_a_503(slow_server):
    # 200 steps of SLOW_STEP_S outlast the 5 s grace period: the engine ends these requests,
    # each with a whole response, rather than uvicorn cutting their connections.
    sigterm = lambda: slow_server.proc.send_signal(signal.SIGTERM)  # noqa: E731
    results = asyncio.run(_load_then(slow_server, 200, sigterm))
    for status, error in results:
        assert status == "error" and "the server is shutting down" in str(error), error
    for _, error in results[-2:]:  # the whole (non-streaming) requests: a 503 response
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503
    assert slow_server.proc.wait(scaled(60)) == 0, slow_server.log_text()[-3000:]
    slow_server.assert_gone()
    assert "Traceback" not in slow_server.log_text()


@pytest.fixture
def faulty_server(tiny_model, tmp_path):
    worker_cls = "tests.entrypoints.openai.faulty_worker.FaultyWorker"
    args = ("--served-model-name", MODEL, "--worker-cls", worker_cls)
    remote = RemoteServer(tiny_model, str(tmp_path), *args, tp=1)
    try:
        yield remote.wait_ready()
    finally:
        remote.kill()


async def _streams_then_fault(server: RemoteServer) -> tuple[list, httpx.Response]:
    """Four streams and one whole request running, then the request that makes the worker raise;
    returns their results and the faulting request's response."""
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=scaled(60)
    ) as client:
        events = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(_open_stream(client, 240, e)) for e in events]
        tasks.append(asyncio.create_task(_complete_whole(client, 240)))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), scaled(60))
        async with httpx.AsyncClient(base_url=server.url, timeout=scaled(60)) as http:
            body = {"model": MODEL, "prompt": TRIGGER, "max_tokens": 1}
            fault = await http.post("/v1/completions", json=body)
        return await asyncio.wait_for(asyncio.gather(*tasks), scaled(60)), fault


def test_engine_death_tells_clients_in_one_line_and_logs_the_traceback_once(faulty_server):
    results, fault = asyncio.run(_streams_then_fault(faulty_server))
    assert fault.status_code == 503
    messages = [fault.json()["error"]["message"]]
    assert [status for status, _ in results] == ["error"] * 5
    messages += [error.message for _, error in results]
    for message in messages:
        assert "engine is dead" in message and FAULT_MESSAGE in message, message
        assert "Traceback" not in message and 'File "' not in message, message
        assert ".py" not in message and "\n" not in message, message
    assert faulty_server.proc.wait(scaled(60)) == 1
    faulty_server.assert_gone()
    log = faulty_server.log_text()
    # The frame that raised, printed once: the engine core logs the traceback, nobody again.
    assert log.count('faulty_worker.py", line') == 1, log[-5000:]
    assert "exiting with status 1" in log
