"""The OpenAI-compatible API server: the FastAPI app, its routes, and `serve` (startup.py's
`run_server` starts the engine and calls it).

Processes: this one (uvicorn, tokenizer, detokenizer, one AsyncLLM output loop) -> the
engine core process -> one worker per device. Lifetime:
- start-up: bind the socket, start the engine (Ctrl-C or SIGTERM here stops it cleanly), log
  one line, serve;
- SIGINT/SIGTERM while serving: uvicorn stops accepting, lets running responses finish for up
  to `_GRACEFUL_SHUTDOWN_S`, then the engine ends the rest with a 503 "the server is shutting
  down" (a stream's error event) and aborts them in the core; then the engine stops and the
  process exits 0;
- the engine dying: `/health` turns 503, every request in flight ends with a 503 error (an
  error event in a stream), the server shuts down the same way and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware

from v1engine import __version__
from v1engine.config import EngineConfig
from v1engine.engine.async_llm import AsyncLLM
from v1engine.engine.core_process import summarize_dead_reason
from v1engine.engine.metrics import ServerMetrics
from v1engine.engine.stat_logger import LoggingStatLogger
from v1engine.entrypoints.openai.api_control import include_control_routes
from v1engine.entrypoints.openai.errors import APIError, install_error_handlers
from v1engine.entrypoints.openai.http_options import (
    APIKeyMiddleware,
    HTTPOptions,
    RequestIdHeaderMiddleware,
)
from v1engine.entrypoints.openai.limits import BodyLimitMiddleware, RequestLimits
from v1engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelList,
)
from v1engine.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingEndpointRequest,
)
from v1engine.entrypoints.openai.protocol_responses import ResponsesRequest
from v1engine.entrypoints.openai.protocol_score import RerankRequest, ScoreRequest
from v1engine.entrypoints.openai.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from v1engine.entrypoints.openai.serving_chat import OpenAIServingChat
from v1engine.entrypoints.openai.serving_classification import OpenAIServingClassification
from v1engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from v1engine.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from v1engine.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from v1engine.entrypoints.openai.serving_options import ServingOptions
from v1engine.entrypoints.openai.serving_pooling import OpenAIServingPooling
from v1engine.entrypoints.openai.serving_responses import OpenAIServingResponses
from v1engine.entrypoints.openai.serving_score import OpenAIServingScore
from v1engine.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from v1engine.entrypoints.openai.startup import describe_kv_capacity, log_startup_line
from v1engine.entrypoints.openai.tls import uvicorn_tls_kwargs
from v1engine.logger import init_logger

logger = init_logger(__name__)

# Once the server stops accepting (SIGINT/SIGTERM, or the engine died), running responses get
# this long to finish; then the engine ends the rest (a 503, or a stream's error event), and
# uvicorn waits _END_RESPONSES_S more for those last writes before it cancels what is left.
_GRACEFUL_SHUTDOWN_S = 5.0
_END_RESPONSES_S = 2.0


@dataclass
class ServerState:
    engine: AsyncLLM
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses
    embedding: OpenAIServingEmbedding
    score: OpenAIServingScore
    classification: OpenAIServingClassification
    pooling: OpenAIServingPooling
    tokenization: OpenAIServingTokenization
    metrics: ServerMetrics
    model_path: str
    limits: RequestLimits


# -- routes -------------------------------------------------------------------------------------
router = APIRouter()


def _state(raw_request: Request) -> ServerState:
    return raw_request.app.state.server


@router.get("/health")
@router.get("/ping")  # SageMaker's name for it, as vLLM serves it (GET and POST)
@router.post("/ping")
async def health(raw_request: Request) -> Response:
    engine = _state(raw_request).engine
    if engine.dead_reason is not None:
        return APIError.engine_dead(summarize_dead_reason(engine.dead_reason)).to_response()
    return Response(status_code=HTTPStatus.OK)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    return Response(_state(raw_request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def show_models(raw_request: Request) -> JSONResponse:
    state = _state(raw_request)
    cards = state.completion.models.cards(state.model_path, state.completion.max_model_len)
    return JSONResponse(ModelList(data=cards).model_dump())


# `path`: a served name may hold slashes ("org/model").
@router.get("/v1/models/{model_id:path}")
async def show_model(model_id: str, raw_request: Request) -> JSONResponse:
    state = _state(raw_request)
    models = state.completion.models
    models.check(model_id)
    cards = models.cards(state.model_path, state.completion.max_model_len)
    return JSONResponse(next(card for card in cards if card.id == model_id).model_dump())


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    state = _state(raw_request)
    check = partial(state.completion.models.load, request, state.engine.processor.loras)
    return Response(await asyncio.to_thread(check))  # reads the adapter's files


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    return Response(_state(raw_request).completion.models.unload(request))


# vLLM's tokenizer endpoints sit outside /v1, so the API key does not guard them (as in vLLM).
@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    return await _state(raw_request).tokenization.create_tokenize(request)


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    return await _state(raw_request).tokenization.create_detokenize(request)


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return await _state(raw_request).completion.create_completion(request, raw_request)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await _state(raw_request).chat.create_chat_completion(request, raw_request)


@router.post("/v1/responses")
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    return await _state(raw_request).responses.create_response(request, raw_request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    return _state(raw_request).responses.retrieve(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, raw_request: Request) -> Response:
    return await _state(raw_request).responses.cancel(response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw_request: Request) -> Response:
    return _state(raw_request).responses.delete(response_id)


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    return await _state(raw_request).embedding.create_embedding(request, raw_request)


@router.post("/pooling")
async def create_pooling(request: PoolingEndpointRequest, raw_request: Request) -> Response:
    return await _state(raw_request).pooling.create_pooling(request, raw_request)


# vLLM serves both with and without /v1 (and /v2/rerank, Cohere's path); only /v1 is guarded by
# the API key.
@router.post("/score")
@router.post("/v1/score")
async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    return await _state(raw_request).score.create_score(request, raw_request)


@router.post("/classify")
@router.post("/v1/classify")
async def create_classification(request: ClassificationRequest, raw_request: Request) -> Response:
    return await _state(raw_request).classification.create_classification(request, raw_request)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
    return await _state(raw_request).score.create_rerank(request, raw_request)


def build_app(state: ServerState, http: HTTPOptions | None = None) -> FastAPI:
    http = http or HTTPOptions()
    no_docs = {"openapi_url": None, "docs_url": None, "redoc_url": None}
    docs = no_docs if http.disable_docs else {}
    app = FastAPI(title="v1engine", version=__version__, **docs)
    app.state.server = state
    app.include_router(router)
    include_control_routes(app, state.engine.config)
    # The last added runs first: errors wrap everything, and the key is checked before the body
    # is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.limits.max_request_body_bytes)
    if http.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=http.api_key)
    install_error_handlers(app)
    # Outermost, as they cannot fail: a browser's preflight is answered before the key check,
    # and every response (a 401 or 500 too) carries the CORS and X-Request-Id headers.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=http.allowed_origins,
        allow_methods=http.allowed_methods,
        allow_headers=http.allowed_headers,
        allow_credentials=http.allow_credentials,
    )
    if http.request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    return app


def build_state(
    engine: AsyncLLM,
    tokenizer: Any,
    names: list[str],
    model_path: str,
    limits: RequestLimits | None = None,
    options: ServingOptions | None = None,
) -> ServerState:
    max_model_len = engine.config.scheduler_config.max_model_len
    limits = limits or RequestLimits()
    options = options or ServingOptions()
    serving_args = (engine, tokenizer, names, max_model_len, limits, options)
    chat = OpenAIServingChat(*serving_args)
    return ServerState(
        engine=engine,
        completion=OpenAIServingCompletion(*serving_args),
        chat=chat,
        responses=OpenAIServingResponses(chat, options.max_stored_responses),
        embedding=OpenAIServingEmbedding(*serving_args),
        score=OpenAIServingScore(*serving_args),
        classification=OpenAIServingClassification(*serving_args),
        pooling=OpenAIServingPooling(*serving_args),
        tokenization=OpenAIServingTokenization(*serving_args),
        metrics=engine.metrics,
        model_path=model_path,
        limits=limits,
    )


# -- running --------------------------------------------------------------------------------------
async def serve(
    args: argparse.Namespace, state: ServerState, sock: Any, stats_interval_s: float | None
) -> int:
    """Serves on `sock` until a signal (returns 0) or the engine's death (returns 1); the engine
    core is ready (startup.run_server got it there). Logs the stats line every
    `stats_interval_s` (None: never)."""
    engine = state.engine
    config: EngineConfig = engine.config
    server = _Server(_uvicorn_config(args, state), engine)
    engine.start(on_dead=lambda: setattr(server, "should_exit", True))
    stats = None
    if stats_interval_s is not None:
        stats = asyncio.create_task(LoggingStatLogger(state.metrics).run(stats_interval_s))
    try:
        kv = describe_kv_capacity(engine.client.info)
        names = state.completion.models.names
        scheme = "https" if args.ssl_keyfile else "http"
        # Listen before saying so: uvicorn only listens once it has set up (TLS takes a
        # while), and a client acting on the line meanwhile would be refused. Connections now
        # wait in the backlog until uvicorn accepts them.
        sock.listen(server.config.backlog)
        log_startup_line(scheme, sock.getsockname(), state.model_path, names, config, kv)
        # uvicorn handles SIGINT/SIGTERM while serving, then restores these handlers and
        # re-raises the signal it caught: that must not kill the process before clean-up.
        signal.signal(signal.SIGINT, _note_signal)
        signal.signal(signal.SIGTERM, _note_signal)
        await server.serve(sockets=[sock])
        engine_died = engine.is_dead
    finally:
        if stats is not None:
            stats.cancel()
            await asyncio.gather(stats, return_exceptions=True)
        await state.responses.background.stop()  # aborts their requests while the engine runs
        await engine.stop()
        engine.client.shutdown()
    if engine_died:
        reason = summarize_dead_reason(engine.dead_reason or "")
        logger.error("exiting with status 1: the engine died (%s)", reason)
        return 1
    logger.info("server stopped")
    return 0


def _uvicorn_config(args: argparse.Namespace, state: ServerState) -> uvicorn.Config:
    return uvicorn.Config(
        build_app(state, HTTPOptions.from_cli_args(args)),
        log_level=args.uvicorn_log_level,
        access_log=args.uvicorn_log_level in ("debug", "trace"),
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S + _END_RESPONSES_S,
        lifespan="off",
        root_path=args.root_path,  # a proxy's path prefix: links in the API docs carry it
        **uvicorn_tls_kwargs(args),
    )


class _Server(uvicorn.Server):
    """uvicorn's server, except that the requests still running when the grace period ends
    are ended by the engine, so each gets a whole response saying the server is shutting
    down, instead of uvicorn cancelling its task (a cut connection, a traceback in the log)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list | None = None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(_GRACEFUL_SHUTDOWN_S, self.engine.end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def _note_signal(signum: int, frame: Any) -> None:
    logger.info("received %s; shutting down", signal.Signals(signum).name)
