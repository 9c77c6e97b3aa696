"""ShmRingBuffer: fixed-size chunks in one shared-memory file, one writer, N readers.

Layout of the file (offsets in bytes; every field the writer and readers race on sits on its own
64-byte line so they do not share a cache line)::

    0                    write_seq   u32   the writer bumps it per message; readers sleep on it
    64                   read_seq    u32   each reader bumps it per read; the writer sleeps on it
    128                  closed      u8    set by the writer's close(); readers then raise
    192                  sleeping    u8    the writer is (about to be) asleep on read_seq
    256 + r              sleeping_r  u8    reader r is (about to be) asleep on write_seq
    FLAGS + i * stride   chunk i flags:  [written u8][read_0 u8][read_1 u8] ... [read_{n-1} u8]
    DATA  + i * C        chunk i data (C = chunk_bytes)

Chunk states, as (written, read flags)::

    (0, any)        empty or being written: readers keep off, the writer may fill it
    (1, some 0)     published: reader r reads it iff read_r == 0, then sets read_r = 1
    (1, all 1)      consumed by every reader: the writer may reuse it

The writer fills chunks in order 0, 1, ..., n-1, 0, ... and every reader reads them in the same
order, so a reader only ever looks at the one chunk it expects next. To reuse a chunk the writer
sets written = 0, writes the data, clears the read flags and only then sets written = 1; a reader
therefore never sees half a message. This relies on stores reaching other cores in program order,
which x86-64 guarantees; `_fence()` covers weaker CPUs.

Waking costs a system call, so a side only wakes the other when its `sleeping` flag is set. A
sleeper sets its flag, then (after a full fence) reads the sequence word and re-checks the chunk
before it sleeps; a waker bumps the sequence word, then (after a full fence) reads the flags. One
of the two always sees the other's store, so no wake-up is lost.

The file lives in /dev/shm under a fresh name per queue and is unlinked by the writer's close(),
or by whichever process notices the writer died (see `unlink`).
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import platform
import sys
import threading
import time
import uuid

from v1engine.utils import round_up

SHM_DIR = "/dev/shm"
SHM_PREFIX = "v1engine-"
_WRITE_SEQ = 0
_READ_SEQ = 64
_CLOSED = 128
_WRITER_SLEEPING = 192
_READERS_SLEEPING = 256
_LINE = 64
_STRONG_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()


def _fence() -> None:
    # Store-store / load-load ordering: free on x86; a lock round trip elsewhere.
    if not _STRONG_ORDER:
        full_fence()


def full_fence() -> None:
    """A full memory barrier (store-load too): acquiring a lock is an atomic read-modify-write,
    which orders every earlier store before every later load, on x86 as elsewhere.
    """
    with _fence_lock:
        pass


class ShmRingBuffer:
    """Args:
    n_reader: readers that must each read every chunk before it is reused.
    chunk_bytes: bytes per chunk (a message must fit in one chunk).
    max_chunks: chunks in the ring; the writer blocks when all are unread.
    path: an existing ring to attach to; None creates a new one.
    name_prefix: a new ring's file name starts with this, so an engine can remove all of
        its rings by prefix even when a process died before reporting its ring's name.
    """

    def __init__(
        self,
        n_reader: int,
        chunk_bytes: int,
        max_chunks: int,
        path: str | None = None,
        name_prefix: str = SHM_PREFIX,
    ) -> None:
        self.n_reader = n_reader
        self.chunk_bytes = chunk_bytes
        self.max_chunks = max_chunks
        self.flag_stride = round_up(1 + n_reader, _LINE)
        self.flags_start = round_up(_READERS_SLEEPING + n_reader, _LINE)
        self.data_start = round_up(self.flags_start + max_chunks * self.flag_stride, 4096)
        self.total_bytes = self.data_start + max_chunks * chunk_bytes
        self.is_creator = path is None
        self.path = path or os.path.join(SHM_DIR, f"{name_prefix}{uuid.uuid4().hex[:16]}")
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if self.is_creator else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if self.is_creator:
                # Sparse: tmpfs only backs the pages a message actually touches.
                os.ftruncate(fd, self.total_bytes)
            self._mmap = mmap.mmap(fd, self.total_bytes)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self._write_seq = ctypes.c_uint32.from_buffer(self._mmap, _WRITE_SEQ)
        self._read_seq = ctypes.c_uint32.from_buffer(self._mmap, _READ_SEQ)
        self.write_seq_addr = ctypes.addressof(self._write_seq)
        self.read_seq_addr = ctypes.addressof(self._read_seq)

    # -- flags ------------------------------------------------------------------------------
    def _flags_at(self, chunk: int) -> int:
        return self.flags_start + chunk * self.flag_stride

    def is_readable(self, chunk: int, reader: int) -> bool:
        at = self._flags_at(chunk)
        return self.buf[at] == 1 and self.buf[at + 1 + reader] == 0

    def is_writable(self, chunk: int) -> bool:
        at = self._flags_at(chunk)
        if self.buf[at] == 0:
            return True
        return self.buf[at + 1 : at + 1 + self.n_reader] == b"\x01" * self.n_reader

    def begin_write(self, chunk: int) -> memoryview:
        self.buf[self._flags_at(chunk)] = 0
        _fence()
        start = self.data_start + chunk * self.chunk_bytes
        return self.buf[start : start + self.chunk_bytes]

    def end_write(self, chunk: int) -> None:
        at = self._flags_at(chunk)
        self.buf[at + 1 : at + 1 + self.n_reader] = bytes(self.n_reader)
        _fence()
        self.buf[at] = 1
        _fence()
        self._write_seq.value += 1

    def chunk_view(self, chunk: int) -> memoryview:
        start = self.data_start + chunk * self.chunk_bytes
        return self.buf[start : start + self.chunk_bytes]

    def end_read(self, chunk: int, reader: int) -> None:
        _fence()
        self.buf[self._flags_at(chunk) + 1 + reader] = 1
        _fence()
        # Readers race on this word; a lost increment is harmless because any change, or the
        # writer's own re-check of the flags, ends its wait (see futex_wait below).
        self._read_seq.value += 1

    # -- sequence words -----------------------------------------------------------------------
    @property
    def write_seq(self) -> int:
        return self._write_seq.value

    @property
    def read_seq(self) -> int:
        return self._read_seq.value

    # -- sleeping flags (writer: reader = -1) ---------------------------------------------------
    def set_sleeping(self, reader: int, sleeping: bool) -> None:
        at = _WRITER_SLEEPING if reader < 0 else _READERS_SLEEPING + reader
        self.buf[at] = 1 if sleeping else 0

    def any_reader_sleeping(self) -> bool:
        flags = self.buf[_READERS_SLEEPING : _READERS_SLEEPING + self.n_reader]
        return flags != bytes(self.n_reader)

    def writer_sleeping(self) -> bool:
        return self.buf[_WRITER_SLEEPING] == 1

    @property
    def closed(self) -> bool:
        return self.buf[_CLOSED] == 1

    def mark_closed(self) -> None:
        self.buf[_CLOSED] = 1
        _fence()
        self._write_seq.value += 1
        self._read_seq.value += 1

    def close(self) -> None:
        """Unmaps (and, for the creator, unlinks). No other thread may still use the ring."""
        if self.buf is None:
            return
        del self._write_seq, self._read_seq
        self.buf.release()
        self.buf = None
        self._mmap.close()
        if self.is_creator:
            unlink(self.path)


def unlink_all(name_prefix: str) -> None:
    """Removes every ring whose name starts with `name_prefix` (one engine's rings)."""
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(name_prefix) + "*")):
        unlink(path)


def unlink(path: str) -> None:
    """Removes a ring's file; safe to call from any process, any number of times."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# -- sleeping and waking -------------------------------------------------------------------------
# Sleep/wake on a 32-bit word in shared memory, so idle queue readers cost no CPU.
#
# Linux futexes work across processes on a shared mapping: `wait(addr, expected)` sleeps only while
# the word still equals `expected` (the kernel checks atomically), and `wake(addr)` wakes every
# sleeper. A waker must change the word *before* waking, and a waiter must read the word *before*
# re-checking its condition; then no wake-up can be lost. Elsewhere (or on an unknown CPU) we fall
# back to short sleeps, which is correct but slower.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower()
)
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 2**31 - 1
_FALLBACK_SLEEP_S = 0.0005

FUTEX_AVAILABLE = sys.platform == "linux" and _SYS_FUTEX is not None
_libc = ctypes.CDLL(None, use_errno=True) if FUTEX_AVAILABLE else None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleeps until woken, until `timeout_s` passes, or at once if `*addr != expected`.

    Spurious returns are allowed: callers always re-check their condition in a loop.
    """
    if not FUTEX_AVAILABLE:
        time.sleep(min(timeout_s, _FALLBACK_SLEEP_S))
        return
    timeout_s = max(timeout_s, 0.0)
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    # ctypes drops the GIL for the call, so other threads run while we sleep.
    ret = _libc.syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(addr),
        _FUTEX_WAIT,
        ctypes.c_uint32(expected),
        ctypes.byref(ts),
        None,
        0,
    )
    if ret != 0:
        err = ctypes.get_errno()
        # EAGAIN: the word already changed; ETIMEDOUT / EINTR: let the caller re-check.
        if err not in (11, 110, 4):
            raise OSError(err, f"futex wait failed: {os.strerror(err)}")


def futex_wake(addr: int) -> None:
    """Wakes every thread or process sleeping on `addr`. Cheap when nobody sleeps."""
    if FUTEX_AVAILABLE:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _INT_MAX, None, None, 0)
