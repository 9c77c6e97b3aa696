"""The ZeroMQ side of MessageQueue: the TCP leg for readers on another node, and the socket
helpers the ring's overflow path shares with it (every wait keeps to a deadline).

A reader on another node cannot see the writer's shared memory, so the writer also publishes
every message on a ZeroMQ XPUB socket bound to TCP on its node's address, and each remote reader
holds a SUB socket connected to it. A message is the frame list of serialization.py; ZeroMQ
delivers a multipart message whole or not at all, and in the order sent. A single empty frame
marks the writer's close (a pickle stream is never empty).

Unlike the ring, nothing bounds how far the writer runs ahead of a remote reader: the executor
keeps only a few calls in flight, so the socket buffers stay small.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import zmq

from v1engine.utils import MiB_bytes

_CLOSE_FRAME = b""
_POLL_SLICE_S = 0.1  # how soon a blocked reader notices a local close()
_CLOSE_LINGER_MS = 200  # lets the close marker leave before the socket goes
_context: zmq.Context | None = None


def configure_socket(socket: zmq.Socket) -> None:
    # Never drop a message: the ring, or the executor's few calls in flight, bound the backlog.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDBUF, 4 * MiB_bytes)
    socket.setsockopt(zmq.RCVBUF, 4 * MiB_bytes)


def zmq_context() -> zmq.Context:
    """The process's one context. Two I/O threads let a writer feed two readers' sockets at
    once (overflow messages)."""
    global _context
    if _context is None:
        _context = zmq.Context(io_threads=2)
    return _context


def recv_frames(
    socket: zmq.Socket, deadline: float | None, check_open: Callable[[], None]
) -> list | None:
    """The next message's frames, polling in slices so that `check_open()` (which raises once
    the queue closed) runs between them; None once `deadline` (time.monotonic) passed."""
    while not socket.poll(poll_ms(deadline, _POLL_SLICE_S)):
        check_open()
        if deadline is not None and time.monotonic() >= deadline:
            return None
    return [f.buffer for f in socket.recv_multipart(copy=False)]


def poll_ms(deadline: float | None, slice_s: float) -> int:
    """Milliseconds for one `socket.poll`: a slice, or less to end at `deadline`
    (time.monotonic), rounded up so that a poll never returns just before it."""
    left = slice_s if deadline is None else min(slice_s, deadline - time.monotonic())
    return max(0, math.ceil(left * 1000))


def wait_until_sent(
    tracker: zmq.MessageTracker, deadline: float | None, is_closed: Callable[[], bool]
) -> None:
    """Waits until ZeroMQ no longer holds a zero-copy message's buffers (it has handed the
    message to every subscriber's connection), checking `is_closed()` every slice.

    Returns early once `is_closed()`: the messages of a closed queue no longer matter.

    Raises:
        TimeoutError: not sent by `deadline` (time.monotonic): a reader stopped reading. The
            message may still go out later, from the caller's buffers.
    """
    while not is_closed():
        try:
            tracker.wait(poll_ms(deadline, _POLL_SLICE_S) / 1000)
            return
        except zmq.NotDone:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    "MessageQueue.enqueue timed out: a reader stopped taking messages over ZeroMQ"
                ) from None


def wait_for_subscribers(socket: zmq.Socket, num_subscribers: int, deadline: float | None) -> None:
    """Waits until `num_subscribers` SUB sockets subscribed to the XPUB `socket` (with
    XPUB_VERBOSE every subscription is reported); a message sent before would be lost to them.
    """
    for _ in range(num_subscribers):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not socket.poll(None if left is None else int(left * 1000)):
            raise TimeoutError("MessageQueue readers did not connect in time")
        socket.recv()


class RemotePublisher:
    """The writer's side: binds `tcp://host:<free port>`; `address` is what readers connect to."""

    def __init__(self, context: zmq.Context, host: str) -> None:
        self._socket = context.socket(zmq.XPUB)
        configure_socket(self._socket)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._socket.bind(f"tcp://{host}:*")
        self.address: str = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def wait_for_subscribers(self, num_subscribers: int, deadline: float | None) -> None:
        wait_for_subscribers(self._socket, num_subscribers, deadline)

    def send(self, frames: list, deadline: float | None, is_closed: Callable[[], bool]) -> None:
        # Out-of-band frames are the caller's tensors: return only once ZeroMQ is done with
        # them, so readers get exactly what the caller had at enqueue time.
        tracker = self._socket.send_multipart(frames, copy=False, track=True)
        wait_until_sent(tracker, deadline, is_closed)

    def close(self) -> None:
        try:
            self._socket.send(_CLOSE_FRAME, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # nobody left to tell
        self._socket.close(linger=_CLOSE_LINGER_MS)


class RemoteSubscriber:
    """A reader's side of a RemotePublisher."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._socket = context.socket(zmq.SUB)
        configure_socket(self._socket)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(address)
        self.writer_closed = False

    def recv(self, timeout: float | None, is_closed: Callable[[], bool]) -> list | None:
        """Returns the next message's frames, or None once the queue is closed (by the writer,
        or locally: `is_closed()` is checked every poll slice).

        Raises:
            TimeoutError: nothing arrived within `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.writer_closed:
            if is_closed():
                return None
            # Poll before checking the deadline, so that timeout=0 still takes what is here.
            if self._socket.poll(poll_ms(deadline, _POLL_SLICE_S)):
                frames = self._socket.recv_multipart(copy=False)
                if len(frames) == 1 and len(frames[0]) == 0:
                    self.writer_closed = True
                    break
                return [f.buffer for f in frames]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"MessageQueue.dequeue timed out after {timeout:.3g} s")
        return None

    def close(self) -> None:
        self._socket.close(linger=0)
