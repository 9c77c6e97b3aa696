"""The routes that control the engine rather than ask it for text, as vLLM serves them:

- with `--profiler-config`: POST /start_profile and /stop_profile (the workers' torch.profiler);
- in dev mode only (`V1ENGINE_SERVER_DEV_MODE=1`, vLLM's `VLLM_SERVER_DEV_MODE`), since they let
  any client change or stop the engine: POST /reset_prefix_cache, POST /sleep?level=1,
  POST /wake_up (?tags=weights&tags=kv_cache), GET /is_sleeping and POST /collective_rpc (JSON
  {"method", "args", "kwargs", "timeout"} -> {"results": one per rank}).
Otherwise they are 404s.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from v1engine.config import EngineConfig
from v1engine.engine.async_llm import AsyncLLM
from v1engine.engine.core_process import EngineDeadError
from v1engine.entrypoints.openai.errors import APIError
from v1engine.logger import init_logger

logger = init_logger(__name__)

DEV_MODE_ENV = "V1ENGINE_SERVER_DEV_MODE"

profile_router = APIRouter()
dev_router = APIRouter()


def include_control_routes(app: FastAPI, config: EngineConfig) -> None:
    if config.profiler_config.profiler is not None:
        app.include_router(profile_router)
    if os.environ.get(DEV_MODE_ENV) == "1":
        logger.warning(
            "%s=1: serving /reset_prefix_cache, /sleep, /wake_up, /is_sleeping and "
            "/collective_rpc, which let any client change the engine; never expose this server",
            DEV_MODE_ENV,
        )
        app.include_router(dev_router)


async def _control(raw_request: Request, call: Callable[[AsyncLLM], Awaitable[Any]]) -> Any:
    """`call(engine)`'s result, with its errors as the API's: 503 for a dead engine, 400 for a
    call that cannot run (bad arguments, a profile already running, sleeping with requests in
    flight, a rank that failed: a WorkerError's one line)."""
    try:
        return await call(raw_request.app.state.server.engine)
    except EngineDeadError as e:
        raise APIError.unavailable(e) from e
    except (ValueError, TypeError, RuntimeError) as e:
        raise APIError(getattr(e, "summary", str(e))) from e


def _ok() -> Response:
    return Response(status_code=HTTPStatus.OK)


@profile_router.post("/start_profile")
async def start_profile(raw_request: Request) -> Response:
    await _control(raw_request, lambda engine: engine.start_profile())
    return _ok()


@profile_router.post("/stop_profile")
async def stop_profile(raw_request: Request) -> Response:
    await _control(raw_request, lambda engine: engine.stop_profile())
    return _ok()


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw_request: Request) -> Response:
    if not await _control(raw_request, lambda engine: engine.reset_prefix_cache()):
        raise APIError("requests are running; the prefix cache is reset only when none does")
    return _ok()


@dev_router.post("/sleep")
async def sleep(raw_request: Request, level: int = 1) -> Response:
    await _control(raw_request, lambda engine: engine.sleep(level))
    return _ok()


@dev_router.post("/wake_up")
async def wake_up(
    raw_request: Request, tags: Annotated[list[str] | None, Query()] = None
) -> Response:
    await _control(raw_request, lambda engine: engine.wake_up(tags))
    return _ok()


@dev_router.get("/is_sleeping")
async def is_sleeping(raw_request: Request) -> JSONResponse:
    sleeping = await _control(raw_request, lambda engine: engine.is_sleeping())
    return JSONResponse({"is_sleeping": sleeping})


class CollectiveRpcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: str  # a public method of the worker class (or of its worker_extension_cls)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


@dev_router.post("/collective_rpc")
async def collective_rpc(request: CollectiveRpcRequest, raw_request: Request) -> JSONResponse:
    results = await _control(
        raw_request,
        lambda engine: engine.collective_rpc(
            request.method, tuple(request.args), request.kwargs, request.timeout
        ),
    )
    return JSONResponse({"results": results})
