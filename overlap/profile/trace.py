"""Overlap metrics from a profiler trace: how much communication ran, and how much of it the
training thread actually waited for.

Input: a Chrome-trace JSON as written by ``torch.profiler.profile.export_chrome_trace`` (CPU
here; with CUDA activities on GPUs), or the same event list built from ``nsys export --type
sqlite`` (``events_from_nsys_sqlite``). Every complete event (``"ph": "X"``) is classified by
name:

- communication: ``comm:*`` / ``comm_wait:*`` ranges (overlap's NVTX/record_function names),
  ``gloo:*`` (gloo's worker-thread events, which carry the real transfer time), ``nccl*``
  kernels, ``c10d::*`` collective launches, ``record_param_comms``;
- compute: ``compute:*`` / ``gemm*`` ranges and ``aten::*`` ops, GPU kernels that are not NCCL.

Metrics per trace (one rank), over the span of the ``step:*`` ranges (or the whole trace):

- ``compute_s``: the union of compute intervals of the *training thread* (the thread that owns
  the ``step:*`` ranges, else the one with the most ``aten::`` time) and of non-NCCL GPU
  kernels. Copies a copier thread makes for communication are not compute;
- ``comm_s``: the union of all communication intervals on any thread or stream;
- ``exposed_comm_s``: communication time not covered by compute (comm minus its overlap with compute): on CPU
  the time the training thread waits while gloo (or a copier) moves bytes; on GPU the NCCL or
  copy time no compute kernel runs under;
- ``hidden_comm_s = comm_s - exposed_comm_s``, ``exposed_fraction = exposed_comm_s / step_s``
  and ``hidden_fraction = hidden_comm_s / comm_s``.

``exposed_comm_s <= comm_s`` holds by construction, and both fractions lie in [0, 1].
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable

__all__ = ["OverlapMetrics", "load_events", "classify", "overlap_metrics", "union_length"]

_COMM_PREFIXES = ("comm:", "comm_wait:", "gloo:", "nccl", "c10d::", "record_param_comms",
                  "ncclDevKernel", "ncclKernel")
_COMPUTE_PREFIXES = ("compute:", "gemm", "aten::", "triton", "overlap_")


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
    """'comm', 'compute' or None (bookkeeping events such as step ranges)."""
    low = name.lower()
    if name.startswith(_COMM_PREFIXES) or "nccl" in low:
        return "comm"
    if name.startswith(("step:", "PyTorch Profiler", "ProfilerStep")):
        return None
    if name.startswith(_COMPUTE_PREFIXES) or "gemm" in low or "kernel" in low:
        return "compute"
    return None


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _clip(iv: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in iv if e > lo and s < hi]


def overlap_metrics(events: list[dict]) -> OverlapMetrics:
    """Metrics for one rank's events (timestamps in microseconds, as in Chrome traces)."""
    steps = [e for e in events if str(e.get("name", "")).startswith("step:")]
    if steps:
        lo = min(e["ts"] for e in steps)
        hi = max(e["ts"] + e["dur"] for e in steps)
        main_tid = max({e["tid"] for e in steps},
                       key=lambda t: sum(e["dur"] for e in steps if e["tid"] == t))
    else:
        lo = min((e["ts"] for e in events), default=0.0)
        hi = max((e["ts"] + e["dur"] for e in events), default=0.0)
        aten: dict[Any, float] = {}
        for e in events:
            if str(e.get("name", "")).startswith("aten::"):
                aten[e["tid"]] = aten.get(e["tid"], 0.0) + e["dur"]
        main_tid = max(aten, key=aten.get) if aten else None
    comm, compute = [], []
    for e in events:
        kind = classify(str(e.get("name", "")))
        iv = (float(e["ts"]), float(e["ts"] + e["dur"]))
        if kind == "comm":
            comm.append(iv)
        elif kind == "compute" and (e.get("tid") == main_tid or _is_gpu_kernel(e)):
            compute.append(iv)
    comm, compute = _clip(comm, lo, hi), _clip(compute, lo, hi)
    step = max(hi - lo, 0.0)
    comm_len, comp_len = union_length(comm), union_length(compute)
    both = comm_len + comp_len - union_length(comm + compute)  # |comm ∩ compute|
    exposed = min(max(comm_len - both, 0.0), comm_len)
    hidden = comm_len - exposed
    us = 1e-6
    return OverlapMetrics(
        step_s=step * us, compute_s=comp_len * us, comm_s=comm_len * us,
        exposed_comm_s=exposed * us, hidden_comm_s=hidden * us,
        exposed_fraction=min(exposed / step, 1.0) if step else 0.0,
        hidden_fraction=hidden / comm_len if comm_len else 0.0, main_tid=main_tid)


def _is_gpu_kernel(e: dict) -> bool:
    return e.get("cat") == "kernel" or str(e.get("tid", "")).startswith("stream")


def events_from_nsys_sqlite(path: str | Path) -> list[dict]:
    """Chrome-style events from ``nsys export --type sqlite``: NVTX ranges (NVTX_EVENTS) and
    CUDA kernels (CUPTI_ACTIVITY_KIND_KERNEL), timestamps converted from ns to us. Kernels get
    the stream as ``tid``; NVTX ranges the OS thread."""
    import sqlite3

    con = sqlite3.connect(str(path))
    try:
        out: list[dict] = []
        cur = con.execute("SELECT start, end, text, globalTid FROM NVTX_EVENTS "
                          "WHERE end IS NOT NULL AND text IS NOT NULL")
        out += [{"ph": "X", "ts": s / 1e3, "dur": (e - s) / 1e3, "name": t, "tid": tid}
                for s, e, t, tid in cur]
        cur = con.execute("SELECT k.start, k.end, s.value, k.streamId FROM "
                          "CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON k.shortName = s.id")
        out += [{"ph": "X", "ts": s / 1e3, "dur": (e - s) / 1e3, "name": n,
                 "tid": f"stream{sid}"} for s, e, n, sid in cur]
        return out
    finally:
        con.close()
