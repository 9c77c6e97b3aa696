"""OpenAIServing: what the completion and chat endpoints share.

That is the model-name check and the server's request limits, the length check against the
context, adding a request to the AsyncLLM with its errors mapped to HTTP statuses, waiting for a
final output while watching for the client to disconnect, server-sent events and usage.

Tokenizing a prompt and rendering a chat take time in proportion to the body (seconds for
megabytes), so they run in a thread (`asyncio.to_thread`): the event loop keeps answering /health
and streaming other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from v1engine.engine.async_llm import AsyncLLM, RequestAbortedError
from v1engine.engine.core_process import EngineDeadError
from v1engine.engine.output_processor import OutputKind
from v1engine.entrypoints.openai.errors import APIError, internal_error
from v1engine.entrypoints.openai.limits import RequestLimits
from v1engine.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from v1engine.logger import init_logger
from v1engine.outputs import CompletionOutput, Logprob, RequestOutput
from v1engine.sampling_params import SamplingParams

logger = init_logger(__name__)

SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    """Args:
    engine: the running AsyncLLM.
    tokenizer: the model's tokenizer.
    served_model_names: the names clients may send as `model`; the first is reported back.
    max_model_len: the context length, prompt and output together.
    limits: what one request may ask for.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer: Any,
        served_model_names: list[str],
        max_model_len: int,
        limits: RequestLimits,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self.limits = limits

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """Raises APIError 404 for a model this server does not serve (None: the default)."""
        if model is not None and model not in self.served_model_names:
            raise APIError(
                f"the model `{model}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.served_model_names)}",
                HTTPStatus.NOT_FOUND,
                param="model",
            )

    def check_request(self, request: Any) -> None:
        """Raises APIError (404, 400) for an unknown model, a request over the server's limits
        or a field this server does not support; cheap checks, before any tokenizing."""
        self.check_model(request.model)
        if request.prompt_logprobs is not None:
            raise APIError("prompt_logprobs is not supported", param="prompt_logprobs")
        self.limits.check_n(request.n)
        vocab_size = self.engine.client.info.vocab_size
        self.limits.check_stop(request.stop_list, request.stop_token_ids or [], vocab_size)

    def make_sampling_params(self, request: Any, num_prompt_tokens: int) -> SamplingParams:
        """The request's SamplingParams; by default output may fill the rest of the context.

        Raises:
            APIError: 400 for an invalid value or a prompt plus max_tokens over the context.
        """
        if num_prompt_tokens >= self.max_model_len:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {num_prompt_tokens} tokens; shorten the prompt",
                param="messages" if hasattr(request, "messages") else "prompt",
            )
        try:
            params = request.to_sampling_params(self.max_model_len - num_prompt_tokens)
        except ValueError as e:
            raise APIError.bad_request(e) from e
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > (
            self.max_model_len
        ):
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens, but you "
                f"requested {num_prompt_tokens + params.max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {params.max_tokens} for the output); "
                "lower max_tokens or shorten the prompt",
                param="max_tokens",
            )
        return params

    async def add_request(
        self,
        prefix: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind,
    ) -> tuple[str, AsyncIterator[RequestOutput]]:
        """Adds the request to the engine; returns its id and its outputs.

        Raises:
            APIError: 400 when the engine refuses the input, 503 when the engine is dead.
        """
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            outputs = await self.engine.add_request(
                request_id, prompt, prompt_token_ids, params, output_kind
            )
        except ValueError as e:
            # What is not a sampling value is the prompt's (empty, too long, unknown token ids).
            raise APIError.bad_request(e, "prompt" if prefix == "cmpl" else "messages") from e
        except EngineDeadError as e:
            raise APIError.engine_dead(e.summary) from e
        return request_id, outputs

    async def wait_for_final_output(
        self, request_id: str, outputs: AsyncIterator[RequestOutput], raw_request: Request
    ) -> RequestOutput:
        """The request's final output; aborts it if the client disconnects first.

        Raises:
            APIError: 503 when the engine died; 400 when aborted (nobody is left to read it).
        """
        watcher = asyncio.create_task(_abort_on_disconnect(raw_request, self.engine, request_id))
        try:
            final = None
            async for output in outputs:
                final = output
            assert final is not None and final.finished
            return final
        except EngineDeadError as e:
            raise APIError.engine_dead(e.summary) from e
        except RequestAbortedError as e:
            raise APIError(str(e)) from e
        finally:
            watcher.cancel()

    async def stream_events(
        self, request_id: str, chunks: AsyncIterator[BaseModel]
    ) -> AsyncIterator[str]:
        """Server-sent events of `chunks`, an engine death as an error event, then [DONE].

        The client disconnecting cancels this generator (Starlette does), which closes the
        request's outputs and so aborts it.
        """
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except EngineDeadError as e:
            logger.debug("stream %s ended by the engine's death", request_id)
            yield APIError.engine_dead(e.summary).to_sse()
        except Exception:
            logger.exception("stream %s failed", request_id)
            yield internal_error().to_sse()
        yield SSE_DONE


async def _abort_on_disconnect(raw_request: Request, engine: AsyncLLM, request_id: str) -> None:
    # Once the body is read, the next ASGI message is the disconnect (or, from uvicorn, a
    # disconnect once the response is complete, by which time this task is cancelled).
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
    logger.info("client of %s disconnected; aborting it", request_id)
    engine.abort(request_id)


class StreamTally:
    """What a stream has sent so far, for its final usage chunk."""

    def __init__(self) -> None:
        self.last: RequestOutput | None = None
        self.num_completion_tokens = 0

    def usage(self) -> UsageInfo | None:
        return None if self.last is None else make_usage(self.last, self.num_completion_tokens)


async def stream_steps(
    outputs: AsyncIterator[RequestOutput], tally: StreamTally
) -> AsyncIterator[list[CompletionOutput]]:
    """Per engine step, the choices worth a chunk (new text, new tokens or a finish); both
    endpoints stream through this, so they send and count alike."""
    async for output in outputs:
        tally.last = output
        sendable = []
        for completion in output.outputs:
            tally.num_completion_tokens += len(completion.token_ids)
            if completion.text or completion.finished() or completion.token_ids:
                sendable.append(completion)
        if sendable:
            yield sendable


def make_usage(output: RequestOutput, num_completion_tokens: int) -> UsageInfo:
    num_prompt_tokens = len(output.prompt_token_ids)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


def sampled_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]]
) -> list[tuple[Logprob, list[Logprob]]]:
    """Per generated token: its own Logprob and every candidate of its row, best rank first."""
    rows = []
    for token_id, row in zip(token_ids, logprobs):
        ranked = sorted(row.values(), key=lambda lp: lp.rank if lp.rank is not None else 0)
        rows.append((row[token_id], ranked))
    return rows
