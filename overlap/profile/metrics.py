"""Exposed communication, defined once (``exposed``; docs/design/profiling.md), for every report.

From one rank's classified spans (``spans.RankTrace``), per step window, all unions of
intervals, so nested or concurrent rows never count twice:
    C compute   device mode (a CUDA trace): compute kernels and copies; host mode (the CPU
                twin): the training thread's compute ranges minus its comm ranges; both plus
                fused comm+GEMM rows minus their waits
    M comm      every communication row or range on any thread or stream, plus fused rows
    exposed = |M - C| (communication while the training thread or its stream computes
    nothing); hidden = |M & C|; overlap % = hidden / |M|; exposed % = exposed / step time;
    fused = time in fused TP ops (names.is_fused_op); per kind (names.AXES, else "other"):
    comm, hidden, and the exposed time, each exposed instant charged once (to the training
    thread's outermost comm range open then, else the earliest-started row): the kinds and
    the top-exposed list sum to the total. Steps: each ``step:<n>`` range of the training
    thread (none: the whole trace); a device row counts in the step whose range launched it.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from typing import Any

from overlap.profile import names
from overlap.profile import spans as sp
from overlap.profile.spans import Span

__all__ = ["StepMetrics", "ExposedRange", "RankReport", "exposed", "analyze_rank", "main_track",
           "lane_of", "summary", "exposed_intervals", "KIND_FIELDS"]

_US = 1e-6
KIND_FIELDS = ("comm_s", "hidden_s", "exposed_s")


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
    kind: str = names.OTHER


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
    # per kind (names.AXES, then "other"), seconds over all steps of KIND_FIELDS
    by_kind: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # where communication was exposed (the trace's time unit), for the timeline
    exposed_intervals: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "source": self.source, "format": self.fmt, "mode": self.mode,
                "main_track": self.main_track, "steps": [s.as_dict() for s in self.steps],
                "total": self.total.as_dict(),
                "top_exposed": [dataclasses.asdict(t) for t in self.top_exposed],
                "by_kind": self.by_kind}


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
    """(compute C, communication rows of M, fused comm+GEMM rows) of one window."""
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
    return c, comm + fused, fused


def _fused_time(spans: list[Span], fused: list[Span], main: str | None, device_mode: bool):
    """Time in fused TP ops: fused rows, plus (device) the rows launched from a fused op's
    piece or (host) the training thread's fused-op pieces."""
    iv = [(s.start, s.end) for s in fused]
    for s in spans:
        if device_mode and s.device and s.kind is not None and names.is_fused_op(s.label or ""):
            iv.append((s.start, s.end))
        elif not device_mode and not s.device and s.track == main and names.is_fused_op(s.name):
            iv.append((s.start, s.end))
    return sp.length(sp.merge(iv))


def _charge(exposed_iv: list[tuple[float, float]], rows: list[Span], main: str | None):
    """Charge each exposed instant to one row: the training thread's outermost comm range open
    then, else the earliest-started (then longest) row; returns {row index: time}."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].start)
    key = lambda i: (rows[i].track != main, rows[i].start, -rows[i].end,  # noqa: E731
                     rows[i].track, rows[i].name)
    cuts = sorted({t for r in rows for t in (r.start, r.end)}
                  | {t for iv in exposed_iv for t in iv})
    heap: list = []
    nxt, out = 0, {}
    for lo, hi in zip(cuts, cuts[1:]):
        while nxt < len(order) and rows[order[nxt]].start <= lo:
            heapq.heappush(heap, (key(order[nxt]), order[nxt]))
            nxt += 1
        while heap and rows[heap[0][1]].end <= lo:
            heapq.heappop(heap)
        if heap:
            e = sp.covered(lo, hi, exposed_iv)
            if e > 0:
                i = heap[0][1]
                out[i] = out.get(i, 0.0) + e
    return out


@dataclasses.dataclass(slots=True)
class _Window:
    metrics: StepMetrics
    by_kind: dict[str, dict[str, float]]
    charged: list[tuple[Span, float]]  # (row, exposed time charged to it), trace time unit
    exposed_iv: list[tuple[float, float]]


def exposed(step: int | None, spans: list[Span], lo: float, hi: float, main: str | None,
            device_mode: bool) -> _Window:
    """The exposed communication of one window [lo, hi) (``spans`` selected and clipped to
    it): the definition in this module's docstring, computed here and nowhere else."""
    c, rows, fused = _sets(spans, main, device_mode)
    m = sp.merge((s.start, s.end) for s in rows)
    exposed_iv = sp.subtract(m, c)
    comm, exp = sp.length(m), sp.length(exposed_iv)
    charged = _charge(exposed_iv, rows, main)
    by_kind: dict[str, dict[str, float]] = {}
    per_kind: dict[str, list[tuple[float, float]]] = {}
    for s in rows:
        per_kind.setdefault(s.axis or names.OTHER, []).append((s.start, s.end))
    for k, iv in per_kind.items():
        mk = sp.merge(iv)
        by_kind[k] = {"comm_s": sp.length(mk) * _US,
                      "hidden_s": sp.length(sp.intersect(mk, c)) * _US, "exposed_s": 0.0}
    for i, e in charged.items():
        by_kind[rows[i].axis or names.OTHER]["exposed_s"] += e * _US
    metrics = StepMetrics(step, (hi - lo) * _US, sp.length(c) * _US, comm * _US,
                          (comm - exp) * _US, exp * _US,
                          _fused_time(spans, fused, main, device_mode) * _US)
    return _Window(metrics, by_kind, [(rows[i], e) for i, e in charged.items()], exposed_iv)


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


def _kind_order(kinds) -> list[str]:
    return [k for k in names.AXES if k in kinds] + sorted(k for k in kinds if k not in names.AXES)


def analyze_rank(trace: sp.RankTrace, *, top: int = 5) -> RankReport:
    """Every window of one rank through ``exposed``, summed: what every report prints."""
    main = main_track(trace.spans)
    device_mode = any(s.device and s.kind is not None for s in trace.spans)
    steps, tops, kinds, intervals = [], {}, {}, []
    for step, lo, hi, spans in _windows(trace.spans, main):
        w = exposed(step, spans, lo, hi, main, device_mode)
        steps.append(w.metrics)
        intervals += w.exposed_iv
        for k, v in w.by_kind.items():
            cur = kinds.setdefault(k, dict.fromkeys(KIND_FIELDS, 0.0))
            for f in KIND_FIELDS:
                cur[f] += v[f]
        for s, e in w.charged:
            key = (s.label or s.name, s.name if s.label else None) if s.device else (s.name, None)
            cur = tops.setdefault(key, [0.0, 0, s.axis or names.OTHER])
            cur[0] += e
            cur[1] += 1
    total = StepMetrics(None, *(sum(getattr(m, f) for m in steps) for f in
                                ("step_s", "compute_s", "comm_s", "hidden_s", "exposed_s",
                                 "fused_s")))
    ranked = sorted(tops.items(), key=lambda kv: (-kv[1][0], kv[0][0]))[:top]
    return RankReport(trace.rank, trace.source, trace.fmt, "device" if device_mode else "host",
                      main, steps, total,
                      [ExposedRange(k[0], k[1], v[0] * _US, v[1], v[2]) for k, v in ranked],
                      {k: kinds[k] for k in _kind_order(kinds)}, sp.merge(intervals))


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
    """Where communication was exposed, over the step windows (the timeline's lane)."""
    return analyze_rank(trace, top=0).exposed_intervals
