"""Overlap metrics of one rank, per step, from its classified spans (``spans.RankTrace``).

Definitions, all unions of intervals (nested or concurrent rows never count twice):
    mode        "device" if the trace has kernel or copy rows (CUDA), else "host" (the CPU twin)
    C compute   device: compute kernels and copies; host: the training thread's compute ranges
                minus its comm ranges; both plus fused comm+GEMM rows minus their waits
    M comm      every communication row or range on any thread or stream, plus fused rows
    hidden = |M ∩ C|    exposed = |M| - hidden    fused = |fused rows|
    overlap % = hidden / |M|    exposed % = exposed / step time

Steps: each ``step:<n>`` range of the training thread is a window (no step ranges: one window);
a device row counts in the step whose range launched it, else the step in which it starts.

The narrative: docs/design/profiling.md.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from overlap.profile import names
from overlap.profile import spans as sp
from overlap.profile.spans import Span

__all__ = ["StepMetrics", "ExposedRange", "RankReport", "analyze_rank", "main_track",
           "window_metrics", "lane_of", "summary", "exposed_intervals", "comm_group",
           "group_metrics"]

_US = 1e-6


@dataclasses.dataclass(slots=True)
class StepMetrics:
    step: int | None
    step_s: float
    compute_s: float
    comm_s: float
    hidden_s: float
    exposed_s: float
    fused_s: float

    @property
    def overlap_pct(self) -> float | None:
        return 100.0 * self.hidden_s / self.comm_s if self.comm_s > 0 else None

    @property
    def exposed_pct(self) -> float | None:
        return 100.0 * self.exposed_s / self.step_s if self.step_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["overlap_pct"], d["exposed_pct"] = self.overlap_pct, self.exposed_pct
        return d


@dataclasses.dataclass(slots=True)
class ExposedRange:
    range: str
    kernel: str | None
    exposed_s: float
    count: int


@dataclasses.dataclass(slots=True)
class RankReport:
    rank: int
    source: str
    fmt: str
    mode: str
    main_track: str | None
    steps: list[StepMetrics]
    total: StepMetrics
    top_exposed: list[ExposedRange]
    # communication by its name's first part (tp op, pp, dp, moe, cp, offload, ...): seconds
    # over all steps of {"comm_s", "hidden_s"}
    by_group: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "source": self.source, "format": self.fmt, "mode": self.mode,
                "main_track": self.main_track, "steps": [s.as_dict() for s in self.steps],
                "total": self.total.as_dict(),
                "top_exposed": [dataclasses.asdict(t) for t in self.top_exposed],
                "by_group": self.by_group}


def main_track(spans: list[Span]) -> str | None:
    """The training thread: the one with the most ``step:`` time, else the most host compute."""
    weight: dict[str, float] = {}
    for want in (names.STEP, names.COMPUTE):
        for s in spans:
            if not s.device and s.kind == want:
                weight[s.track] = weight.get(s.track, 0.0) + (s.end - s.start)
        if weight:
            return max(weight, key=weight.get)
    return None


def lane_of(s: Span, main: str | None, device_mode: bool) -> str | None:
    """The timeline lane of a span: compute, fused, comm (NCCL and its CPU twins), copy (the
    copy engine, or a copy thread on CPU), wait (signal waits, blocked host waits), or None.
    In a CUDA trace only device rows are drawn (host ranges there are launches)."""
    if device_mode and not s.device:
        return None
    if s.kind == names.FUSED:
        return "fused"
    if s.kind == names.COMPUTE:
        return "compute" if (s.device or s.track == main) else None
    if s.kind != names.COMM:
        return None
    if s.wait:
        return "wait"
    if s.device:
        return "copy" if s.copy is not None else "comm"
    if s.track == main or s.name.startswith(("gloo:", "nccl:", "c10d::", "record_param_comms")):
        return "comm"
    return "copy"  # a scheme comm range on a helper thread: the CPU twin's copy engine


def _sets(spans: list[Span], main: str | None, device_mode: bool):
    """(compute C, communication M, fused rows) as merged interval lists."""
    if device_mode:
        compute = [s for s in spans if s.device and s.kind == names.COMPUTE]
        comm = [s for s in spans if s.device and s.kind == names.COMM]
        fused = [s for s in spans if s.device and s.kind == names.FUSED]
        host_comm: list[Span] = []
    else:
        compute = [s for s in spans if not s.device and s.track == main and s.kind == names.COMPUTE]
        comm = [s for s in spans if not s.device and s.kind == names.COMM]
        fused = [s for s in spans if not s.device and s.track == main and s.kind == names.FUSED]
        host_comm = [s for s in comm if s.track == main]
    waits_by_track: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        if s.wait and s.device == device_mode:
            waits_by_track.setdefault(s.track, []).append((s.start, s.end))
    waits = {t: sp.merge(v) for t, v in waits_by_track.items()}
    fused_waits = sp.merge(iv for f in fused
                           for iv in sp.intersect([(f.start, f.end)], waits.get(f.track, [])))
    fused_iv = sp.merge((s.start, s.end) for s in fused)
    c = sp.subtract(sp.merge((s.start, s.end) for s in compute),
                    sp.merge((s.start, s.end) for s in host_comm))
    c = sp.merge(c + sp.subtract(fused_iv, fused_waits))
    m = sp.merge([(s.start, s.end) for s in comm] + fused_iv)
    return c, m, fused_iv


def window_metrics(step: int | None, spans: list[Span], lo: float, hi: float,
                   main: str | None, device_mode: bool) -> tuple[StepMetrics, list]:
    """Metrics of one window; ``spans`` already selected and clipped to it. Also returns the
    exposed time of each communication row, for the top-exposed list."""
    c, m, fused = _sets(spans, main, device_mode)
    comm = sp.length(m)
    hidden = sp.length(sp.intersect(m, c))
    exposed = max(comm - hidden, 0.0)
    parts = []
    for s in _outermost(s for s in spans if s.kind in (names.COMM, names.FUSED)
                        and s.device == device_mode):
        e = (s.end - s.start) - sp.covered(s.start, s.end, c)
        if e > 0:
            parts.append((s, e))
    return StepMetrics(step, (hi - lo) * _US, sp.length(c) * _US, comm * _US, hidden * _US,
                       exposed * _US, sp.length(fused) * _US), parts


def comm_group(name: str) -> str:
    """The first part of a communication range's name: ``offload.d2h.comm`` and
    ``comm_wait:offload.reload`` are "offload"; third-party rows are "other"."""
    for prefix in (names.COMM_WAIT_PREFIX, names.COMM_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix):].split(".")[0].split(":")[0] or "other"
    piece = names.parse(name)
    return piece.path.split(".")[0] if piece is not None else "other"


def group_metrics(spans: list[Span], main: str | None, device_mode: bool
                  ) -> dict[str, tuple[float, float]]:
    """Per ``comm_group``: (communication, hidden under compute) in the trace's time unit."""
    c, _m, _f = _sets(spans, main, device_mode)
    by: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        if s.kind == names.COMM and s.device == device_mode:
            by.setdefault(comm_group(s.label or s.name), []).append((s.start, s.end))
    out = {}
    for g, iv in by.items():
        m = sp.merge(iv)
        out[g] = (sp.length(m), sp.length(sp.intersect(m, c)))
    return out


def _outermost(spans) -> list[Span]:
    """Drop host ranges nested in another on the same thread (the outer one names the op)."""
    out, last_end = [], {}
    for s in sorted(spans, key=lambda s: (s.track, s.start, -s.end)):
        if not s.device and s.end <= last_end.get(s.track, float("-inf")):
            continue
        last_end[s.track] = max(s.end, last_end.get(s.track, float("-inf")))
        out.append(s)
    return out


def _clip(s: Span, lo: float, hi: float) -> Span | None:
    if s.end <= lo or s.start >= hi:
        return None
    if lo <= s.start and s.end <= hi:
        return s
    return dataclasses.replace(s, start=max(s.start, lo), end=min(s.end, hi))


def _windows(spans: list[Span], main: str | None):
    """(step, lo, hi, spans of the window) for each step range of the training thread."""
    steps = sorted((s for s in spans if s.kind == names.STEP and s.track == main),
                   key=lambda s: s.start)
    if any(s.name.startswith(names.STEP_PREFIX) for s in steps):  # ours over ProfilerStep#
        steps = [s for s in steps if s.name.startswith(names.STEP_PREFIX)]
    if not steps:
        lo = min((s.start for s in spans), default=0.0)
        hi = max((s.end for s in spans), default=0.0)
        yield None, lo, hi, spans
        return
    # Sorted keys and bisect, so a long trace costs O(rows log rows), not O(steps x rows).
    launched = sorted((s for s in spans if s.device and s.launch is not None),
                      key=lambda s: s.launch)
    unlaunched = sorted((s for s in spans if s.device and s.launch is None),
                        key=lambda s: s.start)
    host = sorted((s for s in spans if not s.device), key=lambda s: s.start)
    keys = ([s.launch for s in launched], [s.start for s in unlaunched], [s.start for s in host])
    longest = max((s.end - s.start for s in host), default=0.0)
    for i, st in enumerate(steps):
        nxt = steps[i + 1].start if i + 1 < len(steps) else float("inf")
        mine = (launched[bisect.bisect_left(keys[0], st.start):
                         bisect.bisect_right(keys[0], st.end)]
                + unlaunched[bisect.bisect_left(keys[1], st.start):
                             bisect.bisect_left(keys[1], nxt)])
        hi = max([st.end] + [d.end for d in mine])
        near = host[bisect.bisect_left(keys[2], st.start - longest):
                    bisect.bisect_left(keys[2], st.end)]
        clipped = [c for c in (_clip(h, st.start, st.end) for h in near) if c is not None]
        yield names.step_number(st.name), st.start, hi, clipped + mine


def analyze_rank(trace: sp.RankTrace, *, top: int = 5) -> RankReport:
    main = main_track(trace.spans)
    device_mode = any(s.device and s.kind is not None for s in trace.spans)
    steps, exposed, groups = [], {}, {}
    for step, lo, hi, spans in _windows(trace.spans, main):
        metrics, parts = window_metrics(step, spans, lo, hi, main, device_mode)
        steps.append(metrics)
        for g, (comm, hidden) in group_metrics(spans, main, device_mode).items():
            cur = groups.setdefault(g, {"comm_s": 0.0, "hidden_s": 0.0})
            cur["comm_s"] += comm * _US
            cur["hidden_s"] += hidden * _US
        for s, e in parts:
            key = (s.label or s.name, s.name if s.label else None) if s.device else (s.name, None)
            cur = exposed.setdefault(key, [0.0, 0])
            cur[0] += e
            cur[1] += 1
    total = StepMetrics(None, *(sum(getattr(m, f) for m in steps) for f in
                                ("step_s", "compute_s", "comm_s", "hidden_s", "exposed_s",
                                 "fused_s")))
    ranked = sorted(exposed.items(), key=lambda kv: (-kv[1][0], kv[0][0]))[:top]
    return RankReport(trace.rank, trace.source, trace.fmt, "device" if device_mode else "host",
                      main, steps, total,
                      [ExposedRange(k[0], k[1], v[0] * _US, v[1]) for k, v in ranked],
                      dict(sorted(groups.items())))


def summary(reports: list[RankReport]) -> dict[str, float | None]:
    """Per-step means over every (rank, step) window: the one line ``--compare`` shows."""
    rows = [s for r in reports for s in r.steps]
    if not rows:
        return {}
    out: dict[str, float | None] = {}
    for f in ("step_s", "compute_s", "comm_s", "hidden_s", "exposed_s", "fused_s"):
        out[f] = sum(getattr(s, f) for s in rows) / len(rows)
    comm, step = sum(s.comm_s for s in rows), sum(s.step_s for s in rows)
    out["overlap_pct"] = 100.0 * sum(s.hidden_s for s in rows) / comm if comm else None
    out["exposed_pct"] = 100.0 * sum(s.exposed_s for s in rows) / step if step else None
    out["num_windows"] = len(rows)
    return out


def exposed_intervals(trace: sp.RankTrace) -> list[tuple[float, float]]:
    """Where communication ran with no compute under it, over the whole trace (the timeline's
    "exposed comm" lane; per-step numbers come from analyze_rank)."""
    main = main_track(trace.spans)
    device_mode = any(s.device and s.kind is not None for s in trace.spans)
    c, m, _ = _sets(trace.spans, main, device_mode)
    return sp.subtract(m, c)
