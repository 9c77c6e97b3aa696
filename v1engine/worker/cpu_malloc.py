"""glibc malloc settings for a CPU worker.

A CPU step allocates the same large tensors every layer (gathered K/V, MLP activations, logits:
megabytes each). glibc serves blocks above its mmap threshold with a fresh mmap and unmaps them on
free, and gives the top of the heap back to the OS past its trim threshold; either way the next
step's tensor of the same size is new memory, and the kernel zero-fills it page by page. On the
default SmolLM2 benchmark that was about a million page faults per run and roughly a third of the
decode attention time. Raising both thresholds keeps those blocks in the heap, where the next
step reuses them (vLLM's CPU backend gets the same effect by preloading tcmalloc).

The cost is memory: the heap keeps up to `_TRIM_THRESHOLD_BYTES` of freed activations, which the
profiling run has already counted as this worker's peak.
"""

from __future__ import annotations

import ctypes
import platform

from v1engine.logger import init_logger
from v1engine.utils import GiB_bytes, MiB_bytes

logger = init_logger(__name__)

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2, which is 32 MiB on 64-bit.
_MMAP_THRESHOLD_BYTES = 32 * MiB_bytes
_TRIM_THRESHOLD_BYTES = GiB_bytes
_TOP_PAD_BYTES = 64 * MiB_bytes


def tune_malloc_for_tensors() -> bool:
    """Keeps freed tensor memory in this process's heap for reuse. Returns whether it applied
    (False off glibc, e.g. musl or macOS, where the defaults stay)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    applied = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES),
            (_M_TOP_PAD, _TOP_PAD_BYTES),
        )
    )
    if not applied:
        logger.warning("glibc mallopt refused a setting; CPU steps may page-fault more")
    return applied


def release_free_heap() -> None:
    """Returns the free memory of this process's heap to the OS (glibc's malloc_trim): the
    thresholds above keep freed blocks for reuse, which memory given back on purpose (sleep
    mode) must not be. Does nothing off glibc."""
    if platform.libc_ver()[0] != "glibc":
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
