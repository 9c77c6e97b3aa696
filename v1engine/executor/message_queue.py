"""MessageQueue: one writer broadcasts Python objects to N readers in other processes.

Messages travel through a shared-memory ring (shm_ring.py). A message whose serialized size
exceeds `max_chunk_bytes` (10 MB by default) goes over a ZeroMQ XPUB socket instead, and the ring
carries a marker in its place, so readers still see every message in the writer's order.

A message is packed into a chunk by `pack_frames` (serialization.py draws the layout). Readers
copy buffers out of the ring before releasing the chunk, so nothing a reader returns aliases ring
memory that a later message may overwrite.

Readers on another node (ranks >= `n_local_reader`) cannot map the ring: the writer also
publishes every message to them over TCP (tcp_transport.py). A queue may have only such readers,
and then it has no ring at all.

Waiting: a blocked reader (or a writer facing a full ring) first spins for `spin_s`, which keeps
the latency of back-to-back messages low, then sleeps on a futex, so an idle queue uses no CPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import zmq

from v1engine.executor.serialization import deserialize, pack_frames, serialize, unpack_frames
from v1engine.executor.shm_ring import (
    ShmRingBuffer,
    full_fence,
    futex_wait,
    futex_wake,
    unlink_all,
)
from v1engine.executor.tcp_transport import (
    RemotePublisher,
    RemoteSubscriber,
    configure_socket,
    recv_frames,
    wait_for_subscribers,
    wait_until_sent,
    zmq_context,
)
from v1engine.utils import MiB_bytes

DEFAULT_MAX_CHUNK_BYTES = 10 * MiB_bytes
DEFAULT_MAX_CHUNKS = 4
DEFAULT_SPIN_S = 100e-6
_OVERFLOW = 0xFFFFFFFF
_HEADER_SLACK = 64 * 1024
_SLEEP_SLICE_S = 1.0
_READY = "__v1engine_queue_ready__"
IPC_DIR_PREFIX = "v1engine-"


class QueueClosedError(RuntimeError):
    """The queue was closed (locally or by its writer) while an operation was waiting on it."""


@dataclass(frozen=True)
class Handle:
    """Everything a reader process needs to attach to a queue. Picklable. Readers
    0 .. n_local_reader-1 use the ring (ring_path, zmq_address, ipc_dir: empty without local
    readers); the others connect to remote_address (None without remote readers).
    """

    n_reader: int
    ring_path: str
    max_chunk_bytes: int
    max_chunks: int
    zmq_address: str
    ipc_dir: str
    n_local_reader: int
    remote_address: str | None


def make_ipc_dir() -> str:
    """A private (0700) directory for one engine's ipc socket files. Its name carries the
    creating process's pid, and so do the names of the engine's rings (see ring_name_prefix),
    so every leftover can be traced to the process that made it.
    """
    return tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")


class MessageQueue:
    """One writer, `n_reader` readers.

    Args:
        n_reader: number of reader processes; each must attach with a distinct rank.
        max_chunk_bytes: messages larger than this go over ZeroMQ.
        max_chunks: ring depth, i.e. how many messages the writer may run ahead of readers.
        ipc_dir: directory for the ZeroMQ socket file; None creates a private one that
            close() removes.
        spin_s: how long a waiter spins before sleeping.
        n_local_reader: readers on this node (ranks 0 .. n_local_reader-1); None: all of them.
        remote_host: this node's IP address, which readers on other nodes connect to; needed
            when n_local_reader < n_reader.
    """

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        ipc_dir: str | None = None,
        spin_s: float = DEFAULT_SPIN_S,
        n_local_reader: int | None = None,
        remote_host: str | None = None,
    ) -> None:
        n_local = n_reader if n_local_reader is None else n_local_reader
        if n_reader < 1 or not 0 <= n_local <= n_reader:
            raise ValueError(
                f"MessageQueue needs n_reader >= 1 and 0 <= n_local_reader <= n_reader, got "
                f"n_reader={n_reader}, n_local_reader={n_local_reader}"
            )
        if n_local < n_reader and remote_host is None:
            raise ValueError("readers on other nodes need remote_host: this node's IP address")
        self._owns_ipc_dir = ipc_dir is None and n_local > 0
        self.ipc_dir = ipc_dir or (make_ipc_dir() if n_local else "")
        self._ring = self._socket = None
        self._socket_path = ""
        if n_local:
            self._init_ring(n_local, max_chunk_bytes + _HEADER_SLACK, max_chunks)
        self._publisher = None
        if n_local < n_reader:
            self._publisher = RemotePublisher(zmq_context(), remote_host)
        self._subscriber: RemoteSubscriber | None = None
        self._handle = Handle(
            n_reader=n_reader,
            ring_path=self._ring.path if self._ring else "",
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            zmq_address=f"ipc://{self._socket_path}" if self._ring else "",
            ipc_dir=self.ipc_dir,
            n_local_reader=n_local,
            remote_address=self._publisher.address if self._publisher else None,
        )
        self._init_common(is_writer=True, rank=-1, spin_s=spin_s)

    def _init_ring(self, n_local: int, chunk_bytes: int, max_chunks: int) -> None:
        self._ring = ShmRingBuffer(
            n_local, chunk_bytes, max_chunks, name_prefix=ring_name_prefix(self.ipc_dir)
        )
        name = os.path.basename(self._ring.path)
        self._socket_path = os.path.join(self.ipc_dir, f"{name}.sock")
        self._socket = zmq_context().socket(zmq.XPUB)
        configure_socket(self._socket)
        # Every reader's subscription must reach us, not just the first (see wait_until_ready).
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._socket.bind(f"ipc://{self._socket_path}")

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
        self._publisher = self._ring = self._socket = self._subscriber = None
        if rank >= handle.n_local_reader:
            self._subscriber = RemoteSubscriber(zmq_context(), handle.remote_address)
        else:
            self._ring = ShmRingBuffer(
                handle.n_local_reader,
                handle.max_chunk_bytes + _HEADER_SLACK,
                handle.max_chunks,
                path=handle.ring_path,
            )
            self._socket = zmq_context().socket(zmq.SUB)
            configure_socket(self._socket)
            self._socket.setsockopt(zmq.SUBSCRIBE, b"")
            self._socket.connect(handle.zmq_address)
        self._init_common(is_writer=False, rank=rank, spin_s=spin_s)
        return self

    def _init_common(self, is_writer: bool, rank: int, spin_s: float) -> None:
        self.is_writer = is_writer
        self.rank = rank
        self.spin_s = spin_s
        self.max_chunk_bytes = self._handle.max_chunk_bytes
        self._chunk = 0
        self._closed = False
        self._close_lock = threading.Lock()
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
        with self._op_lock:
            if self._closed:
                raise QueueClosedError("MessageQueue.enqueue: the queue was closed")
            deadline = None if timeout is None else time.monotonic() + timeout
            if self._ring is not None:
                self._write_ring(frames, timeout, deadline)
            if self._publisher is not None:
                self._publisher.send(frames, deadline, lambda: self._closed)

    def _write_ring(self, frames: list, timeout: float | None, deadline: float | None) -> None:
        sizes = [memoryview(f).nbytes for f in frames]
        chunk = self._chunk
        is_writable = partial(self._ring.is_writable, chunk)
        self._wait(is_writable, "enqueue", timeout, deadline)
        view = self._ring.begin_write(chunk)
        overflow = sum(sizes) > self.max_chunk_bytes
        if overflow:
            struct.pack_into("<I", view, 0, _OVERFLOW)
        else:
            pack_frames(view, frames, sizes)
        del view
        self._publish(chunk)
        if overflow:
            # The marker is out first, so readers already wait in ZeroMQ, which hands them
            # the message the moment its last byte lands (multipart delivery is atomic).
            tracker = self._socket.send_multipart(frames, copy=False, track=True)
            # Readers must get exactly what the caller had at enqueue time, so we return
            # only once ZeroMQ is done with the caller's buffers.
            wait_until_sent(tracker, deadline, lambda: self._closed)

    def _publish(self, chunk: int) -> None:
        self._ring.end_write(chunk)
        full_fence()
        if self._ring.any_reader_sleeping():
            futex_wake(self._ring.write_seq_addr)
        self._chunk = (chunk + 1) % self._ring.max_chunks

    # -- reader ---------------------------------------------------------------------------
    def dequeue(self, timeout: float | None = None) -> Any:
        """Returns the next message.

        Raises:
            TimeoutError: nothing arrived within `timeout` seconds (an overflow message whose
                marker came but whose frames did not stays next in line: the next dequeue
                waits for the same message).
            QueueClosedError: the queue was closed locally or by the writer.
        """
        if self.is_writer:
            raise RuntimeError("dequeue() called on the writer; attach a reader with a handle")
        with self._op_lock:
            if self._closed:
                raise QueueClosedError("MessageQueue.dequeue: the queue was closed")
            if self._subscriber is not None:
                frames = self._subscriber.recv(timeout, lambda: self._closed)
                if frames is None:
                    raise QueueClosedError("MessageQueue.dequeue: the queue was closed")
                return deserialize(frames)
            deadline = None if timeout is None else time.monotonic() + timeout
            chunk, rank = self._chunk, self.rank
            is_readable = partial(self._ring.is_readable, chunk, rank)
            self._wait(is_readable, "dequeue", timeout, deadline)
            view = self._ring.chunk_view(chunk)
            if struct.unpack_from("<I", view, 0)[0] != _OVERFLOW:
                try:
                    return unpack_frames(view)
                finally:
                    del view
                    self._release(chunk, rank)  # even if unpickling failed: no writer stall
            del view
            # The chunk is released only once the frames came: after a timeout the next
            # dequeue waits for the same message, so none is skipped or taken for another.
            check_open = partial(self._check_open, self._ring, "dequeue")
            frames = recv_frames(self._socket, deadline, check_open)
            if frames is None:
                raise TimeoutError(
                    f"MessageQueue.dequeue timed out after {timeout:.3g} s waiting for a message "
                    "over ZeroMQ (one published before the reader subscribed is lost: pass "
                    "wait_until_ready first)"
                )
            try:
                return deserialize(frames)
            finally:
                self._release(chunk, rank)

    def _release(self, chunk: int, rank: int) -> None:
        self._ring.end_read(chunk, rank)
        full_fence()
        if self._ring.writer_sleeping():
            futex_wake(self._ring.read_seq_addr)
        self._chunk = (chunk + 1) % self._ring.max_chunks

    # -- waiting ----------------------------------------------------------------------------
    def _wait(self, ready, op: str, timeout: float | None, deadline: float | None) -> None:
        """Returns once `ready()`; `deadline` (time.monotonic) is `timeout` s after the
        operation began, so the whole operation keeps to its timeout."""
        if ready():
            return
        ring = self._ring
        start = time.perf_counter()
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
                    remaining = min(remaining, deadline - time.monotonic())
                    if remaining <= 0:
                        raise TimeoutError(f"MessageQueue.{op} timed out after {timeout:.3g} s")
                futex_wait(seq_addr, seq, remaining)
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
            n_local = self._handle.n_local_reader
            if self._ring is not None:
                wait_for_subscribers(self._socket, n_local, deadline)
            if self._publisher is not None:
                self._publisher.wait_for_subscribers(self._handle.n_reader - n_local, deadline)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.enqueue(_READY, timeout=left)
            return
        message = self.dequeue(timeout=timeout)
        if message != _READY:
            raise RuntimeError(f"MessageQueue: expected the ready message, got {message!r}")

    def close(self) -> None:
        """Idempotent. Wakes every local thread blocked on this queue; the writer's close also
        makes readers in other processes raise QueueClosedError, and removes the shared memory
        and the socket file. Threads may race to close (an executor ending its worker group
        while another shuts it down): one closes, the others return.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        ring = self._ring
        if ring is not None:
            if self.is_writer:
                ring.mark_closed()
            futex_wake(ring.write_seq_addr)
            futex_wake(ring.read_seq_addr)
        with self._op_lock:  # the blocked operation has seen _closed and left
            for end in (self._socket, ring, self._publisher, self._subscriber):
                if end is not None:
                    end.close()
        if self.is_writer and ring is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._socket_path)
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
