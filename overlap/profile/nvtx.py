"""Device-neutral profiler ranges: one ``with nvtx.range("ag_matmul.chunked.gemm[3]"):`` marks
a span for both tools that look at overlap.

- ``torch.profiler.record_function``: the span appears in torch.profiler traces on every device
  (so the CPU twin's traces show each chunk's comm and GEMM, per thread);
- ``torch.cuda.nvtx``: when CUDA is available the same span is pushed as an NVTX range, which
  Nsight Systems shows on the CPU thread that launched the work.

A range measures the *host* time spent inside it. For work the host only enqueues (CUDA kernels,
async collectives) that is the launch cost, not the device time: read device spans from the
kernel rows of the trace, and use the ranges to attribute them to chunks.

Names follow the one scheme in ``overlap/profile/names.py`` (build them with its helpers:
``names.chunk(...)``, ``names.pp_action(...)``), which is what ``overlap-analyze`` reads back.

Set ``OVERLAP_NVTX=0`` to turn ranges into no-ops. Without a running torch.profiler a range
costs about 1 us on CPU (no ``record_function``), plus an NVTX push/pop on CUDA. The
ranges the analyzer cannot do without (``step`` and ``comm_wait``) pass ``required=True`` and
stay on.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.autograd.profiler as _autograd_profiler

from overlap.profile import names

__all__ = ["range", "step", "enabled"]

_ENABLED = os.environ.get("OVERLAP_NVTX", "1") != "0"
_CUDA: bool | None = None


def enabled() -> bool:
    return _ENABLED


def _cuda() -> bool:
    global _CUDA
    if _CUDA is None:
        _CUDA = torch.cuda.is_available()
    return _CUDA


@contextlib.contextmanager
def range(name: str, *, required: bool = False) -> Iterator[None]:  # noqa: A001
    """Mark the enclosed host code as ``name`` in torch.profiler traces and, on CUDA, in NVTX
    (the name mirrors torch.cuda.nvtx.range)."""
    if not (_ENABLED or required):
        yield
        return
    # record_function costs ~6 us even when no torch.profiler runs (it would record nowhere):
    # only when one does (a process-wide flag, so every thread's ranges are kept).
    traced = _autograd_profiler._is_profiler_enabled
    if not traced and not _cuda():
        yield
        return
    with torch.profiler.record_function(name) if traced else contextlib.nullcontext():
        if _cuda():
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield


def step(n: int) -> contextlib.AbstractContextManager[None]:
    """The range of training step ``n`` (``step:<n>``), the analyzer's unit of report."""
    return range(names.step(n), required=True)
