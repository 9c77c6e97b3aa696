"""Sleep/wake on a 32-bit word in shared memory, so idle queue readers cost no CPU.

Linux futexes work across processes on a shared mapping: `wait(addr, expected)` sleeps only while
the word still equals `expected` (the kernel checks atomically), and `wake(addr)` wakes every
sleeper. A waker must change the word *before* waking, and a waiter must read the word *before*
re-checking its condition; then no wake-up can be lost. Elsewhere (or on an unknown CPU) we fall
back to short sleeps, which is correct but slower.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower()
)
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 2**31 - 1
_FALLBACK_SLEEP_S = 0.0005

AVAILABLE = sys.platform == "linux" and _SYS_FUTEX is not None
_libc = ctypes.CDLL(None, use_errno=True) if AVAILABLE else None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleeps until woken, until `timeout_s` passes, or at once if `*addr != expected`.

    Spurious returns are allowed: callers always re-check their condition in a loop.
    """
    if not AVAILABLE:
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


def wake(addr: int) -> None:
    """Wakes every thread or process sleeping on `addr`. Cheap when nobody sleeps."""
    if AVAILABLE:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _INT_MAX, None, None, 0)
