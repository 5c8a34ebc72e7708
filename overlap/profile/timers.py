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

__all__ = ["comm_wait", "exposed_seconds", "reset_exposed"]

_local = threading.local()


def exposed_seconds() -> float:
    """Seconds this thread has spent inside comm_wait() since the last reset."""
    return getattr(_local, "exposed", 0.0)


def reset_exposed() -> None:
    _local.exposed = 0.0


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
            _local.exposed = exposed_seconds() + time.perf_counter() - t0
