"""What one HTTP request may ask of the server, and the middleware that caps the body's size.

Each limit protects the server from one request: `n` children each hold KV cache and a batch
slot, every logprob is sent from the engine each step, every stop string is matched against the
output text on the event loop each step, and the body is parsed on the event loop. A request over
a limit gets a 400 (413 for the body) naming the limit and the flag that raises it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from http import HTTPStatus
from typing import Any

from v1engine.entrypoints.openai.errors import APIError, HTTPMiddleware


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = field(
        default=128, metadata={"help": "most completions one request may ask for (n)"}
    )
    # The engine's max_logprobs (EngineArgs' --max-logprobs, which the engine holds every
    # request to): checked here too, for a 400 that names the request's field. -1: no limit.
    max_logprobs: int = field(default=20, metadata={"engine_arg": True})
    max_stop_sequences: int = field(
        default=16, metadata={"help": "most stop strings, and most stop_token_ids, per request"}
    )
    max_stop_sequence_chars: int = field(
        default=256, metadata={"help": "longest stop string, in characters"}
    )
    max_request_body_bytes: int = field(
        default=8 << 20, metadata={"help": "largest request body (413 above it)"}
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            lowest = -1 if f.name == "max_logprobs" else 1
            if value < lowest:
                raise ValueError(f"--{_flag(f.name)} must be >= {lowest}, got {value}")

    @staticmethod
    def add_cli_args(group: Any) -> None:
        for f in fields(RequestLimits):
            if f.metadata.get("engine_arg"):
                continue  # EngineArgs adds its flag
            help_text = f"{f.metadata['help']} (default {f.default})"
            group.add_argument("--" + _flag(f.name), type=int, default=f.default, help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def check_n(self, n: int) -> None:
        _check_at_most("n", n, "completions", self.max_n, "max_n")

    def check_num_logprobs(
        self, num_logprobs: int | None, param: str, vocab_size: int | None = None
    ) -> None:
        """The engine's rule, named for the request's field: -1 (vLLM's: every token's) counts
        as `vocab_size` (unknown: more than any limit but -1)."""
        if num_logprobs is None:
            return
        if num_logprobs == -1:
            if self.max_logprobs != -1 and (vocab_size is None or vocab_size > self.max_logprobs):
                raise APIError(
                    f"{param}: -1 (every token's logprob) needs a server started with "
                    "--max-logprobs -1" + ("" if vocab_size is None else f" (or >= {vocab_size})"),
                    param=param,
                )
            return
        if num_logprobs < 0:
            raise APIError(f"{param} must be >= 0, or -1, got {num_logprobs}", param=param)
        if self.max_logprobs != -1:
            limit = self.max_logprobs
            _check_at_most(param, num_logprobs, "logprobs per token", limit, "max_logprobs")

    def check_stop(
        self, stop: list[str], stop_token_ids: list[int], vocab_size: int | None
    ) -> None:
        """Raises APIError when the stop list is too long, a stop string too long, or a stop
        token id outside the vocabulary (it could never match)."""
        limit = self.max_stop_sequences
        _check_at_most("stop", len(stop), "stop strings", limit, "max_stop_sequences")
        _check_at_most("stop_token_ids", len(stop_token_ids), "ids", limit, "max_stop_sequences")
        longest = len(max(stop, key=len, default=""))
        chars_limit = self.max_stop_sequence_chars
        _check_at_most(
            "stop", longest, "characters in one string", chars_limit, "max_stop_sequence_chars"
        )
        if vocab_size is not None:
            bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise APIError(
                    f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                    param="stop_token_ids",
                )


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_at_most(param: str, value: int, unit: str, limit: int, name: str) -> None:
    if value > limit:
        raise APIError(
            f"{param}: {value} {unit} is over this server's limit of {limit}; ask for less, or "
            f"restart the server with a higher --{_flag(name)}",
            param=param,
        )


class BodyLimitMiddleware(HTTPMiddleware):
    """A 413 for a request body over `max_bytes`, before anything parses it.

    The body is read here whole (a declared Content-Length over the limit is refused before
    reading; a chunked body is counted as it arrives) and replayed to the app, which then reads
    the client's later messages (its disconnect) as usual.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(f"{declared} bytes").to_response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        num_bytes = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending the whole body
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:
                error = self._too_large(f"more than {self.max_bytes} bytes")
                await error.to_response()(scope, receive, send)
                return
            chunks.append(chunk)
            more_body = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self, size: str) -> APIError:
        return APIError(
            f"the request body has {size}, over this server's limit of {self.max_bytes} bytes; "
            "send a smaller request or restart the server with a higher "
            "--max-request-body-bytes",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )


def _content_length(scope: dict) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replayed_receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed_receive
