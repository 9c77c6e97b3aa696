"""OutputHandler: the client's side of the core -> client messages, shared by both MP clients.

It routes each message: step outputs to the client's queue, utility results to the call waiting
for them, ENGINE_DEAD (or the core process's exit, reported by the client) to every waiting and
later call. It also keeps the ids of the requests in flight, for the duplicate-id check that
`add_request` makes before sending. Used from the sync client's output thread and from the
asyncio client's event-loop callbacks; `lock` guards the shared state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from v1engine.core.protocol import (
    EngineCoreOutputType,
    RequestError,
    UtilityResult,
    make_error,
)
from v1engine.logger import init_logger
from v1engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason

if TYPE_CHECKING:
    from v1engine.core.background_resources import BackgroundResources

logger = init_logger(__name__)

# Queued after the last output once the engine is dead; readers put it back for the next one.
DEAD = object()


class EngineDeadError(RuntimeError):
    """The engine core process or one of its workers died (or the client was shut down).
    Every pending and later call raises it; start a new engine.
    """


class OutputHandler:
    """Args:
    put_output: queues one EngineCoreOutputs (or DEAD) for `get_output`.
    """

    def __init__(self, put_output: Callable[[Any], None]) -> None:
        self.lock = threading.Lock()
        self.live_request_ids: set[str] = set()
        self.pending_calls: dict[int, Any] = {}
        self.dead_reason: str | None = None
        self._put_output = put_output
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._result_decoder = msgspec.msgpack.Decoder(UtilityResult)
        self._request_error_decoder = msgspec.msgpack.Decoder(RequestError)
        self._reason_decoder = msgspec.msgpack.Decoder(str)

    def drain(self, socket: zmq.Socket) -> None:
        """Handles every message waiting on `socket`, without blocking."""
        while True:
            try:
                tag, payload = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.handle(tag, payload)
            except Exception:  # one bad message must not stop the reader: callers would hang
                logger.exception("could not handle an engine core message (type tag %r)", tag)

    def handle(self, tag: bytes, payload: bytes) -> None:
        if tag == EngineCoreOutputType.OUTPUTS.value:
            self._handle_outputs(self._outputs_decoder.decode(payload))
        elif tag == EngineCoreOutputType.UTILITY_RESULT.value:
            result = self._result_decoder.decode(payload)
            with self.lock:
                future = self.pending_calls.pop(result.call_id, None)
            if future is not None and not future.done():
                if result.error_type is None:
                    future.set_result(result.result)
                else:
                    future.set_exception(make_error(result))
        elif tag == EngineCoreOutputType.REQUEST_ERROR.value:
            self._handle_request_error(self._request_error_decoder.decode(payload))
        elif tag == EngineCoreOutputType.ENGINE_DEAD.value:
            self.set_dead(f"the engine core died: {self._reason_decoder.decode(payload)}")
        else:
            logger.error("ignoring an engine core message with unknown type tag %r", tag)

    def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        finished = [output.request_id for output in outputs.outputs if output.finished]
        if finished:
            with self.lock:
                self.live_request_ids.difference_update(finished)
        self._put_output(outputs)

    def _handle_request_error(self, error: RequestError) -> None:
        # The client's checks let through a request the core refused: finish it, so whoever
        # waits for it is not left waiting.
        logger.error("the engine core refused request %r: %s", error.request_id, error.message)
        with self.lock:
            self.live_request_ids.discard(error.request_id)
        aborted = EngineCoreOutput(error.request_id, [], finish_reason=FinishReason.ABORT)
        self._put_output(EngineCoreOutputs(outputs=[aborted]))

    def register_call(self, call_id: int, loop: asyncio.AbstractEventLoop | None) -> Any:
        """A future for the result of utility call `call_id`: an asyncio one on `loop`, else a
        concurrent.futures one. Raises EngineDeadError when the engine is already dead.
        """
        future = concurrent.futures.Future() if loop is None else loop.create_future()
        with self.lock:
            self.raise_if_dead()
            self.pending_calls[call_id] = future
        return future

    def raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def set_dead(self, reason: str) -> None:
        """Fails every waiting call and output reader with EngineDeadError; the first reason
        given is kept (ENGINE_DEAD's, when the core could send it before exiting).
        """
        with self.lock:
            if self.dead_reason is not None:
                return
            self.dead_reason = reason
            pending, self.pending_calls = self.pending_calls, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._put_output(DEAD)


def read_outputs_until_exit(handler: OutputHandler, resources: BackgroundResources) -> None:
    """The sync client's output thread: reads until the core exits or the client closes."""
    assert resources.proc is not None
    socket, sentinel = resources.output_socket, resources.proc.sentinel
    poller = zmq.Poller()
    for watched in (socket, sentinel, resources.wake_r):
        poller.register(watched, zmq.POLLIN)
    while True:
        events = dict(poller.poll())
        if resources.wake_r in events:
            return
        handler.drain(socket)  # an ENGINE_DEAD sent just before the exit has the reason
        if sentinel in events:
            handler.set_dead(resources.core_exit_reason)
            return


def read_outputs_in_loop(
    loop: asyncio.AbstractEventLoop, handler: OutputHandler, resources: BackgroundResources
) -> None:
    """The asyncio client's reader: callbacks on the output socket's descriptor and the core's
    sentinel, removed when the resources close.
    """
    assert resources.proc is not None
    socket, sentinel = resources.output_socket, resources.proc.sentinel
    # ZeroMQ's descriptor only signals "something changed": drain() reads until EAGAIN.
    fd = socket.FD

    def on_core_exit() -> None:
        loop.remove_reader(sentinel)
        handler.drain(socket)
        handler.set_dead(resources.core_exit_reason)

    def detach() -> None:
        if not loop.is_closed():
            loop.remove_reader(fd)
            loop.remove_reader(sentinel)

    loop.add_reader(fd, handler.drain, socket)
    loop.add_reader(sentinel, on_core_exit)
    resources.on_close.append(detach)
    handler.drain(socket)  # what arrived before anyone watched
