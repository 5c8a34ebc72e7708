"""Overlap metrics of one trace as a whole: how much communication ran, and how much of it the
rank's compute hid (``overlap-analyze``, ``overlap/profile/analyze.py``, reports them per step).

Input: a Chrome-trace JSON (``torch.profiler.profile.export_chrome_trace``), or the same event
list built from ``nsys export --type sqlite`` (``events_from_nsys_sqlite``); events are
classified by ``overlap/profile/names.py`` and ``overlap/kernels/registry.py``. Over the span
of the ``step:*`` ranges (or the whole trace):

    compute_s       training thread's compute minus its comm ranges (CUDA: compute kernels)
    comm_s          the union of all communication intervals on any thread or stream
    exposed_comm_s  communication not covered by compute; hidden_comm_s = comm_s - exposed_comm_s
    exposed_fraction = exposed_comm_s / step_s, hidden_fraction = hidden_comm_s / comm_s

``exposed_comm_s <= comm_s`` holds by construction, and both fractions lie in [0, 1].
The narrative: docs/design/profiling.md.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable

from overlap.kernels import registry
from overlap.profile import names
from overlap.profile import spans as sp
from overlap.profile.kineto import spans_from_events
from overlap.profile.metrics import main_track, window_metrics

__all__ = ["OverlapMetrics", "load_events", "classify", "overlap_metrics", "union_length",
           "events_from_nsys_sqlite"]


@dataclasses.dataclass(slots=True)
class OverlapMetrics:
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    hidden_comm_s: float
    exposed_fraction: float
    hidden_fraction: float
    main_tid: Any

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_events(path: str | Path) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def classify(name: str) -> str | None:
    """'comm', 'compute' or None (bookkeeping events such as step ranges), from the name alone:
    host ranges by the naming scheme, kernels by the registry and NCCL's names."""
    kind = names.classify_range(name)
    if kind is None and (registry.lookup(name) is not None or names.is_nccl_kernel(name)):
        kind = names.classify_kernel(name)
    if kind is not None:
        if kind.kind == names.STEP:
            return None
        return names.COMPUTE if kind.kind == names.FUSED else kind.kind
    low = name.lower()
    if name.startswith("PyTorch Profiler"):
        return None
    if name.startswith("triton") or "gemm" in low or "kernel" in low:
        return "compute"  # a GPU kernel that is not NCCL's and not overlap's own
    return None


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end) intervals."""
    return sp.length(sp.merge(intervals))


def overlap_metrics(events: list[dict]) -> OverlapMetrics:
    """Metrics for one rank's events (timestamps in microseconds, as in Chrome traces)."""
    spans = spans_from_events(events)
    main = main_track(spans)
    tids = {f"thread {e.get('tid')}": e.get("tid") for e in events}
    steps = [s for s in spans if s.kind == names.STEP and s.track == main]
    pool = steps or spans
    lo = min((s.start for s in pool), default=0.0)
    hi = max((s.end for s in pool), default=0.0)
    clipped = [c for c in (_clip(s, lo, hi) for s in spans) if c is not None]
    device_mode = any(s.device and s.kind is not None for s in spans)
    m, _ = window_metrics(None, clipped, lo, hi, main, device_mode)
    step, exposed = m.step_s, min(m.exposed_s, m.comm_s)
    return OverlapMetrics(
        step_s=step, compute_s=m.compute_s, comm_s=m.comm_s, exposed_comm_s=exposed,
        hidden_comm_s=m.comm_s - exposed,
        exposed_fraction=min(exposed / step, 1.0) if step else 0.0,
        hidden_fraction=(m.comm_s - exposed) / m.comm_s if m.comm_s else 0.0,
        main_tid=tids.get(main))


def _clip(s: sp.Span, lo: float, hi: float) -> sp.Span | None:
    if s.end <= lo or s.start >= hi:
        return None
    return dataclasses.replace(s, start=max(s.start, lo), end=min(s.end, hi))


def events_from_nsys_sqlite(path: str | Path) -> list[dict]:
    """Chrome-style events from ``nsys export --type sqlite`` (every process): NVTX ranges on
    their OS thread, CUDA kernels and copies with the stream as ``tid``; timestamps in us.
    The schema handling is ``overlap.profile.nsys``."""
    from overlap.profile.nsys import read_nsys_sqlite

    out: list[dict] = []
    for trace in read_nsys_sqlite(path):
        for s in trace.spans:
            ev = {"ph": "X", "ts": s.start, "dur": s.end - s.start, "name": s.name,
                  "pid": trace.rank}
            if s.device:
                device, _, stream = s.track.split(" ", 1)[1].partition(":")
                ev.update(tid=f"stream{stream}", args={"device": device, "stream": stream},
                          cat="gpu_memcpy" if s.copy is not None else "kernel")
            else:
                ev.update(tid=int(s.track.split(" ", 1)[1]), cat="user_annotation")
            out.append(ev)
    return out
