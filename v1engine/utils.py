"""Small arithmetic and unit helpers shared by every package (a leaf: imports nothing of ours)."""

from __future__ import annotations

GiB_bytes = 1 << 30
MiB_bytes = 1 << 20


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (both non-negative ints)."""
    return cdiv(n, multiple) * multiple
