"""BackgroundResources: what one multiprocess client owns outside Python objects.

That is the engine core process, the ZeroMQ context and the two sockets bound in a private ipc
directory (named after this process, see make_ipc_dir), and the pipe that wakes the client's
output thread. `start()` spawns the core and waits for its READY; `close()` stops the core
(SHUTDOWN, then SIGTERM, then SIGKILL), closes the sockets and removes the directory. `close()`
is idempotent and holds no reference to the client, so a finalizer can run it at collection or
interpreter exit.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import msgspec
import zmq

from v1engine.config import EngineConfig
from v1engine.core.engine_core_proc import run_engine_core
from v1engine.core.protocol import READY, EngineCoreRequestType, EngineInfo, encode
from v1engine.executor.errors import describe_exitcode
from v1engine.executor.message_queue import make_ipc_dir
from v1engine.logger import init_logger

logger = init_logger(__name__)

# Building the engine loads weights and profiles memory; a failure ends the wait at once.
STARTUP_TIMEOUT_S = 900.0
_GRACEFUL_EXIT_S = 5.0
_TERMINATE_EXIT_S = 10.0  # SIGTERM makes the core stop its workers, which may take seconds
_READER_JOIN_S = 5.0


class BackgroundResources:
    def __init__(self) -> None:
        self.closed = False
        self.ready = False
        self.proc: multiprocessing.process.BaseProcess | None = None
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

    def start(self, config: EngineConfig) -> EngineInfo:
        """Spawns the engine core and waits for READY.

        Raises:
            ValueError / RuntimeError: the engine could not be built; the message carries the
                core's traceback (and a failing worker's). The core process has exited.
        """
        context = multiprocessing.get_context("spawn")
        reader, writer = context.Pipe(duplex=False)
        args = (config, self.input_address, self.output_address, self.ipc_dir, writer)
        # Not a daemon: daemonic processes may not have children, and the workers are its.
        proc = context.Process(target=run_engine_core, args=args, name="V1EngineCore")
        try:
            try:
                proc.start()
            finally:
                writer.close()  # the child has its copy; EOF then means it exited
            self.proc = proc  # only a started process is ours to stop
            info = _wait_for_ready(proc, reader)
            self.ready = True
            return info
        finally:
            reader.close()

    @property
    def core_exit_reason(self) -> str:
        assert self.proc is not None
        self.proc.join(1.0)  # the sentinel fired; reap it so the exit code is known
        return (
            f"the engine core process (pid {self.proc.pid}) died "
            f"({describe_exitcode(self.proc.exitcode)})"
        )

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
        if self.proc is not None:
            self._stop_process(self.proc)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        os.close(self.wake_r)
        os.close(self.wake_w)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _stop_process(self, proc: multiprocessing.process.BaseProcess) -> None:
        # A core still starting (Ctrl-C during start-up) reads no messages yet: SIGTERM at once.
        if self.ready and proc.exitcode is None:
            self._send_shutdown()
            proc.join(_GRACEFUL_EXIT_S)
        if proc.exitcode is None:
            if self.ready:
                logger.warning("engine core pid %d did not stop; terminating it", proc.pid)
            proc.terminate()
            proc.join(_TERMINATE_EXIT_S)
        if proc.exitcode is None:
            # Its workers see it die and exit on their own, removing their shared memory.
            logger.warning("engine core pid %d ignored SIGTERM; killing it", proc.pid)
            proc.kill()
            proc.join()
        proc.close()

    def _send_shutdown(self) -> None:
        if not self.send_lock.acquire(timeout=1.0):
            return  # a sender is stuck: SIGTERM follows
        try:
            self.input_socket.send_multipart(
                encode(EngineCoreRequestType.SHUTDOWN), flags=zmq.NOBLOCK
            )
        except zmq.ZMQError:
            pass  # not reading any more: SIGTERM follows
        finally:
            self.send_lock.release()


def _wait_for_ready(proc: multiprocessing.process.BaseProcess, conn: Connection) -> EngineInfo:
    if not wait([conn, proc.sentinel], STARTUP_TIMEOUT_S):
        raise RuntimeError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")
    try:
        message = msgspec.msgpack.decode(conn.recv_bytes()) if conn.poll() else None
    except EOFError:
        message = None  # the core exited without a word: its exit code says how
    if message is not None and message[0] == READY:
        return msgspec.convert(message[1], EngineInfo)
    if message is not None:
        _, exc_type, text = message
        proc.join(_GRACEFUL_EXIT_S)  # it exits after FAILED, once its workers are stopped
        error_cls = ValueError if exc_type == "ValueError" else RuntimeError
        raise error_cls(f"the engine core failed to start:\n{text}")
    proc.join(_GRACEFUL_EXIT_S)
    raise RuntimeError(
        "the engine core process died during start-up "
        f"({describe_exitcode(proc.exitcode)}); see its log above"
    )
