"""EngineCoreProc: the engine core in its own process, behind an `EngineCoreClient`.

The client (engine/core_process.py) spawns `run_engine_core`, which builds the `EngineCore` (and
with it the workers) and answers READY, or FAILED with the traceback, on a start-up pipe. Then
the busy loop runs:

    while True:
        read the input socket: without blocking while requests run, else block until a message
        step() once if any request is unfinished or a step is still on the workers; send the
        outputs if the step made tokens

Messages and their encoding are in core_protocol.py. Failures: when a worker dies or the loop
raises, the core sends ENGINE_DEAD with the reason, stops the workers and exits 1. A worker death
while idle is noticed at once too: the loop also polls the workers' process sentinels. Lifetime:
the process is not a daemon (daemons may not have children, and the workers are ours); a thread
watching the client's sentinel stops the workers and exits when the client dies, even by SIGKILL.
"""

from __future__ import annotations

import glob
import importlib
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from v1engine.config import EngineConfig
from v1engine.core.engine_core import EngineCore
from v1engine.core_protocol import (
    ENGINE_CORE_UTILITIES,
    EngineCoreOutputType,
    EngineCoreRequestType,
    RequestError,
    UtilityCall,
    UtilityResult,
    encode,
    error_result,
)
from v1engine.executor.errors import WorkerDiedError, WorkerError
from v1engine.executor.message_queue import IPC_DIR_PREFIX, MessageQueue
from v1engine.executor.rpc_call import RpcCall
from v1engine.logger import init_logger
from v1engine.process import install_sigterm_handler, report_startup, watch_parent
from v1engine.request import EngineCoreRequest

logger = init_logger(__name__)

_HEALTH_CHECK_TIMEOUT_S = 5.0
_OUTPUT_LINGER_MS = 1000  # lets ENGINE_DEAD reach the client before the process exits


class EngineCoreProc:
    """Args:
        config: the engine configuration.
        input_address / output_address: the client's bound ZeroMQ sockets.
        client_ipc_dir: the client's private directory, removed here if the client dies.

    Raises:
        whatever `EngineCore(config)` raises; the sockets are closed first.
    """

    def __init__(
        self, config: EngineConfig, input_address: str, output_address: str, client_ipc_dir: str
    ) -> None:
        self.client_ipc_dir = client_ipc_dir
        self.engine_core: EngineCore | None = None
        self._should_stop = False
        self._parent_died = False
        self._client_watch = watch_parent(self._on_client_death)
        self.ctx = zmq.Context(io_threads=1)
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_address)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow client
        self.output_socket.connect(output_address)
        try:
            self.engine_core = EngineCore(config)
        except BaseException:
            self._close_sockets()
            raise
        # The executor's workers are this process's only multiprocessing children; their
        # sentinels let an idle loop notice a death without waiting for the next step.
        self._worker_sentinels = {p.sentinel for p in multiprocessing.active_children()}
        self.poller = zmq.Poller()
        self.poller.register(self.input_socket, zmq.POLLIN)
        for sentinel in self._worker_sentinels:
            self.poller.register(sentinel, zmq.POLLIN)
        self._request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._abort_decoder = msgspec.msgpack.Decoder(list[str])
        self._utility_decoder = msgspec.msgpack.Decoder(UtilityCall)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Runs the busy loop until SHUTDOWN (returns 0) or a fatal error (ENGINE_DEAD, 1)."""
        exit_code = 0
        try:
            self.run_busy_loop()
        except SystemExit:
            pass  # SIGTERM: the client is stopping us
        except BaseException as e:
            exit_code = 1
            if not self._parent_died:
                self._report_engine_dead(e)
        finally:
            if self._parent_died and self._client_watch is not None:
                # The watch thread is stopping the engine and ends the process; exiting here
                # first would cut its clean-up short.
                self._client_watch.join()
            self.shutdown()
        return exit_code

    def run_busy_loop(self) -> None:
        assert self.engine_core is not None
        core = self.engine_core
        while True:
            self._process_input(block=not core.has_work())
            if self._should_stop:
                return
            if core.has_work():
                outputs = core.step()
                if outputs.outputs:
                    self._send(EngineCoreOutputType.OUTPUTS, outputs)

    def _process_input(self, block: bool) -> None:
        events = dict(self.poller.poll(None if block else 0))
        if self._worker_sentinels.intersection(events):
            self._raise_worker_death()
        if self.input_socket not in events:
            return
        while not self._should_stop:
            try:
                tag, payload = self.input_socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle_message(tag.bytes, payload.buffer)

    def _handle_message(self, tag: bytes, payload: memoryview) -> None:
        assert self.engine_core is not None
        try:
            if tag == EngineCoreRequestType.ADD.value:
                self._add_request(payload)
            elif tag == EngineCoreRequestType.ABORT.value:
                self.engine_core.abort_requests(self._abort_decoder.decode(payload))
            elif tag == EngineCoreRequestType.UTILITY.value:
                self._handle_utility(self._utility_decoder.decode(payload))
            elif tag == EngineCoreRequestType.SHUTDOWN.value:
                self._should_stop = True
            else:
                logger.error("ignoring a message with unknown type tag %r", tag)
        except msgspec.DecodeError as e:
            # Malformed input is the sender's error, not the engine's: it must not kill it.
            logger.error("ignoring a malformed message (type tag %r): %s", tag, e)

    def _add_request(self, payload: memoryview) -> None:
        assert self.engine_core is not None
        try:
            request = self._request_decoder.decode(payload)
            self.engine_core.add_request(request)
        except (msgspec.DecodeError, ValueError) as e:
            # The client checks requests first, so this means the two disagree: answer anyway,
            # or the request would never finish.
            request_id = _request_id_of(payload)
            logger.error("refused request %r: %s", request_id, e)
            self._send(EngineCoreOutputType.REQUEST_ERROR, RequestError(request_id, str(e)))

    def _raise_worker_death(self) -> None:
        # A call that must fail: the executor's error names the dead rank and its exit code.
        assert self.engine_core is not None
        self.engine_core.collective_rpc("check_health", timeout=_HEALTH_CHECK_TIMEOUT_S)
        raise RuntimeError("a worker process exited while the engine was idle")

    # -- utility calls -------------------------------------------------------------------------
    def _handle_utility(self, call: UtilityCall) -> None:
        try:
            result = self._call_utility(call)
        except WorkerDiedError:
            raise  # fatal: the loop reports ENGINE_DEAD, which fails the call in the client
        except Exception as e:
            self._send(EngineCoreOutputType.UTILITY_RESULT, error_result(call.call_id, e))
            return
        try:
            frames = encode(
                EngineCoreOutputType.UTILITY_RESULT, UtilityResult(call.call_id, result)
            )
        except TypeError as e:
            error = TypeError(
                f"{_describe(call)} returned a {type(result).__name__}, which cannot be sent to "
                f"the client as msgpack ({e}); return plain data (None, bool, int, float, str, "
                "bytes, and lists or dicts of them)"
            )
            frames = encode(EngineCoreOutputType.UTILITY_RESULT, error_result(call.call_id, error))
        self.output_socket.send_multipart(frames, copy=False)

    def _call_utility(self, call: UtilityCall) -> Any:
        assert self.engine_core is not None
        if call.method == "collective_rpc":
            return self.engine_core.executor.run_rpc(RpcCall.from_wire(call.kwargs))
        if call.method in ENGINE_CORE_UTILITIES:
            return getattr(self.engine_core, call.method)(**call.kwargs)
        raise ValueError(
            f"unknown utility method {call.method!r}; the engine core serves 'collective_rpc' "
            f"and {ENGINE_CORE_UTILITIES}"
        )

    # -- output and shut-down ------------------------------------------------------------------
    def _send(self, tag: EngineCoreOutputType, payload: Any) -> None:
        self.output_socket.send_multipart(encode(tag, payload), copy=False)

    def _report_engine_dead(self, error: BaseException) -> None:
        if isinstance(error, WorkerDiedError):
            reason = str(error)
            logger.error("engine core is dead: %s", reason)
        elif isinstance(error, WorkerError):
            # The client learns which rank failed, in what and how; the tracebacks go here.
            reason = f"{error.summary}; the traceback is in the engine core's log"
            logger.error("engine core is dead: %s", error)
        else:
            reason = f"the engine core loop crashed:\n{traceback.format_exc()}"
            logger.error("engine core is dead: %s", reason)
        try:
            self._send(EngineCoreOutputType.ENGINE_DEAD, reason)
        except zmq.ZMQError:
            logger.exception("could not tell the client that the engine core is dead")

    def shutdown(self) -> None:
        """Stops the workers and closes the sockets; the process exits after this."""
        if self.engine_core is not None:
            self.engine_core.shutdown()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=_OUTPUT_LINGER_MS)
        self.ctx.term()

    # -- the client's death ----------------------------------------------------------------------
    def _on_client_death(self) -> None:
        """Runs on process.py's parent watch, which then ends this process."""
        self._parent_died = True
        logger.warning("the client process died; stopping the engine core and its workers")
        try:
            if self.engine_core is not None:
                self.engine_core.shutdown()
        finally:
            _remove_leftovers(self.client_ipc_dir)


def _remove_leftovers(client_ipc_dir: str) -> None:
    """Removes the client's ipc directory, which it can no longer remove, and anything of ours
    (named after this pid, see make_ipc_dir) that a shutdown interrupted at start-up missed.
    """
    shutil.rmtree(client_ipc_dir, ignore_errors=True)
    pattern = os.path.join(tempfile.gettempdir(), f"{IPC_DIR_PREFIX}{os.getpid()}-*")
    for ipc_dir in glob.glob(pattern):
        MessageQueue.remove_all(ipc_dir)


def _describe(call: UtilityCall) -> str:
    if call.method == "collective_rpc":
        return f"collective_rpc({call.kwargs.get('method')!r})"
    return call.method


def _request_id_of(payload: memoryview) -> str:
    # EngineCoreRequest is array-like and its first field is the id; the rest may be invalid.
    try:
        fields = msgspec.msgpack.decode(payload)
        return str(fields[0])
    except Exception:
        return ""


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    client_ipc_dir: str,
    ready_conn: Connection,
) -> None:
    """Entry point of the spawned engine core process (see process.py for the handshake)."""
    install_sigterm_handler()
    # The workers' first replies (their KV cache specs) carry torch dtypes, so unpickling them
    # imports torch, ~1 s; on a thread now, that overlaps the workers' own start-up instead.
    # Not a daemon: an interpreter must not exit in the middle of a thread's import.
    threading.Thread(target=importlib.import_module, args=("torch",), name="import-torch").start()
    # Ctrl-C reaches the whole process group; the client decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc = report_startup(
        ready_conn,
        lambda: EngineCoreProc(config, input_address, output_address, client_ipc_dir),
        lambda built: built.engine_core.info,
    )
    sys.exit(proc.run())
