"""Overlap metrics of one trace as a whole (``overlap-train --profile``'s table and its
``overlap_metrics.json``): the sums over the step windows of ``metrics.analyze_rank``, the one
definition ``overlap-analyze`` reports per step, so both print the same numbers.

Input: a Chrome-trace JSON (``torch.profiler.profile.export_chrome_trace``), or the same event
list built from ``nsys export --type sqlite`` (``events_from_nsys_sqlite``).

    step_s          the step windows' total (the whole trace without step ranges)
    comm_s, compute_s, exposed_comm_s, hidden_comm_s = comm_s - exposed_comm_s   (metrics.py)
    exposed_fraction = exposed_comm_s / step_s, hidden_fraction = hidden_comm_s / comm_s
    by_kind         per kind (tp, pp, dp, ep, cp, offload, other): comm_s, hidden_s, exposed_s

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
from overlap.profile.metrics import analyze_rank
from overlap.profile.spans import RankTrace

__all__ = ["OverlapMetrics", "load_events", "classify", "overlap_metrics", "exposed_percent",
           "union_length", "events_from_nsys_sqlite"]


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
    fused_s: float = 0.0
    by_kind: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

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
    report = analyze_rank(RankTrace(0, spans_from_events(events), "events", "kineto"), top=0)
    tids = {f"thread {e.get('tid')}": e.get("tid") for e in events}
    t = report.total
    return OverlapMetrics(
        step_s=t.step_s, compute_s=t.compute_s, comm_s=t.comm_s, exposed_comm_s=t.exposed_s,
        hidden_comm_s=t.hidden_s, exposed_fraction=t.exposed_s / t.step_s if t.step_s else 0.0,
        hidden_fraction=t.hidden_s / t.comm_s if t.comm_s else 0.0,
        main_tid=tids.get(report.main_track), fused_s=t.fused_s, by_kind=report.by_kind)


def exposed_percent(ranks: list[OverlapMetrics]) -> float | None:
    """The headline over ranks, as ``overlap-analyze`` prints it: 100 * total exposed / total
    step time (every rank's step windows), None without steps."""
    step = sum(m.step_s for m in ranks)
    return 100.0 * sum(m.exposed_comm_s for m in ranks) / step if step > 0 else None


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
