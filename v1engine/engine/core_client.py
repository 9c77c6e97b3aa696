"""EngineCoreClient: how a front end drives an EngineCore, in this process or in its own.

    client = EngineCoreClient.make_client(config, multiprocess=True, asyncio_mode=True)
    await client.add_request(request)      # ValueError at once for bad input; nothing is sent
    outputs = await client.get_output()    # EngineCoreOutputs of one step
    await client.collective_rpc("get_pid")
    client.shutdown()                      # idempotent; also runs at interpreter exit

`InprocClient` (the `LLM` class's) wraps an EngineCore directly: `get_output()` runs one step.
`AsyncMPClient` (the API server's) runs it in an `EngineCoreProc` (core_process.py) and speaks
core_protocol.py; its methods are coroutines (`shutdown()` stays synchronous) and it reads outputs
in event-loop callbacks. `MPClient` is what any client of a core process needs (the tests add a
blocking one on it). When the core process or a worker dies, every pending and later call raises
EngineDeadError, with the reason, within about a second.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import signal
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import zmq

from v1engine.config import EngineConfig
from v1engine.core_protocol import (
    ENGINE_CORE_UTILITIES,
    EngineCoreInfo,
    EngineCoreRequestType,
    UtilityCall,
    encode,
)
from v1engine.engine.core_process import (
    DEAD,
    CoreProcess,
    EngineDeadError,
    OutputHandler,
    read_outputs_in_loop,
)
from v1engine.executor.errors import WorkerDiedError
from v1engine.executor.rpc_call import RpcCall
from v1engine.request import EngineCoreOutputs, EngineCoreRequest, validate_request
from v1engine.tokenizer import BackgroundTokenizerLoad

__all__ = ["AsyncMPClient", "EngineCoreClient", "EngineDeadError", "InprocClient", "MPClient"]

SEND_RETRY_S = 1.0  # a send that finds no reader waits this long for the core to reconnect
SEND_RETRY_SLICE_S = 0.01


class EngineCoreClient(ABC):
    """The front end's handle on an EngineCore. Sync clients offer `add_request(request)`,
    `abort_requests(ids)`, `get_output(timeout) -> EngineCoreOutputs`, `collective_rpc(...)`,
    `reset_prefix_cache() -> bool`, `call_utility(method, **kwargs)` (the EngineCore methods
    of `ENGINE_CORE_UTILITIES`: profile, sleep, ...) and `shutdown()`; AsyncMPClient the same
    as coroutines.

    Raises (every call):
        EngineDeadError: the engine core or one of its workers died, or the client was shut down.
    """

    # The engine's limits and KV cache size (see core_protocol.EngineCoreInfo).
    info: EngineCoreInfo

    @staticmethod
    def make_client(
        config: EngineConfig, multiprocess: bool, asyncio_mode: bool
    ) -> InprocClient | AsyncMPClient:
        """InprocClient (in-process, blocking) or AsyncMPClient (its own process, asyncio)."""
        if asyncio_mode != multiprocess:
            raise ValueError(
                "choose multiprocess=True with asyncio_mode=True (the API server's client), or "
                "both False (the LLM class's); an in-process core would block the event loop for "
                "every step, and a blocking client of a core process is a test helper"
            )
        return AsyncMPClient(config) if multiprocess else InprocClient(config)

    @staticmethod
    def start_with_tokenizer(
        config: EngineConfig,
        multiprocess: bool,
        skip_tokenizer: bool = False,
        preload: str | None = None,
    ) -> tuple[InprocClient | AsyncMPClient, Any]:
        """`make_client` (asyncio with `multiprocess`) while the tokenizer loads on a thread
        (`BackgroundTokenizerLoad`: `skip_tokenizer`, `preload`); returns both, or stops the
        engine and raises when the tokenizer fails. Start-up runs on this thread, so Ctrl-C
        stops it at once."""
        with BackgroundTokenizerLoad(config.model_config, skip_tokenizer, preload) as loading:
            client = EngineCoreClient.make_client(config, multiprocess, asyncio_mode=multiprocess)
            try:
                return client, loading.result()
            except BaseException:
                client.shutdown()
                raise

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the engine core and its workers; idempotent."""

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class InprocClient(EngineCoreClient):
    """The EngineCore in this process (workers are still processes with the mp executor)."""

    def __init__(self, config: EngineConfig) -> None:
        # Imported here: a front end with its core in another process never loads the core's
        # modules (torch among them).
        from v1engine.core.engine_core import EngineCore

        self.engine_core = EngineCore(config)
        self.info = self.engine_core.info
        self._dead_reason: str | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._guard():
            self.engine_core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        with self._guard():
            self.engine_core.abort_requests(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """Runs one step; `timeout` is ignored (the step runs in this thread). Ctrl-C during
        the step raises KeyboardInterrupt when the step ends (`_keyboard_interrupt_deferred`)."""
        with self._guard(), _keyboard_interrupt_deferred():
            return self.engine_core.step()

    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        with self._guard():
            return self.engine_core.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)

    def reset_prefix_cache(self) -> bool:
        with self._guard():
            return self.engine_core.reset_prefix_cache()

    def call_utility(self, method: str, **kwargs: Any) -> Any:
        """The EngineCore method `method` (one of ENGINE_CORE_UTILITIES), called with `kwargs`."""
        _check_utility(method)
        with self._guard():
            return getattr(self.engine_core, method)(**kwargs)

    def shutdown(self) -> None:
        if self._dead_reason is None:
            self._dead_reason = "the engine core client was shut down"
        self.engine_core.shutdown()

    @contextmanager
    def _guard(self) -> Iterator[None]:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        try:
            yield
        except WorkerDiedError as e:
            self._dead_reason = str(e)
            raise EngineDeadError(str(e)) from e


def _check_utility(method: str) -> None:
    if method not in ENGINE_CORE_UTILITIES:
        raise ValueError(f"unknown engine core utility {method!r}; one of {ENGINE_CORE_UTILITIES}")


@contextmanager
def _keyboard_interrupt_deferred() -> Iterator[None]:
    """Holds Ctrl-C (SIGINT) until the block ends, then raises KeyboardInterrupt: a step cut
    halfway would drop the tokens it had in flight, and their requests would never finish. A
    second Ctrl-C raises at once (a way out of a step that hangs). Signals reach only the main
    thread, and a handler the user installed is theirs: in both cases this does nothing."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


class MPClient(EngineCoreClient):
    """What the sync and asyncio clients share: the core process, request checks, call ids.

    Args:
        config: the engine configuration, passed to the spawned core process.
        put_output: how the output handler queues outputs (and the DEAD marker).

    Raises:
        ValueError / RuntimeError: the engine core failed to start (with its traceback); nothing
            is left running.
    """

    def __init__(self, config: EngineConfig, put_output: Callable[[Any], None]) -> None:
        self.resources = CoreProcess()
        self._finalizer = weakref.finalize(self, self.resources.close)
        try:
            self.info = self.resources.start(config)
            self.core_pid: int = self.resources.child.pid
        except BaseException:
            self._finalizer()
            raise
        # At exit, multiprocessing joins non-daemon children (the core) in a hook it registered
        # when first imported; hooks run last-in first-out, so this one stops the core first.
        atexit.register(self._finalizer)
        self.handler = OutputHandler(put_output)
        self._call_ids = itertools.count()

    def shutdown(self) -> None:
        self.handler.set_dead("the engine core client was shut down")
        self._close()

    def _close(self) -> None:
        self._finalizer()
        atexit.unregister(self._finalizer)

    # -- encoding ------------------------------------------------------------------------------
    def _add_frames(self, request: EngineCoreRequest) -> list[bytes]:
        handler = self.handler
        with handler.lock:
            handler.raise_if_dead()
            validate_request(request, self.info, handler.live_request_ids)
            handler.live_request_ids.add(request.request_id)
        try:
            return encode(EngineCoreRequestType.ADD, request)
        except TypeError as e:
            with handler.lock:
                handler.live_request_ids.discard(request.request_id)
            raise ValueError(f"request {request.request_id!r} cannot be encoded: {e}") from e

    def _abort_frames(self, request_ids: Iterable[str]) -> list[bytes]:
        request_ids = list(request_ids)
        if not all(isinstance(r, str) for r in request_ids):
            raise ValueError(f"request ids must be str, got {request_ids!r}")
        with self.handler.lock:
            self.handler.raise_if_dead()
            self.handler.live_request_ids.difference_update(request_ids)
        return encode(EngineCoreRequestType.ABORT, request_ids)

    def _utility_frames(self, utility: str, **kwargs: Any) -> tuple[int, list[bytes]]:
        call_id = next(self._call_ids)
        try:
            return call_id, encode(
                EngineCoreRequestType.UTILITY, UtilityCall(call_id, utility, kwargs)
            )
        except TypeError as e:
            raise TypeError(
                f"{utility} arguments must be msgpack-able (None, bool, int, float, str, bytes, "
                f"lists, dicts, msgspec Structs, dataclasses) to reach the engine core: {e}"
            ) from e

    def _rpc_frames(self, call: RpcCall) -> tuple[int, list[bytes]]:
        return self._utility_frames("collective_rpc", **call.to_wire())

    def _try_send(self, frames: list[bytes]) -> bool:
        """Sends without blocking; False when the core is not connected to read it."""
        with self.resources.send_lock:
            if self.resources.closed:
                raise EngineDeadError(self.handler.dead_reason or "the client was shut down")
            try:
                self.resources.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            return True

    def _unreachable(self) -> EngineDeadError:
        reason = self.handler.dead_reason
        return EngineDeadError(reason or f"the engine core (pid {self.core_pid}) stopped reading")


class AsyncMPClient(MPClient):
    """The engine core in a background process, for asyncio front ends (the HTTP server).

    Bound to the event loop it is created in, or else to the one of its first `await`ed call;
    call `shutdown()` from that loop's thread.
    """

    def __init__(self, config: EngineConfig) -> None:
        self._outputs: asyncio.Queue = asyncio.Queue()
        super().__init__(config, self._outputs.put_nowait)
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self._attach(asyncio.get_running_loop())
        except RuntimeError:
            pass  # no loop yet: the first awaited call attaches

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Raises ValueError (sending nothing) when the request cannot be served."""
        self._attached()
        await self._send(self._add_frames(request))

    async def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._attached()
        await self._send(self._abort_frames(request_ids))

    async def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        self._attached()
        try:
            item = await asyncio.wait_for(self._outputs.get(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no engine core output within {timeout} s") from None
        if item is DEAD:
            self._outputs.put_nowait(DEAD)
            raise EngineDeadError(self.handler.dead_reason)
        return item

    async def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        call = RpcCall(method, args, kwargs, timeout, unique_reply_rank)
        return await self._call(*self._rpc_frames(call))

    async def reset_prefix_cache(self) -> bool:
        return await self._call(*self._utility_frames("reset_prefix_cache"))

    async def call_utility(self, method: str, **kwargs: Any) -> Any:
        """The core's EngineCore method `method` (one of ENGINE_CORE_UTILITIES), with `kwargs`."""
        _check_utility(method)
        return await self._call(*self._utility_frames(method, **kwargs))

    def shutdown(self) -> None:
        reason = "the engine core client was shut down"
        if self._loop is not None and self._loop.is_closed():
            # Nothing can be waiting on a closed loop, and it cannot deliver wake-ups.
            self.handler.dead_reason = self.handler.dead_reason or reason
        else:
            self.handler.set_dead(reason)
        self._close()

    async def _call(self, call_id: int, frames: list[bytes]) -> Any:
        self._attached()
        future = self.handler.register_call(call_id, self._loop)
        await self._send(frames)
        return await future

    async def _send(self, frames: list[bytes]) -> None:
        deadline = time.monotonic() + SEND_RETRY_S
        while not self._try_send(frames):
            if self.handler.dead_reason is not None or time.monotonic() > deadline:
                raise self._unreachable()
            await asyncio.sleep(SEND_RETRY_SLICE_S)

    def _attached(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._attach(loop)
        elif loop is not self._loop:
            raise RuntimeError("AsyncMPClient is bound to the event loop it was first used in")

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        read_outputs_in_loop(loop, self.handler, self.resources)
