"""Values the whole runtime shares, each defined once.

``TIMEOUT_S``: how long any communication wait of the TP ops, region collectives, quantized
collectives, DP buckets, userbuffer workspaces and pipeline P2P may take before it fails, naming
the op (a peer slower than this is treated as dead). Every communicator and call takes its own
``timeout=``; this is the default.

``ALIGN``: byte alignment of every region of a userbuffer workspace (vector loads, cache
lines), on CPU shared memory and GPU memory alike; ``align(n)`` rounds ``n`` bytes up to it.

``positive_int`` and ``positive_seconds``: the argument checks every constructor and op shares,
with one wording ("<what> must be a positive int, got 0"); a bool is refused (tp=True is a
bug, not tp=1). ``kept``: scratch buffers of at most ``SCRATCH_BYTES`` kept across op calls.
"""

from __future__ import annotations

import math

__all__ = ["TIMEOUT_S", "ALIGN", "SCRATCH_BYTES", "align", "kept", "positive_int",
           "positive_seconds"]

TIMEOUT_S = 300.0
ALIGN = 256
# A fused op's scratch (a message, a gathered input nobody returns) of at most this many bytes
# is kept for the op's later calls: on small shapes allocating and viewing it costs more host
# time than moving it. Larger ones are allocated per call (the allocator reuses their memory).
SCRATCH_BYTES = 1 << 20
_KEPT_ENTRIES = 32


def kept(store: dict, key, make):
    """``make()``'s tuple of buffers (the first one's size decides), kept in ``store`` under
    ``key`` and returned again for later calls when it is at most ``SCRATCH_BYTES``; made anew
    on every call otherwise. The caller must order a reuse after every use of the last call
    (the ops' transports do: docs/design/tp.md, "Scratch")."""
    found = store.get(key)
    if found is not None:
        return found
    made = make()
    if made[0].numel() * made[0].element_size() <= SCRATCH_BYTES:
        if len(store) >= _KEPT_ENTRIES:
            store.clear()
        store[key] = made
    return made


def align(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


def _shown(value) -> str:
    return repr(value) if type(value) is int else f"{value!r} ({type(value).__name__})"


def positive_int(value, what: str, *, where: str = "", extra: str = "") -> int:
    """``value`` if it is an int >= 1 (not a bool), else ValueError "<what> must be a positive
    int<extra>, got <value><where>"; ``where`` is e.g. " (rank 0 of group [0, 1])"."""
    if type(value) is not int or value < 1:
        raise ValueError(f"{what} must be a positive int{extra}, got {_shown(value)}{where}")
    return value


def positive_seconds(value, what: str, *, where: str = "") -> float:
    """``value`` as float seconds if it is a finite number > 0 (not a bool), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < math.inf:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}{where}")
    return float(value)
