"""The wire protocol between an `EngineCoreClient` and its `EngineCoreProc`.

Every message is a ZeroMQ multipart message `[type tag, msgpack payload]`, encoded with msgspec:
never pickle, so a process that can write to the socket cannot make the other run code.

Client -> core, on the input socket (client PUSH binds, core PULL connects):
    ADD       EngineCoreRequest; the client validated it already (`validate_request`)
    ABORT     list[str]: request ids; no output follows but what was already sent
    UTILITY   UtilityCall(call_id, method, kwargs): "collective_rpc" (kwargs: `RpcCall.to_wire()`,
              see executor/rpc_call.py), or one of `ENGINE_CORE_UTILITIES`, the EngineCore
              method of that name called with the kwargs
    SHUTDOWN  empty: stop the workers and exit 0

Core -> client, on the output socket (client PULL binds, core PUSH connects):
    OUTPUTS         EngineCoreOutputs of one step that produced tokens
    UTILITY_RESULT  UtilityResult(call_id, result or error)
    REQUEST_ERROR   RequestError(request_id, message): the core refused an ADD the client let
                    through; the client finishes that request with finish_reason "abort"
    ENGINE_DEAD     str: why the core stopped (a worker died, the loop crashed); it then exits 1

Start-up goes over process.py's one-way pipe: READY carries an `EngineCoreInfo` once the engine is
built, FAILED the exception and its traceback. `EngineCoreInfo` is everything a front end
needs from the engine (the KV cache's size for its start-up line, the limits requests are checked
against), so no front end ever calls into the workers.

Bad input is reported synchronously by the client: with READY's limits it runs
`request.validate_request` itself, raises ValueError and sends nothing, without a round trip per
request. The core validates again (it cannot trust the socket); REQUEST_ERROR is the safety net.

Both processes import this module, so it is a leaf: the core package never imports the client's.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from v1engine.executor.errors import RemoteFailure, WorkerError

# The EngineCore methods a client may call by name (their results are msgpack-able).
ENGINE_CORE_UTILITIES = ("reset_prefix_cache", "profile", "sleep", "wake_up", "is_sleeping")


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a client -> core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreOutputType(bytes, enum.Enum):
    """First frame of a core -> client message."""

    OUTPUTS = b"\x10"
    UTILITY_RESULT = b"\x11"
    REQUEST_ERROR = b"\x12"
    ENGINE_DEAD = b"\x13"


class EngineCoreInfo(msgspec.Struct, array_like=True):
    """What a front end learns from the engine once it is built (READY, or `EngineCore.info`)."""

    num_blocks: int  # KV cache blocks per worker (0: the workers have no attention layers)
    block_size: int  # tokens per block
    max_model_len: int
    vocab_size: int | None  # None: a model-free worker class (requests' ids go unchecked)
    max_loras: int = 0  # LoRA adapters one step may run; 0: LoRA requests are refused
    max_logprobs: int = 20  # logprobs per token a request may ask for; -1: no limit


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    kwargs: dict[str, Any] = {}


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    """A utility call's result, or its error: `error_type` names the exception class and
    `failures` carries a WorkerError's per-rank failures so the client can rebuild it.
    """

    call_id: int
    result: Any = None
    error_type: str | None = None
    error_message: str = ""
    failed_method: str = ""
    failures: list[RemoteFailure] | None = None


class RequestError(msgspec.Struct, array_like=True):
    request_id: str
    message: str


# Exceptions a utility call may raise that the client re-raises as the same type; anything else
# arrives as a RuntimeError with the original type name in its message.
_ERROR_TYPES: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "TimeoutError": TimeoutError,
}

encoder = msgspec.msgpack.Encoder()


def encode(tag: enum.Enum, payload: Any = None) -> list[bytes]:
    """Frames of one message. Raises TypeError when the payload is not msgpack-able."""
    try:
        return [tag.value, encoder.encode(payload)]
    except (msgspec.EncodeError, OverflowError) as e:
        raise TypeError(str(e)) from e


def error_result(call_id: int, error: Exception) -> UtilityResult:
    if isinstance(error, WorkerError):
        return UtilityResult(
            call_id, error_type="WorkerError", failed_method=error.method, failures=error.failures
        )
    return UtilityResult(call_id, error_type=type(error).__name__, error_message=str(error))


def make_error(result: UtilityResult) -> Exception:
    """The exception a failed utility call raises in the client."""
    if result.failures is not None:
        return WorkerError(result.failed_method, result.failures)
    error_cls = _ERROR_TYPES.get(result.error_type or "")
    if error_cls is not None:
        return error_cls(result.error_message)
    return RuntimeError(f"{result.error_type}: {result.error_message}")
