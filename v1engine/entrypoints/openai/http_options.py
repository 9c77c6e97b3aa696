"""How the server answers over HTTP, whatever the route: the API key check, X-Request-Id
headers, CORS and the API docs (`HTTPOptions`, flags of `python -m v1engine.serve`), applied by
`api_server.build_app`."""

from __future__ import annotations

import argparse
import hmac
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from v1engine.entrypoints.openai.errors import APIError, HTTPMiddleware


class APIKeyMiddleware(HTTPMiddleware):
    """401 for a /v1 request without `Authorization: Bearer <api_key>`, before the body is
    parsed."""

    def __init__(self, app: Any, api_key: str) -> None:
        super().__init__(app)
        self.expected = f"Bearer {api_key}".encode()

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing API key" if not given else "incorrect API key provided"
                error = APIError(
                    f"{message}; send it as the header 'Authorization: Bearer <key>'",
                    HTTPStatus.UNAUTHORIZED,
                )
                await error.to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware(HTTPMiddleware):
    """vLLM's --enable-request-id-headers: every response carries an X-Request-Id header, the
    request's own or else a new one."""

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-request-id", request_id)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclass
class HTTPOptions:
    """How the server answers over HTTP (flags of `python -m v1engine.serve`)."""

    api_key: str | None = None
    request_id_headers: bool = False
    # CORS, as vLLM's defaults: any origin, method and header, no credentials.
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # vLLM's: no API docs (/docs, /redoc, /openapi.json).
    disable_docs: bool = False

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> HTTPOptions:
        return cls(
            args.api_key,
            args.enable_request_id_headers,
            args.allowed_origins,
            args.allowed_methods,
            args.allowed_headers,
            args.allow_credentials,
            args.disable_fastapi_docs,
        )
