"""MessageQueue: one writer broadcasts Python objects to N readers in other processes.

Messages travel through a shared-memory ring (shm_ring.py). A message whose serialized size
exceeds `max_chunk_bytes` (10 MB by default) goes over a ZeroMQ XPUB socket instead, and the ring
carries a marker in its place, so readers still see every message in the writer's order.

A message is packed into a chunk as::

    [u32 num_frames][u64 size] * num_frames [pad to 64] frame 0 [pad] frame 1 ...

where frame 0 is the pickle stream and frames 1.. the raw buffers of arrays and tensors (see
serialization.py). Readers copy buffers out of the ring before releasing the chunk, so nothing a
reader returns aliases ring memory that a later message may overwrite.

Waiting: a blocked reader (or a writer facing a full ring) first spins for `spin_s`, which keeps
the latency of back-to-back messages low, then sleeps on a futex, so an idle queue uses no CPU.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from v1engine.executor import futex
from v1engine.executor.serialization import deserialize, serialize
from v1engine.executor.shm_ring import ShmRingBuffer, full_fence, unlink_all

DEFAULT_MAX_CHUNK_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_CHUNKS = 4
DEFAULT_SPIN_S = 100e-6
_OVERFLOW = 0xFFFFFFFF
_HEADER_SLACK = 64 * 1024
_ALIGN = 64
_SLEEP_SLICE_S = 1.0
_READY = "__v1engine_queue_ready__"
IPC_DIR_PREFIX = "v1engine-"


class QueueClosedError(RuntimeError):
    """The queue was closed (locally or by its writer) while an operation was waiting on it."""


@dataclass(frozen=True)
class Handle:
    """Everything a reader process needs to attach to a queue. Picklable."""

    n_reader: int
    ring_path: str
    max_chunk_bytes: int
    max_chunks: int
    zmq_address: str
    ipc_dir: str


def make_ipc_dir() -> str:
    """A private (0700) directory for one engine's ipc socket files. Its name carries the
    creating process's pid, and so do the names of the engine's rings (see ring_name_prefix),
    so every leftover can be traced to the process that made it.
    """
    return tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class MessageQueue:
    """One writer, `n_reader` readers.

    Args:
        n_reader: number of reader processes; each must attach with a distinct rank.
        max_chunk_bytes: messages larger than this go over ZeroMQ.
        max_chunks: ring depth, i.e. how many messages the writer may run ahead of readers.
        ipc_dir: directory for the ZeroMQ socket file; None creates a private one that
            close() removes.
        spin_s: how long a waiter spins before sleeping.
    """

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        ipc_dir: str | None = None,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> None:
        if n_reader < 1:
            raise ValueError(f"MessageQueue needs at least one reader, got n_reader={n_reader}")
        self._owns_ipc_dir = ipc_dir is None
        self.ipc_dir = ipc_dir or make_ipc_dir()
        self._ring = ShmRingBuffer(
            n_reader,
            max_chunk_bytes + _HEADER_SLACK,
            max_chunks,
            name_prefix=ring_name_prefix(self.ipc_dir),
        )
        name = os.path.basename(self._ring.path)
        self._socket_path = os.path.join(self.ipc_dir, f"{name}.sock")
        self._socket = _zmq_context().socket(zmq.XPUB)
        self._configure_socket()
        # Every reader's subscription must reach us, not just the first (see wait_until_ready).
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._socket.bind(f"ipc://{self._socket_path}")
        self._handle = Handle(
            n_reader=n_reader,
            ring_path=self._ring.path,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            zmq_address=f"ipc://{self._socket_path}",
            ipc_dir=self.ipc_dir,
        )
        self._init_common(is_writer=True, rank=-1, spin_s=spin_s)

    @classmethod
    def create_from_handle(
        cls, handle: Handle, rank: int, spin_s: float = DEFAULT_SPIN_S
    ) -> MessageQueue:
        """Attaches reader `rank` (0 <= rank < n_reader) to the queue behind `handle`."""
        if not 0 <= rank < handle.n_reader:
            raise ValueError(f"reader rank must be in [0, {handle.n_reader}), got {rank}")
        self = cls.__new__(cls)
        self._handle = handle
        self._owns_ipc_dir = False
        self.ipc_dir = handle.ipc_dir
        self._ring = ShmRingBuffer(
            handle.n_reader,
            handle.max_chunk_bytes + _HEADER_SLACK,
            handle.max_chunks,
            path=handle.ring_path,
        )
        self._socket = _zmq_context().socket(zmq.SUB)
        self._configure_socket()
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(handle.zmq_address)
        self._init_common(is_writer=False, rank=rank, spin_s=spin_s)
        return self

    def _configure_socket(self) -> None:
        # Never drop: the ring already bounds how many overflow messages can be in flight.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDBUF, 4 << 20)
        self._socket.setsockopt(zmq.RCVBUF, 4 << 20)

    def _init_common(self, is_writer: bool, rank: int, spin_s: float) -> None:
        self.is_writer = is_writer
        self.rank = rank
        self.spin_s = spin_s
        self.max_chunk_bytes = self._handle.max_chunk_bytes
        self._chunk = 0
        self._closed = False
        self._op_lock = threading.Lock()

    def export_handle(self) -> Handle:
        return self._handle

    # -- writer ---------------------------------------------------------------------------
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Sends `obj` to every reader. Blocks while the ring is full.

        Raises:
            TimeoutError: the readers did not free a chunk within `timeout` seconds.
            QueueClosedError: the queue was closed.
        """
        if not self.is_writer:
            raise RuntimeError("enqueue() called on a reader; only the queue's creator writes")
        frames = serialize(obj)
        sizes = [memoryview(f).nbytes for f in frames]
        with self._op_lock:
            if self._closed:
                raise QueueClosedError("MessageQueue.enqueue: the queue was closed")
            chunk = self._chunk
            self._wait(lambda: self._ring.is_writable(chunk), self._ring, timeout, "enqueue")
            view = self._ring.begin_write(chunk)
            overflow = sum(sizes) > self.max_chunk_bytes
            if overflow:
                struct.pack_into("<I", view, 0, _OVERFLOW)
            else:
                _pack(view, frames, sizes)
            del view
            self._publish(chunk)
            if overflow:
                # The marker is out first, so readers already wait in ZeroMQ, which hands them
                # the message the moment its last byte lands (multipart delivery is atomic).
                tracker = self._socket.send_multipart(frames, copy=False, track=True)
                # Readers must get exactly what the caller had at enqueue time, so we return
                # only once ZeroMQ is done with the caller's buffers.
                tracker.wait()

    def _publish(self, chunk: int) -> None:
        self._ring.end_write(chunk)
        full_fence()
        if self._ring.any_reader_sleeping():
            futex.wake(self._ring.write_seq_addr)
        self._chunk = (chunk + 1) % self._ring.max_chunks

    # -- reader ---------------------------------------------------------------------------
    def dequeue(self, timeout: float | None = None) -> Any:
        """Returns the next message.

        Raises:
            TimeoutError: nothing arrived within `timeout` seconds.
            QueueClosedError: the queue was closed locally or by the writer.
        """
        if self.is_writer:
            raise RuntimeError("dequeue() called on the writer; attach a reader with a handle")
        with self._op_lock:
            if self._closed:
                raise QueueClosedError("MessageQueue.dequeue: the queue was closed")
            chunk, rank = self._chunk, self.rank
            self._wait(lambda: self._ring.is_readable(chunk, rank), self._ring, timeout, "dequeue")
            view = self._ring.chunk_view(chunk)
            try:
                if struct.unpack_from("<I", view, 0)[0] == _OVERFLOW:
                    return deserialize(self._recv_overflow())
                return _unpack(view)
            finally:
                # Release the chunk even if unpickling failed, or the writer would stall.
                del view
                self._ring.end_read(chunk, rank)
                full_fence()
                if self._ring.writer_sleeping():
                    futex.wake(self._ring.read_seq_addr)
                self._chunk = (chunk + 1) % self._ring.max_chunks

    def _recv_overflow(self) -> list[memoryview]:
        # The writer sends the frames right after the marker; poll in slices so a close() or a
        # dead writer cannot leave us blocked in ZeroMQ forever.
        while not self._socket.poll(int(_SLEEP_SLICE_S * 1000)):
            self._check_open(self._ring, "dequeue")
        return [f.buffer for f in self._socket.recv_multipart(copy=False)]

    # -- waiting ----------------------------------------------------------------------------
    def _wait(self, ready, ring: ShmRingBuffer, timeout: float | None, op: str) -> None:
        if ready():
            return
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        # Spin politely: yielding hands the core to the process we are waiting for when both
        # share it, and a message that arrives now costs no sleep and no wake-up call.
        spin_until = start + self.spin_s
        while time.perf_counter() < spin_until:
            os.sched_yield()
            if ready():
                return
        me = -1 if self.is_writer else self.rank
        seq_addr = ring.read_seq_addr if self.is_writer else ring.write_seq_addr
        ring.set_sleeping(me, True)
        full_fence()  # the other side must see our flag before we read its progress
        try:
            while True:
                seq = ring.read_seq if self.is_writer else ring.write_seq
                if ready():
                    return
                self._check_open(ring, op)
                remaining = _SLEEP_SLICE_S
                if deadline is not None:
                    remaining = min(remaining, deadline - time.perf_counter())
                    if remaining <= 0:
                        raise TimeoutError(f"MessageQueue.{op} timed out after {timeout:.3g} s")
                futex.wait(seq_addr, seq, remaining)
        finally:
            ring.set_sleeping(me, False)

    def _check_open(self, ring: ShmRingBuffer, op: str) -> None:
        if self._closed:
            raise QueueClosedError(f"MessageQueue.{op}: the queue was closed")
        if ring.closed and not self.is_writer:
            raise QueueClosedError(f"MessageQueue.{op}: the writer closed the queue")

    # -- start-up and shut-down ---------------------------------------------------------------
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Start-up barrier. The writer waits until every reader's ZeroMQ subscription arrived
        (a message published before that would be lost), then sends a ready message that each
        reader waits for here.
        """
        if self.is_writer:
            deadline = None if timeout is None else time.monotonic() + timeout
            for _ in range(self._handle.n_reader):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._socket.poll(None if left is None else int(left * 1000)):
                    raise TimeoutError("MessageQueue readers did not connect in time")
                self._socket.recv()
            self.enqueue(_READY, timeout=timeout)
            return
        message = self.dequeue(timeout=timeout)
        if message != _READY:
            raise RuntimeError(f"MessageQueue: expected the ready message, got {message!r}")

    def close(self) -> None:
        """Idempotent. Wakes every local thread blocked on this queue; the writer's close also
        makes readers in other processes raise QueueClosedError, and removes the shared memory
        and the socket file.
        """
        if self._closed:
            return
        self._closed = True
        if self.is_writer:
            self._ring.mark_closed()
        futex.wake(self._ring.write_seq_addr)
        futex.wake(self._ring.read_seq_addr)
        with self._op_lock:  # the blocked operation has seen _closed and left
            self._socket.close(linger=0)
            self._ring.close()
        if self.is_writer:
            _remove(self._socket_path)
            if self._owns_ipc_dir:
                shutil.rmtree(self.ipc_dir, ignore_errors=True)

    @staticmethod
    def remove_all(ipc_dir: str) -> None:
        """Removes the shared memory and socket files of every queue created with `ipc_dir`,
        for when their writers died before closing them.
        """
        unlink_all(ring_name_prefix(ipc_dir))
        shutil.rmtree(ipc_dir, ignore_errors=True)


def ring_name_prefix(ipc_dir: str) -> str:
    # The ipc directory's name is unique per engine (mkdtemp), so it names the engine's rings.
    return os.path.basename(os.path.normpath(ipc_dir)) + "-"


def _pack(view: memoryview, frames: list, sizes: list[int]) -> None:
    header = struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes)
    view[: len(header)] = header
    offset = _align(len(header))
    for frame, size in zip(frames, sizes):
        view[offset : offset + size] = memoryview(frame).cast("B")
        offset = _align(offset + size)


def _unpack(view: memoryview) -> Any:
    (num_frames,) = struct.unpack_from("<I", view, 0)
    sizes = struct.unpack_from(f"<{num_frames}Q", view, 4)
    offset = _align(4 + 8 * num_frames)
    if num_frames == 1:  # the common small message: no out-of-band buffers
        return deserialize([view[offset : offset + sizes[0]]])
    starts = []
    for size in sizes:
        starts.append(offset)
        offset = _align(offset + size)
    # Private copies of the out-of-band buffers, so nothing returned aliases the ring. Building
    # the bytearray from the slice copies once (a zeroed bytearray would touch the memory twice).
    buffers = [bytearray(view[start : start + size]) for start, size in zip(starts[1:], sizes[1:])]
    return deserialize([view[starts[0] : starts[0] + sizes[0]], *buffers])


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_context: zmq.Context | None = None


def _zmq_context() -> zmq.Context:
    # Two I/O threads let a writer feed two readers' sockets at once for overflow messages.
    global _context
    if _context is None:
        _context = zmq.Context(io_threads=2)
    return _context
