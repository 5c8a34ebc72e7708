"""Values the whole runtime shares, each defined once.

``TIMEOUT_S``: how long any communication wait of the TP ops, region collectives, quantized
collectives and DP buckets may take before it fails, naming the op (a peer slower than this is
treated as dead). Every communicator and call takes its own ``timeout=``; this is the default.

``ALIGN``: byte alignment of every region of a userbuffer workspace (vector loads, cache
lines), on CPU shared memory and GPU memory alike; ``align(n)`` rounds ``n`` bytes up to it.
"""

from __future__ import annotations

__all__ = ["TIMEOUT_S", "ALIGN", "align"]

TIMEOUT_S = 300.0
ALIGN = 256


def align(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to
