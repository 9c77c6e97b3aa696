"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, so that the
official clients raise their typed exceptions (BadRequestError, AuthenticationError, ...).

Handlers raise `APIError`; `install_error_handlers` turns it, FastAPI's validation errors
(malformed JSON, wrong types) and unknown routes into that shape with the matching status.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from v1engine.logger import init_logger

logger = init_logger(__name__)

# SamplingParams errors read "SamplingParams.<field> ...": the field is the request's param.
_PARAM_PATTERN = re.compile(r"SamplingParams\.(\w+)")


class APIError(Exception):
    """An error response: HTTP `status`, OpenAI error `type`, and the offending `param`."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, error: ValueError) -> APIError:
        """A 400 for bad input; names the param when a SamplingParams check failed."""
        match = _PARAM_PATTERN.search(str(error))
        return cls(str(error), param=match.group(1) if match else None)

    @classmethod
    def engine_dead(cls, reason: str) -> APIError:
        return cls(
            f"the engine is dead and the server is shutting down: {reason}",
            HTTPStatus.SERVICE_UNAVAILABLE,
            type="server_error",
            code="engine_dead",
        )

    def to_dict(self) -> dict:
        code = self.code if self.code is not None else int(self.status)
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": code}
        }

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=int(self.status))

    def to_sse(self) -> str:
        """The error as one server-sent event: how a stream that already began reports it."""
        return f"data: {json.dumps(self.to_dict())}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error.to_response()


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    problems = []
    param = None
    for item in error.errors():
        if item.get("type") == "json_invalid":
            reason = item.get("ctx", {}).get("error", item.get("msg"))
            return APIError(f"malformed JSON in the request body: {reason}").to_response()
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        param = param or location or None
        problems.append(f"{location or 'body'}: {item.get('msg', 'invalid')}")
    message = "invalid request: " + "; ".join(problems)
    return APIError(message, param=param).to_response()


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    status = HTTPStatus(error.status_code)
    kind = "invalid_request_error" if status < 500 else "server_error"
    message = error.detail if isinstance(error.detail, str) else status.phrase
    return APIError(message, status, type=kind).to_response()


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s %s", request.method, request.url.path)
    message = f"internal server error: {type(error).__name__}: {error}"
    return APIError(message, HTTPStatus.INTERNAL_SERVER_ERROR, type="server_error").to_response()
