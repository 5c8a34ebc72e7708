"""Exposed-communication accounting: wall time the training thread spends blocked on
communication, measured where it blocks.

Every blocking wait in the runtime (a P2P receive, a gradient bucket, a fused op's signal wait)
runs inside ``comm_wait(name)``. It adds the elapsed time to a per-thread counter and opens a
``comm_wait:<name>`` range (``names.comm_wait``) through ``nvtx.range``, so the same waits show in
torch.profiler traces and, on CUDA, as NVTX ranges in Nsight Systems.
The training loop reads ``exposed_seconds()`` before and after a step; exposed / step time is
the fraction of the step that communication was *not* hidden behind compute.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from overlap.profile import names, nvtx

__all__ = ["comm_wait", "exposed_seconds", "reset_exposed", "add_exposed", "axis_totals"]

_local = threading.local()


def exposed_seconds(axis: str | None = None) -> float:
    """Seconds this thread has spent inside comm_wait() since the last reset; with ``axis``
    only in the waits whose name starts with ``axis.`` (for example "ep")."""
    if axis is None:
        return getattr(_local, "exposed", 0.0)
    return getattr(_local, "by_axis", {}).get(axis, 0.0)


def reset_exposed() -> None:
    _local.exposed = 0.0
    _local.by_axis = {}


def add_exposed(seconds: float, by_axis: dict[str, float] | None = None) -> None:
    """Count waits another thread did on this thread's behalf (a pipeline pair's helper)."""
    _local.exposed = exposed_seconds() + seconds
    totals = getattr(_local, "by_axis", {})
    for axis, s in (by_axis or {}).items():
        totals[axis] = totals.get(axis, 0.0) + s
    _local.by_axis = totals


def axis_totals() -> dict[str, float]:
    """This thread's exposed seconds by axis (a copy)."""
    return dict(getattr(_local, "by_axis", {}))


@contextlib.contextmanager
def comm_wait(name: str) -> Iterator[None]:
    """Account the enclosed blocking wait as exposed communication (nesting counts once)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    t0 = time.perf_counter()
    try:
        with nvtx.range(names.comm_wait(name), required=True):
            yield
    finally:
        _local.depth = depth
        if depth == 0:
            dt = time.perf_counter() - t0
            add_exposed(dt, {name.split(".", 1)[0]: dt})
