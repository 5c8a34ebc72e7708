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

import threading
import time
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


class comm_wait:  # noqa: N801 - used as ``with comm_wait(name):``, like a function
    """Account the enclosed blocking wait as exposed communication (nesting counts once).
    A class, not a generator: it runs on every op call, and costs about 1 us this way
    (the range opens only when a profiler or CUDA would record it)."""

    __slots__ = ("name", "t0", "depth", "range")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        self.depth = getattr(_local, "depth", 0)
        _local.depth = self.depth + 1
        self.range = None
        if nvtx.recording():
            self.range = nvtx.range(names.comm_wait(self.name), required=True)
            self.range.__enter__()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        dt = time.perf_counter() - self.t0
        _local.depth = self.depth
        try:
            if self.range is not None:
                self.range.__exit__(*exc)
        finally:
            if self.depth == 0:
                _local.exposed = getattr(_local, "exposed", 0.0) + dt
                totals = getattr(_local, "by_axis", None)
                if totals is None:
                    totals = _local.by_axis = {}
                axis = self.name.partition(".")[0]
                totals[axis] = totals.get(axis, 0.0) + dt
