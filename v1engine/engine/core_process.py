"""The client's handle on the engine-core process: `CoreProcess` starts it and owns what must
not outlive it (the process, the ZeroMQ context, the two sockets bound in a private ipc directory
named after this process, see make_ipc_dir, and the pipe that wakes the output reader);
`OutputHandler` routes what the core sends back (outputs to the client's queue, utility results to
the waiting call, ENGINE_DEAD or the process's exit to every waiting and later call) and keeps the
ids of the requests in flight. The wire format is core_protocol.py's.

`CoreProcess.close()` stops the core (SHUTDOWN, then SIGTERM, then SIGKILL, with process.py's
timeouts), closes the sockets and removes the directory; it is idempotent and holds no reference
to the client, so a finalizer can run it at collection or interpreter exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import shutil
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from v1engine.config import EngineConfig
from v1engine.core_protocol import (
    EngineCoreInfo,
    EngineCoreOutputType,
    EngineCoreRequestType,
    RequestError,
    UtilityResult,
    encode,
    make_error,
)
from v1engine.executor.message_queue import make_ipc_dir
from v1engine.logger import init_logger
from v1engine.process import ENGINE_CORE_STARTUP_TIMEOUT_S, ChildProcess, ChildStartupError
from v1engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason

logger = init_logger(__name__)

# Joins the sync test client's output thread at close (it wakes at once through the pipe).
_READER_JOIN_S = 5.0


def _run_engine_core(*args: Any) -> None:
    """The core process's entry point. The import happens there, not here: the engine core's
    modules (torch, xgrammar) are not the front end's to load."""
    from v1engine.core.core_proc import run_engine_core

    run_engine_core(*args)


class CoreProcess:
    def __init__(self) -> None:
        self.closed = False
        self.ready = False
        self.child: ChildProcess | None = None
        self.reader_thread: threading.Thread | None = None
        # Run first by close(): the asyncio client stops watching the sockets' descriptors here.
        self.on_close: list[Callable[[], None]] = []
        # Guards the input socket: ZeroMQ sockets are not thread-safe.
        self.send_lock = threading.Lock()
        self.ipc_dir = make_ipc_dir()
        self.ctx = zmq.Context(io_threads=1)
        self.input_address = f"ipc://{self.ipc_dir}/input"
        self.output_address = f"ipc://{self.ipc_dir}/output"
        self.input_socket = self.ctx.socket(zmq.PUSH)
        # Unbounded: a send fails only when the core is gone, never because it is busy.
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(self.input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(self.output_address)
        self.wake_r, self.wake_w = os.pipe()

    def start(self, config: EngineConfig) -> EngineCoreInfo:
        """Spawns the engine core and waits for READY.

        Raises:
            ValueError / RuntimeError: the engine could not be built; the message carries the
                core's traceback (and a failing worker's). The core process has exited.
        """
        args = (config, self.input_address, self.output_address, self.ipc_dir)
        # Not a daemon: daemonic processes may not have children, and the workers are its.
        self.child = ChildProcess(
            _run_engine_core, args, name="V1EngineCore", label="the engine core", daemon=False
        )
        try:
            info = self.child.wait_until_ready(ENGINE_CORE_STARTUP_TIMEOUT_S)
        except ChildStartupError as e:
            raise e.for_caller() from None
        self.ready = True
        return info

    @property
    def core_exit_reason(self) -> str:
        assert self.child is not None
        return f"the engine core process (pid {self.child.pid}) died ({self.child.exit_reason()})"

    def close(self) -> None:
        """Stops the core process and removes every resource; idempotent."""
        if self.closed:
            return
        self.closed = True
        for callback in self.on_close:
            callback()
        os.write(self.wake_w, b"\0")
        reader = self.reader_thread
        if reader is not None and reader is not threading.current_thread():
            reader.join(_READER_JOIN_S)
        if self.child is not None:
            # A core still starting (Ctrl-C during start-up) reads no messages: SIGTERM at once.
            # Its workers see it die and exit on their own, removing their shared memory.
            self.child.stop(lambda: self.ready and self._send_shutdown())
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        os.close(self.wake_r)
        os.close(self.wake_w)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _send_shutdown(self) -> bool:
        """Asks the core to stop; False when it cannot hear it (SIGTERM then follows)."""
        if not self.send_lock.acquire(timeout=1.0):
            return False  # a sender is stuck
        try:
            self.input_socket.send_multipart(
                encode(EngineCoreRequestType.SHUTDOWN), flags=zmq.NOBLOCK
            )
            return True
        except zmq.ZMQError:
            return False  # not reading any more
        finally:
            self.send_lock.release()


# Queued after the last output once the engine is dead; readers put it back for the next one.
DEAD = object()


class EngineDeadError(RuntimeError):
    """The engine core process or one of its workers died (or the client was shut down).
    Every pending and later call raises it; start a new engine.
    """

    @property
    def summary(self) -> str:
        """The reason as a client may be told it (see summarize_dead_reason)."""
        return summarize_dead_reason(str(self))


class ServerShutdownError(EngineDeadError):
    """The server stopped serving before the request finished; the engine itself is fine.
    An EngineDeadError, because for the request the outcome is the same: retry elsewhere."""


class EngineSleepingError(EngineDeadError):
    """The engine sleeps (sleep mode) and serves no request until it is woken up. An
    EngineDeadError because for the request the outcome is the same (a 503: retry later), though
    the engine lives."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (its client went away) while someone still read its outputs."""


# Tracebacks: their header, the sentences that chain two, and (indented) frames and source lines.
_TRACEBACK_HEADER = "Traceback (most recent call last):"
_CHAINING = ("During handling of the above exception", "The above exception was the direct cause")
# "v1engine.executor.errors.WorkerError" -> "WorkerError".
_QUALIFIED_NAME = re.compile(r"\b(?:[A-Za-z_]\w*\.)+([A-Z]\w*(?:Error|Exception))\b")
# An absolute path (not a URL's), which says where the server's files are.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)*[\w.+-]+")
_MAX_SUMMARY_CHARS = 400


def summarize_dead_reason(reason: str) -> str:
    """A death's reason as a client may be told it: one line, without tracebacks or paths.

    The engine core logs the whole reason (tracebacks included) when it sends ENGINE_DEAD, so
    the front end logs and sends only this; e.g. "the engine core loop crashed: WorkerError:
    collective_rpc('execute_model') failed on rank 1: rank 1: RuntimeError: boom".
    """
    kept: list[str] = []
    for line in reason.splitlines():
        text = line.strip()
        if not text or line[0].isspace() or text == _TRACEBACK_HEADER:
            continue
        if text.startswith(_CHAINING):
            continue
        text = _QUALIFIED_NAME.sub(r"\1", text.removeprefix("--- "))
        text = _ABSOLUTE_PATH.sub("<path>", text)
        # A traceback ends with its exception's line, which the message above already gave.
        if not any(text in earlier for earlier in kept):
            kept.append(text)
    summary = ""
    for text in kept:
        summary += text if not summary else (" " if summary.endswith(":") else "; ") + text
    if len(summary) > _MAX_SUMMARY_CHARS:
        summary = summary[: _MAX_SUMMARY_CHARS - 3] + "..."
    return summary


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


def read_outputs_in_loop(
    loop: asyncio.AbstractEventLoop, handler: OutputHandler, resources: CoreProcess
) -> None:
    """The asyncio client's reader: callbacks on the output socket's descriptor and the core's
    sentinel, removed when the resources close.
    """
    assert resources.child is not None
    socket, sentinel = resources.output_socket, resources.child.sentinel
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
