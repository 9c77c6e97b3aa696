"""POST /v1/embeddings: one input or a batch (text or token ids) -> one embedding each, in order;
or a chat (vLLM's `messages` form, rendered through the chat template) -> one embedding.

Served only by an engine started with `--runner pooling` (vLLM's rule: one model, one runner);
each input is one engine request (`AsyncLLM.encode`), added together. An embedding is the last
input token's final hidden state, L2-normalized unless `normalize: false` (see
v1engine/pooling_params.py); `encoding_format: "base64"` sends its float32 bytes instead of a
JSON list, as OpenAI does (its Python client asks for base64 by default and decodes it).

`OpenAIServingEmbedding.pool` is every pooling endpoint's pipeline (/classify and /score
subclass this class).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from v1engine.engine.pooling_state import PooledOutput
from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol import UsageInfo
from v1engine.entrypoints.openai.protocol_pooling import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
)
from v1engine.entrypoints.openai.serving_chat import render_messages
from v1engine.entrypoints.openai.serving_engine import (
    EngineInput,
    OpenAIServing,
    client_request_id,
    require_one_form,
)
from v1engine.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from v1engine.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(
        self, request: EmbeddingRequest, raw_request: Request
    ) -> JSONResponse:
        """Raises APIError (400, 404, 503) before anything is computed."""
        request_id, embedded = await self.pool(request, raw_request, "embd", "embed")
        response = _response(request_id, self.model_name, embedded, request.encoding_format)
        return JSONResponse(response.model_dump())

    async def pool(
        self,
        request: Any,
        raw_request: Request,
        prefix: str,
        task: str,
        tokenize: Callable[[], list[list[int]]] | None = None,
        param: str = "input",
    ) -> tuple[str, list[PooledOutput]]:
        """What every pooling endpoint does: checks the request (model, runner, the model's
        `task`, priority, id, pooling params), tokenizes it in a thread (`tokenize`: one
        token-id list per input; default: its `input` or `messages`), adds one engine request
        per input named f"{prefix}-..." (a refused one is a 400 naming `param`) and returns the
        request's id and each input's result, in order.

        Raises:
            APIError: 400, 404, 503 as `add_requests`; 500 for an input the engine ended
                without a result.
        """
        self.check_model_and_runner(request, "pooling")
        try:
            self.engine.processor.check_pooling_task(task)
        except ValueError as e:
            raise APIError(str(e), param="model") from e
        self.check_priority(request.priority)
        client_id = client_request_id(request, raw_request)
        params = _pooling_params(request)
        token_ids = await asyncio.to_thread(tokenize or (lambda: self._tokenize(request, task)))
        inputs = [EngineInput(None, ids, params, request.priority) for ids in token_ids]
        request_id, runs = await self.add_requests(prefix, client_id, inputs, "final", param)
        finals = await self.wait_for_final_outputs(runs, raw_request)
        return request_id, [_pooled_of(final, index) for index, final in enumerate(finals)]

    def _tokenize(self, request: PoolingRequest, task: str) -> list[list[int]]:
        """Each input's token ids (the chat form's one)."""
        require_one_form(request, "input", "texts or token ids", task)
        if request.messages is not None:
            return [render_messages(self.engine.processor, request, self.options.chat_template)[1]]
        for name in _CHAT_FORM_FIELDS:  # they shape a template that `input` does not go through
            if getattr(request, name) != PoolingRequest.model_fields[name].default:
                raise APIError(f"{name} applies to `messages` only, not to `input`", param=name)
        add_special_tokens = request.add_special_tokens is not False
        return [
            self.tokenizer.encode(x, add_special_tokens=add_special_tokens)
            if isinstance(x, str)
            else x
            for x in _split_inputs(request.input)
        ]


_CHAT_FORM_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "tools",
)


def _pooling_params(request: Any) -> PoolingParams:
    """The request's PoolingParams (its `dimensions`, `normalize`, `truncate_prompt_tokens`,
    `use_activation`, those it has). Raises APIError 400 naming the field at fault."""
    try:
        return PoolingParams(
            getattr(request, "dimensions", None),
            getattr(request, "normalize", None),
            request.truncate_prompt_tokens,
            getattr(request, "use_activation", None),
        )
    except ValueError as e:
        raise APIError.bad_request(e) from e


def _pooled_of(final: PooledOutput | RequestOutput, index: int) -> PooledOutput:
    """Input `index`'s result. Raises APIError 500 where the engine ended it without one (it
    refused it, and logged why)."""
    if isinstance(final, PoolingRequestOutput):
        return final
    raise APIError(
        f"input {index} ended ({final.outputs[0].finish_reason}) without a result",
        HTTPStatus.INTERNAL_SERVER_ERROR,
        type="server_error",
    )


def _split_inputs(inputs: str | list) -> list[str | list[int]]:
    """The request's inputs: one text, one token-id list, or a batch of either."""
    if isinstance(inputs, str) or all(isinstance(t, int) for t in inputs):
        return [inputs]  # an empty list: the engine says it is empty
    return list(inputs)


def _response(
    request_id: str,
    model_name: str,
    embedded: list[EmbeddingRequestOutput],
    encoding: str,
) -> EmbeddingResponse:
    data = [
        EmbeddingData(index=index, embedding=encode_vector(output.outputs.embedding, encoding))
        for index, output in enumerate(embedded)
    ]
    usage = prompt_usage(embedded)
    return EmbeddingResponse(id=request_id, model=model_name, data=data, usage=usage)


def encode_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """A result as the request's `encoding_format` says: a JSON list, or ("base64") its
    little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
    return values


def prompt_usage(outputs: list[PooledOutput]) -> UsageInfo:
    """A pooling response's usage: every input's prompt tokens."""
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
