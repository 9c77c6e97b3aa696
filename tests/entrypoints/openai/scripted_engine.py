"""The chat endpoint in-process over a fake engine that replays a scripted reply: for testing
what the server makes of a model's text (reasoning and tool-call parsers) without a model that
would write it. The reply is tokenized with the real tokenizer and arrives one token per engine
output, then EOS, so streams see every way a tag or a call can be cut."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.entrypoints.openai.test_api_server import FakeClient
from tests.timeouts import scaled
from v1engine.config import EngineConfig
from v1engine.engine.async_llm import AsyncLLM
from v1engine.engine.metrics import ServerMetrics
from v1engine.entrypoints.openai.api_server import build_app, build_state
from v1engine.entrypoints.openai.serving_options import ServingOptions


def scripted_chat(
    tokenizer, options: ServingOptions, reply: str, stream: bool, added: list | None = None, **body
) -> httpx.Response:
    """The response to one chat request (`body` over a one-message default) whose engine
    replies `reply`; `added` gets the engine request it was sent as."""

    async def scenario() -> httpx.Response:
        client = FakeClient()
        engine = AsyncLLM(client, tokenizer, EngineConfig(), ServerMetrics("m", 2048))
        engine.start()
        app = build_app(build_state(engine, tokenizer, ["m"], "/model", options=options))
        request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            sent = asyncio.create_task(http.post("/v1/chat/completions", json=request | body))
            adding = asyncio.create_task(client.wait_added(1))
            # A request refused before it reaches the engine is answered without an add.
            await asyncio.wait([sent, adding], return_when=asyncio.FIRST_COMPLETED)
            if not adding.done():
                adding.cancel()
                await engine.stop()
                return await sent
            (request,) = adding.result()
            if added is not None:
                added.append(request)
            for token_id in tokenizer.encode(reply):
                client.push(request.request_id, [token_id])
            client.push(request.request_id, [tokenizer.eos_token_id], "stop")
            response = await sent
        await engine.stop()
        return response

    return asyncio.run(asyncio.wait_for(scenario(), scaled(60)))


def stream_deltas(response: httpx.Response) -> list[dict]:
    """The choices' deltas of a stream, in order (each chunk has at most one choice)."""
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    return [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
