"""SyncMPClient: a blocking client of an engine-core process, for tests.

The library's front ends use `InprocClient` (LLM) and `AsyncMPClient` (the API server); driving
a core process from plain blocking code is what the core-process tests need, so the client lives
here, over the library's `MPClient` (the same process handle, checks and protocol).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from v1engine.config import EngineConfig
from v1engine.engine.core_client import SEND_RETRY_S, SEND_RETRY_SLICE_S, MPClient
from v1engine.engine.core_process import DEAD, CoreProcess, EngineDeadError, OutputHandler
from v1engine.executor.rpc_call import RpcCall
from v1engine.request import EngineCoreOutputs, EngineCoreRequest


class SyncMPClient(MPClient):
    """The engine core in a background process; an output thread feeds a queue."""

    def __init__(self, config: EngineConfig) -> None:
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(config, self._outputs.put)
        thread = threading.Thread(
            target=read_outputs_until_exit,
            args=(self.handler, self.resources),
            name="v1engine-core-output",
            daemon=True,
        )
        self.resources.reader_thread = thread
        thread.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises ValueError (sending nothing) when the request cannot be served."""
        self._send(self._add_frames(request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._send(self._abort_frames(request_ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The outputs of the next step that produced tokens.

        Raises:
            TimeoutError: nothing arrived within `timeout` seconds.
        """
        try:
            item = self._outputs.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no engine core output within {timeout} s") from None
        if item is DEAD:
            self._outputs.put(DEAD)  # every later call fails too
            raise EngineDeadError(self.handler.dead_reason)
        return item

    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """As `Executor.collective_rpc`; arguments and results must be msgpack-able."""
        call = RpcCall(method, args, kwargs, timeout, unique_reply_rank)
        return self._call(*self._rpc_frames(call))

    def reset_prefix_cache(self) -> bool:
        return self._call(*self._utility_frames("reset_prefix_cache"))

    def _call(self, call_id: int, frames: list[bytes]) -> Any:
        future = self.handler.register_call(call_id, None)
        self._send(frames)
        return future.result()

    def _send(self, frames: list[bytes]) -> None:
        deadline = time.monotonic() + SEND_RETRY_S
        while not self._try_send(frames):
            if self.handler.dead_reason is not None or time.monotonic() > deadline:
                raise self._unreachable()
            time.sleep(SEND_RETRY_SLICE_S)


def read_outputs_until_exit(handler: OutputHandler, resources: CoreProcess) -> None:
    """The sync client's output thread: reads until the core exits or the client closes."""
    assert resources.child is not None
    socket, sentinel = resources.output_socket, resources.child.sentinel
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
