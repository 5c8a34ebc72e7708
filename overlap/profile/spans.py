"""The analyzer's one data model: a rank's trace as classified spans, whatever file it came from.

Both readers (``kineto.py`` for torch.profiler JSON, ``nsys.py`` for ``nsys export --type
sqlite``) produce ``RankTrace`` objects, so the metrics (``metrics.py``) are computed by one
piece of code for both, and a test can check that the same timeline read from either file gives
the same numbers. Times are microseconds (the Chrome trace unit), as floats.

Also here: interval arithmetic on sorted, disjoint ``[start, end)`` lists, and the steps that
need the whole trace: deciding which device-to-device copies run on a communication stream
(``resolve_copies``), naming device rows after the range that launched them
(``label_device_spans``) and giving each row its axis (``resolve_axes``).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable

from overlap.profile import names

__all__ = ["Span", "RankTrace", "merge", "length", "intersect", "subtract", "resolve_copies",
           "label_device_spans", "resolve_axes", "finish"]

Interval = tuple[float, float]


@dataclasses.dataclass(slots=True)
class Span:
    """One classified row. ``kind`` is names.COMM/COMPUTE/FUSED/STEP or None (not counted);
    ``track`` is "thread <tid>" for host ranges and "stream <id>" for device rows; ``launch``
    is the host time and track of the call that launched a device row, when the trace links
    them (CUDA correlation ids); ``label`` is the project range that was open at that launch;
    ``copy`` is the copy kind ("PtoP", "DtoD", ...) of a memcpy row; ``axis`` is the axis
    (names.AXES) its own name or the range it is nested in names, else None."""
    start: float
    end: float
    name: str
    kind: str | None
    track: str
    device: bool = False
    wait: bool = False
    launch: float | None = None
    launch_track: str | None = None
    label: str | None = None
    copy: str | None = None
    peer: bool = False
    axis: str | None = None


@dataclasses.dataclass(slots=True)
class RankTrace:
    rank: int
    spans: list[Span]
    source: str
    fmt: str  # "kineto" | "nsys-sqlite"
    schema_version: str | None = None


def host_span(start: float, end: float, name: str, track: str) -> Span:
    kind = names.classify_range(name)
    return Span(start, end, name, kind.kind if kind else None, track,
                wait=bool(kind and kind.wait))


def kernel_span(start: float, end: float, name: str, track: str) -> Span:
    kind = names.classify_kernel(name)
    return Span(start, end, name, kind.kind, track, device=True, wait=kind.wait)


def copy_span(start: float, end: float, name: str, track: str, copy: str, peer: bool) -> Span:
    """A memcpy row; its kind is settled by resolve_copies once every stream is known."""
    return Span(start, end, name, None, track, device=True, copy=copy, peer=peer)


# -- interval arithmetic ------------------------------------------------------------------------

def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of possibly overlapping intervals (empty ones dropped)."""
    out: list[Interval] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def length(merged: Iterable[Interval]) -> float:
    return sum(e - s for s, e in merged)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two merged lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """``a`` minus ``b``, both merged."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def covered(s: float, e: float, merged: list[Interval]) -> float:
    """How much of [s, e) a merged list covers."""
    i = max(bisect.bisect_right(merged, (s, float("inf"))) - 1, 0)
    total = 0.0
    while i < len(merged) and merged[i][0] < e:
        total += max(0.0, min(e, merged[i][1]) - max(s, merged[i][0]))
        i += 1
    return total


# -- whole-trace passes -------------------------------------------------------------------------

def resolve_copies(spans: list[Span]) -> None:
    """Classify memcpy rows (names.classify_memcpy): a device-to-device copy is communication
    on a comm stream, i.e. one that runs a comm kernel or no compute kernel at all."""
    comm_streams, compute_streams = set(), set()
    for s in spans:
        if s.device and s.copy is None:
            (comm_streams if s.kind == names.COMM else compute_streams).add(s.track)
    for s in spans:
        if s.copy is not None:
            comm_stream = s.track in comm_streams or s.track not in compute_streams
            kind = names.classify_memcpy(s.copy, peer=s.peer, comm_stream=comm_stream)
            s.kind = kind.kind if kind else None


def label_device_spans(spans: list[Span]) -> None:
    """Set each launched device row's ``label`` to the innermost project range (names
    .is_project_range) open on the launching thread at the launch, so a kernel's exposed time
    can be reported under the chunk that issued it."""
    by_track: dict[str, list[Span]] = {}
    for s in spans:
        if not s.device and s.kind != names.STEP and names.is_project_range(s.name):
            by_track.setdefault(s.track, []).append(s)
    queries = sorted((s for s in spans if s.device and s.launch is not None
                      and s.launch_track in by_track), key=lambda s: s.launch)
    ranges = {t: sorted(v, key=lambda r: (r.start, -r.end)) for t, v in by_track.items()}
    nxt = {t: 0 for t in ranges}
    open_: dict[str, list[Span]] = {t: [] for t in ranges}
    for q in queries:
        t, when = q.launch_track, q.launch
        rs, stack = ranges[t], open_[t]
        while nxt[t] < len(rs) and rs[nxt[t]].start <= when:
            stack.append(rs[nxt[t]])
            nxt[t] += 1
        # Ranges on one thread nest, so the innermost open one is the latest started that is
        # still open; closed ones are dropped as time moves on.
        stack[:] = [r for r in stack if r.end >= when]
        if stack:
            q.label = max(stack, key=lambda r: (r.start, -r.end)).name


def resolve_axes(spans: list[Span]) -> None:
    """Set each row's ``axis``: a host range's own name's (names.axis_of), else that of the
    innermost range around it on its thread that names one, so a ``gloo:recv`` inside
    ``comm_wait:pp.p2p`` is pp; a device row's, from the range that launched it, else its
    own name."""
    by_track: dict[str, list[Span]] = {}
    for s in spans:
        if s.device:
            s.axis = names.axis_of(s.label or "") or names.axis_of(s.name)
        else:
            by_track.setdefault(s.track, []).append(s)
    for rows in by_track.values():
        stack: list[Span] = []
        for s in sorted(rows, key=lambda s: (s.start, -s.end)):
            while stack and stack[-1].end <= s.start:
                stack.pop()
            s.axis = names.axis_of(s.name) or (stack[-1].axis if stack else None)
            stack.append(s)


def finish(spans: list[Span]) -> list[Span]:
    """The whole-trace passes every reader runs once its rows are read."""
    resolve_copies(spans)
    label_device_spans(spans)
    resolve_axes(spans)
    return spans
