"""Device-neutral profiler ranges: one ``with nvtx.range("all_gather_matmul.chunked.gemm[3]"):`` marks
a span as a ``torch.profiler.record_function`` (every device) and, when CUDA is available, as an
NVTX range (Nsight Systems).

A range measures the *host* time spent inside it: for work the host only enqueues, the launch
cost, not the device time. Names follow the one scheme in ``overlap/profile/names.py`` (build
them with its helpers), which ``overlap-analyze`` reads back. ``OVERLAP_NVTX=0`` turns ranges
into no-ops, except those passed ``required=True`` (``step`` and ``comm_wait``).

The narrative: docs/design/profiling.md.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.autograd.profiler as _autograd_profiler

from overlap.profile import names

__all__ = ["range", "step", "enabled", "recording", "NO_RANGE"]

_ENABLED = os.environ.get("OVERLAP_NVTX", "1") != "0"
_CUDA: bool | None = None


def enabled() -> bool:
    return _ENABLED


def recording() -> bool:
    """Whether a range would record anything now (a torch.profiler runs, or CUDA's NVTX)."""
    return _autograd_profiler._is_profiler_enabled or _cuda()


def _cuda() -> bool:
    global _CUDA
    if _CUDA is None:
        _CUDA = torch.cuda.is_available()
    return _CUDA


_NULL = contextlib.nullcontext()
# What a hot path enters instead of ``range(...)`` when ``recording()`` is False, so that it does
# not even build the range's name: ``with nvtx.range(name) if trace else nvtx.NO_RANGE:``.
NO_RANGE = _NULL


def range(name: str, *, required: bool = False  # noqa: A001
          ) -> contextlib.AbstractContextManager[None]:
    """Mark the enclosed host code as ``name`` in torch.profiler traces and, on CUDA, in NVTX
    (the name mirrors torch.cuda.nvtx.range). When nothing would record it, a shared no-op
    context: ranges sit on every op's hot path."""
    if not (_ENABLED or required) or not recording():
        return _NULL
    return _recorded(name)


@contextlib.contextmanager
def _recorded(name: str) -> Iterator[None]:
    # record_function costs ~6 us even when no torch.profiler runs (it would record nowhere):
    # only when one does (a process-wide flag, so every thread's ranges are kept).
    traced = _autograd_profiler._is_profiler_enabled
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
