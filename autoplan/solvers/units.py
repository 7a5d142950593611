"""Readable units for the numbers solvers handle: bytes and seconds.

Decimal units throughout: 1 GB = 1e9 bytes, 1 MB = 1e6 bytes (as GPU data sheets and the
``--memory-per-device`` option count them).
"""

from __future__ import annotations

import math

BYTES_PER_GB = 1e9
BYTES_PER_MB = 1e6


def format_bytes(n: float) -> str:
    """``3.21 GB`` at or above one gigabyte, ``512.00 MB`` below it (two decimals)."""
    if not math.isfinite(n):
        return f"{n} B"
    if abs(n) >= BYTES_PER_GB:
        return f"{n / BYTES_PER_GB:.2f} GB"
    return f"{n / BYTES_PER_MB:.2f} MB"


def format_seconds(t: float) -> str:
    """``1.23 s``, ``4.56 ms`` or ``7.89 us``: the largest unit that keeps the number >= 1."""
    if not math.isfinite(t):
        return f"{t} s"
    if abs(t) >= 1.0:
        return f"{t:.2f} s"
    if abs(t) >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.2f} us"
