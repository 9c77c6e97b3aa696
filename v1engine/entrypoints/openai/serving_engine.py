"""OpenAIServing: what the completion, chat and embedding endpoints share.

That is the model-name, runner and limit checks, the length check against the context, adding a
request's engine requests (one per prompt: sampled, a beam search or embedded; named by the
client's request id when it sends one) to the AsyncLLM with their errors mapped to HTTP statuses,
waiting for their final outputs while watching for the client to disconnect, and server-sent
events.

Tokenizing a prompt and rendering a chat take time in proportion to the body (seconds for
megabytes), so they run in a thread (`asyncio.to_thread`): the event loop keeps answering /health
and streaming other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from v1engine.engine.async_llm import AsyncLLM
from v1engine.engine.core_process import EngineDeadError, RequestAbortedError
from v1engine.engine.output_processor import OutputKind
from v1engine.engine.processor import check_priority, truncate_prompt
from v1engine.entrypoints.openai.beam_search import beam_search_params
from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.limits import RequestLimits
from v1engine.entrypoints.openai.serving_models import ServedModels
from v1engine.entrypoints.openai.serving_options import ServingOptions
from v1engine.entrypoints.openai.structured import (
    CONSTRAINT_FIELDS,
    Constraint,
    in_request_terms,
    request_constraint,
)
from v1engine.logger import init_logger
from v1engine.lora.request import LoRARequest
from v1engine.outputs import RequestOutput, final_output
from v1engine.pooling_params import PoolingParams
from v1engine.sampling_params import BeamSearchParams, SamplingParams
from v1engine.structured_outputs.params import StructuredOutputsParams

logger = init_logger(__name__)

# What a server serves, by how its model runs (--runner).
_APIS_BY_RUNNER = {
    "generate": "/v1/completions and /v1/chat/completions",
    "pooling": "/v1/embeddings, /classify, /score and /rerank",
}


@dataclass
class EngineInput:
    """One prompt of a request, ready for the engine."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams | PoolingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


# One engine request of an HTTP request: its id and its outputs.
EngineRun = tuple[str, AsyncIterator[RequestOutput]]


class OpenAIServing:
    """Args:
    engine: the running AsyncLLM.
    tokenizer: the model's tokenizer.
    served_model_names: the names clients may send as `model`; the first is reported back.
    max_model_len: the context length, prompt and output together.
    limits: what one request may ask for.
    options: the chat template and constraint options.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer: Any,
        served_model_names: list[str],
        max_model_len: int,
        limits: RequestLimits,
        options: ServingOptions | None = None,
    ) -> None:
        self.options = options or ServingOptions()
        self.engine = engine
        self.tokenizer = tokenizer
        self.models = ServedModels(served_model_names, self.options.lora_modules)
        self.max_model_len = max_model_len
        self.limits = limits

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's generation_config.json values, for fields a request leaves out."""
        return self.engine.config.model_config.sampling_defaults

    @property
    def model_name(self) -> str:
        return self.models.names[0]

    def check_model_and_runner(self, request: Any, runner_type: str) -> None:
        """Raises APIError: 404 for an unknown model, 400 unless the model runs as `runner_type`
        (one way, as in vLLM). Logs the request's fields the server ignores, in one line."""
        if request.ignored_fields:
            names = ", ".join(repr(name) for name in request.ignored_fields)
            logger.warning(
                "The following fields were present in the request but ignored: {%s}", names
            )
        self.models.check(request.model)
        runner = self.engine.config.model_config.runner_type
        if runner != runner_type:
            serves = _APIS_BY_RUNNER[runner]
            raise APIError(
                f"this server runs its model with --runner {runner}, for {serves}; restart it "
                f"with --runner {runner_type} for this API"
            )

    def check_priority(self, priority: Any) -> None:
        """Raises APIError 400 for a priority this server's scheduling policy cannot honour."""
        try:
            check_priority(priority, self.engine.config.scheduler_config.policy)
        except ValueError as e:
            raise APIError(str(e), param="priority") from None

    def check_request(self, request: Any) -> None:
        """Raises APIError (404, 400) for an unknown model, a request over the server's limits
        or a field this server does not support, or a pooling engine (it cannot generate);
        cheap checks, before any tokenizing. Logs the fields the server ignores."""
        self.check_model_and_runner(request, "generate")
        if self.options.return_tokens_as_token_ids:  # the server's flag, for every request
            request.return_tokens_as_token_ids = True
        if request.best_of not in (None, 1):
            raise APIError(
                f"best_of is not supported, got {request.best_of}; use n", param="best_of"
            )
        self.check_priority(request.priority)
        if request.length_penalty != 1.0 and not request.use_beam_search:
            raise APIError(
                f"length_penalty scores beam search only, got {request.length_penalty} without "
                "use_beam_search; send use_beam_search: true or drop length_penalty",
                param="length_penalty",
            )
        options = request.stream_options
        if options is not None and not request.stream:
            raise APIError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        if options is not None and options.continuous_usage_stats and not options.include_usage:
            raise APIError(
                "stream_options.continuous_usage_stats adds usage to every chunk only with "
                "include_usage; send include_usage: true as well",
                param="stream_options",
            )
        if request.prompt_logprobs is not None and request.stream:
            # As vLLM: prompt logprobs come whole, with the response, never streamed.
            raise APIError(
                "`prompt_logprobs` are not available when `stream=True`; drop one of them",
                param="prompt_logprobs",
            )
        vocab_size = self.engine.client.info.vocab_size
        self.limits.check_num_logprobs(request.prompt_logprobs, "prompt_logprobs", vocab_size)
        self.limits.check_n(request.n)
        self.limits.check_stop(request.stop_list, request.stop_token_ids or [], vocab_size)

    async def make_constraint(
        self, request: Any, tools: Constraint | None = None
    ) -> StructuredOutputsParams | None:
        """The request's output constraint (or the tools' one), compiled once here (in a thread:
        a large schema takes a while) so that a bad one is a 400 naming the request's field; the
        engine's own compile is then a cache hit.

        Raises:
            APIError: 400 for more than one constraint or an invalid one.
        """
        if tools is None and all(getattr(request, name) is None for name in CONSTRAINT_FIELDS):
            return None
        constraint = request_constraint(request, self.options, tools)
        if constraint is None:
            return None
        param, params = constraint
        try:
            await asyncio.to_thread(self.engine.processor.check_grammar, params)
        except ValueError as e:
            raise APIError(in_request_terms(e, param), param=param) from e
        return params

    def make_input(
        self,
        request: Any,
        prompt: str | None,
        prompt_token_ids: list[int],
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> EngineInput:
        """One prompt of the request, ready for the engine: with its sampling params, or with
        `use_beam_search` its search params and the prompt cut to truncate_prompt_tokens (the
        engine's processor cuts a sampled request's).

        Raises:
            APIError: 400 for an invalid value, a prompt plus max_tokens over the context, or a
                field a beam search does not take.
        """
        params = self.make_sampling_params(request, len(prompt_token_ids), structured_outputs)
        lora = self.models.check(request.model)
        if not request.use_beam_search:
            salt = request.cache_salt
            return EngineInput(prompt, prompt_token_ids, params, request.priority, salt, lora)
        search = beam_search_params(request, params, self.limits.max_logprobs)
        truncate_to = params.truncate_prompt_tokens
        prompt_token_ids = truncate_prompt(prompt_token_ids, truncate_to, self.max_model_len)
        return EngineInput(prompt, prompt_token_ids, search, lora_request=lora)

    def make_sampling_params(
        self,
        request: Any,
        num_prompt_tokens: int,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams (with its output constraint); by default output may
        fill the rest of the context.

        Raises:
            APIError: 400 for an invalid value or a prompt plus max_tokens over the context.
        """
        truncate_to = request.truncate_prompt_tokens
        if truncate_to is not None and truncate_to >= 1:
            # The engine's processor keeps the prompt's last `truncate_to` tokens.
            num_prompt_tokens = min(num_prompt_tokens, truncate_to)
        if num_prompt_tokens >= self.max_model_len:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {num_prompt_tokens} tokens; shorten the prompt or set "
                "truncate_prompt_tokens",
                param="messages" if hasattr(request, "messages") else "prompt",
            )
        try:
            defaults = self.sampling_defaults
            if request.use_beam_search:  # a sampler's defaults, not a search's (but its cap)
                defaults = {k: v for k, v in defaults.items() if k == "max_tokens"}
            params = request.to_sampling_params(self.max_model_len - num_prompt_tokens, defaults)
            if structured_outputs is not None:
                params = dataclasses.replace(params, structured_outputs=structured_outputs)
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

    async def add_requests(
        self,
        prefix: str,
        client_id: str | None,
        inputs: list[EngineInput],
        output_kind: OutputKind,
        param: str,
    ) -> tuple[str, list[EngineRun]]:
        """Adds one engine request per input, concurrently; returns the request's id,
        f"{prefix}-{client_id or a new one}", and each engine request's id and outputs (a
        batch's are named f"{id}-{i}"; a client's id gets a unique suffix first, for two
        requests may send one id).

        Raises:
            APIError: 400 when the engine refuses an input (naming the sampling field at fault,
                else `param`), 503 when the engine is dead; then nothing of the request stays.
        """
        request_id = f"{prefix}-{client_id or uuid.uuid4().hex}"
        base_id = request_id if client_id is None else f"{request_id}-{uuid.uuid4().hex[:8]}"
        batched = len(inputs) > 1
        ids = [f"{base_id}-{i}" for i in range(len(inputs))] if batched else [base_id]
        adds = [self._add(engine_id, x, output_kind) for engine_id, x in zip(ids, inputs)]
        try:
            results = await asyncio.gather(*adds, return_exceptions=True)
        except BaseException:
            self.abort_all(ids)  # cancelled: the requests added meanwhile
            raise
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                self.abort_all(ids)
                raise _add_error(result, index if batched else None, param) from result
        return request_id, list(zip(ids, results))

    def _add(
        self, engine_id: str, x: EngineInput, output_kind: OutputKind
    ) -> Awaitable[AsyncIterator[RequestOutput]]:
        """The engine call that adds one input: sampled, a beam search, or embedded."""
        if self.options.log_requests:
            self.options.log_request(engine_id, x.prompt, x.prompt_token_ids, x.params)
        if isinstance(x.params, BeamSearchParams):
            return self.engine.beam_search(
                engine_id, x.prompt, x.prompt_token_ids, x.params, output_kind, x.lora_request
            )
        if isinstance(x.params, PoolingParams):
            return self.engine.encode(engine_id, x.prompt_token_ids, x.params, x.priority)
        rest = (output_kind, x.priority, x.cache_salt, x.lora_request)
        return self.engine.add_request(engine_id, x.prompt, x.prompt_token_ids, x.params, *rest)

    def abort_all(self, request_ids: list[str]) -> None:
        """Aborts the engine requests still running (a no-op for finished or unknown ids)."""
        for request_id in request_ids:
            self.engine.abort(request_id)

    async def wait_for_final_outputs(
        self, runs: list[EngineRun], raw_request: Request | None
    ) -> list[RequestOutput]:
        """Each engine request's final output; aborts them all when the client disconnects
        (`raw_request` None: none waits), one of them fails, or this is cancelled.

        Raises:
            APIError: 503 when the engine died; 400 when aborted (nobody is left to read it).
        """
        ids = [request_id for request_id, _ in runs]
        watcher = asyncio.create_task(_abort_on_disconnect(raw_request, self, ids))
        tasks = [asyncio.ensure_future(final_output(outputs)) for _, outputs in runs]
        try:
            return list(await asyncio.gather(*tasks))
        except EngineDeadError as e:
            raise APIError.unavailable(e) from e
        except RequestAbortedError as e:
            raise APIError(str(e)) from e
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()
            self.abort_all(ids)


def client_request_id(request: Any, raw_request: Request) -> str | None:
    """The client's id for its request, as vLLM takes it: the X-Request-Id header, else the
    body's `request_id`; None when it sent neither.

    Raises:
        APIError: 400 for an id that is empty, over 256 characters or not printable (ids go
            into logs and the response).
    """
    header = raw_request.headers.get("x-request-id")
    param, value = (
        ("request_id", request.request_id) if header is None else ("X-Request-Id", header)
    )
    if value is not None and not (0 < len(value) <= 256 and value.isprintable()):
        raise APIError(
            f"{param} must be 1 to 256 printable characters, got {value[:80]!r}", param=param
        )
    return value


def _add_error(error: BaseException, index: int | None, param: str) -> BaseException:
    """The API's error for an engine request the engine refused."""
    if isinstance(error, EngineDeadError):
        return APIError.unavailable(error)
    if not isinstance(error, ValueError):
        return error
    if index is not None:
        error = ValueError(f"prompt {index} of the batch: {error}")
    # What is not a sampling value is the prompt's (empty, too long, unknown token ids).
    return APIError.bad_request(error, param)


async def _abort_on_disconnect(
    raw_request: Request | None, serving: OpenAIServing, request_ids: list[str]
) -> None:
    if raw_request is None:
        return  # no client waits for the reply (a background response)
    # Once the body is read, the next ASGI message is the disconnect (or, from uvicorn, a
    # disconnect once the response is complete, by which time this task is cancelled).
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
    logger.info("client of %s disconnected; aborting it", ", ".join(request_ids))
    serving.abort_all(request_ids)


def require_one_form(request: Any, field: str, what: str, action: str) -> None:
    """Raises APIError 400 naming `field` unless the request sends exactly one of `field`
    (`what` it holds) and `messages` (vLLM's chat form of /tokenize and /v1/embeddings)."""
    value = getattr(request, field)
    if (value is None) == (request.messages is None):
        raise APIError(
            f"send one of `{field}` ({what}) and `messages` (a chat) to {action}; got "
            f"{'both' if value is not None else 'neither'}",
            param=field,
        )
