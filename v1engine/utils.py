"""Small helpers shared by every package (a leaf: imports nothing of ours)."""

from __future__ import annotations

import contextlib
import os
import tempfile

# Derived artifacts (converted checkpoints, compiled kernels, configs), shared by every checkout.
DEFAULT_CACHE_DIR = "~/.cache/v1engine"

GiB_bytes = 1 << 30
MiB_bytes = 1 << 20


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (both non-negative ints)."""
    return cdiv(n, multiple) * multiple


def write_atomically(path: str, text: str) -> None:
    """Writes `path` whole or not at all (a concurrent reader never sees part of it); a cache
    that cannot be written (a read-only home) is skipped, not an error."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)
