"""Errors in one JSON shape, `{"error": {"message", "type", "param", "code"}}` with `code` the
HTTP status as an int (vLLM's shape), on every endpoint and mid-stream alike, so that the official
clients raise their typed exceptions (BadRequestError, AuthenticationError, ...).

Handlers raise `APIError`; `install_error_handlers` turns it, FastAPI's validation errors
(malformed JSON, wrong types), bodies that cannot be parsed and unknown routes into that shape with
the matching status. What a client reads is short and says what to change: an unexpected error
becomes a 500 without its details, and its traceback goes to the server log, once.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from v1engine.engine.core_process import (
    EngineDeadError,
    EngineSleepingError,
    ServerShutdownError,
)
from v1engine.logger import init_logger

logger = init_logger(__name__)

# SamplingParams (PoolingParams) errors read "SamplingParams.<field> ...": the field is the
# request's param.
_PARAM_PATTERN = re.compile(r"(?:Sampling|Pooling)Params\.(\w+)")


class APIError(Exception):
    """An error response: HTTP `status` (also its `code`), OpenAI error `type`, and the
    offending `param`."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        type: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param

    @classmethod
    def bad_request(cls, error: ValueError, param: str | None = None) -> APIError:
        """A 400 for bad input; its param is the field of SamplingParams (or PoolingParams) that
        failed, else `param`."""
        match = _PARAM_PATTERN.search(str(error))
        return cls(str(error), param=match.group(1) if match else param)

    @classmethod
    def unavailable(cls, error: EngineDeadError) -> APIError:
        """A 503 for a request the engine can no longer serve: the server is shutting down,
        or the engine died (see `engine_dead`)."""
        if isinstance(error, EngineSleepingError):
            return cls(str(error), HTTPStatus.SERVICE_UNAVAILABLE, type="server_error")
        if isinstance(error, ServerShutdownError):
            return cls(
                "the server is shutting down before this request finished; send it again",
                HTTPStatus.SERVICE_UNAVAILABLE,
                type="server_error",
            )
        return cls.engine_dead(error.summary)

    @classmethod
    def engine_dead(cls, summary: str) -> APIError:
        """A 503 saying why in one line (`EngineDeadError.summary`); the log has the details."""
        return cls(
            f"the engine is dead: {summary}; the server is shutting down (its log has the details)",
            HTTPStatus.SERVICE_UNAVAILABLE,
            type="server_error",
        )

    def to_dict(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": {**error, "code": int(self.status)}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=int(self.status))

    def to_sse(self) -> str:
        """The error as one server-sent event: how a stream that already began reports it."""
        return f"data: {json.dumps(self.to_dict())}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    """The JSON error shape for every error; add it after the middleware that can fail, so that
    it wraps them (only the X-Request-Id header, which cannot, goes around it)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_middleware(UnexpectedErrorMiddleware)


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error.to_response()


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    problems = []
    param = None
    for item in error.errors():
        if item.get("type") == "json_invalid":
            reason = item.get("ctx", {}).get("error", item.get("msg"))
            return APIError(f"malformed JSON in the request body: {reason}").to_response()
        if tuple(item.get("loc", ())) == ("body",):
            return APIError(_not_an_object(item)).to_response()
        location = [str(part) for part in item.get("loc", ()) if part != "body"]
        # The request's own field (not a union member's tag or a list index below it).
        param = param or (location[0] if location else None)
        problems.append(f"{'.'.join(location) or 'body'}: {item.get('msg', 'invalid')}")
    message = "invalid request: " + "; ".join(problems)
    return APIError(message, param=param).to_response()


def _not_an_object(item: dict) -> str:
    if item.get("type") == "missing":
        return "the request body is empty; send the request as a JSON object"
    # A body sent without a JSON Content-Type arrives as bytes.
    value = item.get("input")
    got = (
        "a body that is not JSON" if isinstance(value, bytes) else f"a JSON {type(value).__name__}"
    )
    return (
        "the request body must be a JSON object sent with Content-Type: application/json; "
        f"got {got}"
    )


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    status = HTTPStatus(error.status_code)
    kind = "invalid_request_error" if status < 500 else "server_error"
    message = error.detail if isinstance(error.detail, str) else status.phrase
    route = f"{request.method} {request.url.path}"
    if status == HTTPStatus.NOT_FOUND and message == status.phrase:
        message = f"there is no route {route}"
    elif status == HTTPStatus.METHOD_NOT_ALLOWED:
        message = f"{route} is not allowed; use {(error.headers or {}).get('Allow', 'another')}"
    # FastAPI answers a body json.loads could not take, beyond a syntax error, with a generic
    # "error parsing the body"; its cause says what was wrong.
    cause = error.__cause__
    if isinstance(cause, UnicodeDecodeError):
        message = (
            f"the request body is not valid UTF-8 ({cause.reason} at byte {cause.start}); "
            "send JSON encoded as UTF-8"
        )
    elif isinstance(cause, RecursionError):
        message = "the request body's JSON is nested too deeply to parse; flatten it"
    return APIError(message, status, type=kind).to_response()


class HTTPMiddleware:
    """Plain ASGI middleware (it never wraps a streaming response, as Starlette's
    BaseHTTPMiddleware would): `handle` sees each HTTP request; anything else passes by."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        raise NotImplementedError


class UnexpectedErrorMiddleware(HTTPMiddleware):
    """A short 500 for an exception no handler took, its traceback logged once with the route.

    Starlette's own last resort would log it, answer, then re-raise it for uvicorn to log again;
    this sits inside it, so the exception ends here. A streaming response that already began is
    ended (its generator reports its own errors, see serving_outputs.stream_events).
    """

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        started = False

        async def send_and_note(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            logger.exception("unexpected error serving %s %s", scope["method"], scope["path"])
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await internal_error().to_response()(scope, receive, send)


def internal_error() -> APIError:
    return APIError(
        "internal server error; the server log has the details",
        HTTPStatus.INTERNAL_SERVER_ERROR,
        type="server_error",
    )
