"""A fault on rank 1 while the server streams (vLLM issue #23985: with TP=3 and rank 1 raising in
execute_model, streams stalled, /health stayed 200 and the server never exited). Each test runs
its own `python -m v1engine.serve` with FailingStepWorker, arms the fault once every stream has
produced output, and checks: every stream ends with an error naming rank 1 within 5 s, /health
answers 503, the server exits 1, and no process or shared resource is left.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer
from tests.executor.fault_worker import FAILING_STEP_WORKER, inject_fault, private_model_dir
from tests.timeouts import scaled

MODEL = "tiny"
NUM_STREAMS = 6


async def _watch_health(client: httpx.AsyncClient, seen: list, stop: asyncio.Event) -> None:
    """Polls /health on one kept-alive connection until `stop`, keeping (when the request was
    sent, its status or None when the server did not answer)."""
    while not stop.is_set():
        sent_at = time.monotonic()
        try:
            code = (await client.get("/health")).status_code
        except httpx.HTTPError:
            code = None
        seen.append((sent_at, code))
        await asyncio.sleep(0.005)


async def _stream(client: openai.AsyncOpenAI, started: asyncio.Event) -> tuple[float, Any]:
    """Streams one completion; returns when it ended and its error (None if it finished)."""
    try:
        stream = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=200, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for _ in stream:
            started.set()
    except openai.APIError as e:
        return time.monotonic(), e
    return time.monotonic(), None


async def _complete(client: openai.AsyncOpenAI) -> tuple[float, Any]:
    """One whole (non-streaming) completion: its end and its error, like `_stream`."""
    try:
        await client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=200, extra_body={"ignore_eos": True}
        )
    except openai.APIError as e:
        return time.monotonic(), e
    return time.monotonic(), None


async def _fault_while_streaming(server: RemoteServer, model_dir: str, action: str) -> tuple:
    """Opens the streams and one whole request, arms the fault once each stream has output,
    and waits for the server to exit; returns when the fault was armed, every request's end
    and error (the whole request's last), and the /health polls."""
    health: list[tuple[float, int | None]] = []
    stop = asyncio.Event()
    async with (
        openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=scaled(60)
        ) as client,
        httpx.AsyncClient(base_url=server.url, timeout=scaled(5)) as health_client,
    ):
        events = [asyncio.Event() for _ in range(NUM_STREAMS)]
        tasks = [asyncio.create_task(_stream(client, e)) for e in events]
        tasks.append(asyncio.create_task(_complete(client)))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), scaled(60))
        watch = asyncio.create_task(_watch_health(health_client, health, stop))
        inject_fault(model_dir, action)
        armed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), scaled(60))
        await asyncio.to_thread(server.proc.wait, scaled(60))
        stop.set()
        await watch
        return armed_at, results, health


def run_fault(model_dir: str, log_dir: str, action: str, *args: str, tp: int = 2) -> str:
    """The whole scenario of the module doc; returns the server's log."""
    server = RemoteServer(
        model_dir, log_dir, "--served-model-name", MODEL, "--worker-cls", FAILING_STEP_WORKER,
        *args, tp=tp,
    )  # fmt: skip
    try:
        server.wait_ready()
        armed_at, results, health = asyncio.run(_fault_while_streaming(server, model_dir, action))
        assert max(end for end, _ in results) - armed_at < scaled(5)
        for _, error in results:
            assert isinstance(error, openai.APIError), error
            assert "rank 1" in error.message, error.message
            assert "Traceback" not in error.message and "fault_worker.py" not in error.message
        whole_error = results[-1][1]
        assert isinstance(whole_error, openai.APIStatusError) and whole_error.status_code == 503
        # Once a client has heard of the death, /health never says 200 again: it says 503
        # until the server stops accepting (one uvicorn tick, up to 0.1 s, so a poll may miss
        # that window), then nothing.
        died_at = min(end for end, _ in results)
        assert {code for sent_at, code in health if sent_at > died_at} <= {503, None}, health
        assert server.proc.returncode == 1, server.log_text()[-3000:]
        server.assert_gone(scaled(15))
        return server.log_text()
    finally:
        server.kill()


@pytest.mark.parametrize("action", ["raise", "kill"])
def test_tp2_rank_1_fault_ends_every_stream_and_the_server(tiny_model, tmp_path, action):
    model_dir = private_model_dir(tiny_model, str(tmp_path / "model"))
    log = run_fault(model_dir, str(tmp_path), action)
    assert "engine is dead" in log
    if action == "raise":  # the worker's traceback reaches the log once
        assert log.count('fault_worker.py", line') == 1, log[-5000:]


@pytest.mark.slow
def test_tp3_default_model_rank_1_raising_ends_every_stream_and_the_server(tmp_path):
    from v1engine.model.hf_config import default_model_path, prepare_checkpoint

    model_dir = private_model_dir(prepare_checkpoint(default_model_path()), str(tmp_path / "m"))
    log = run_fault(model_dir, str(tmp_path), "raise", tp=3)
    assert "rank 0, rank 2 did not answer" in log
