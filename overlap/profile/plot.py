"""PNG timelines.

- ``plot_timeline``: one lane per rank, compute vs communication, from per-rank Chrome events
  (what ``python -m overlap.train --profile`` draws);
- ``plot_lanes``: what ``overlap-analyze --png`` draws: per rank one lane per kind of stream,
  compute (fused comm+GEMM rows in their own colour), NCCL and other comm kernels (gloo or the
  collective's thread on CPU), the copy engine (the copy thread on CPU), signal waits (and
  blocked host waits), and the exposed communication ``metrics.exposed`` counts, each rank
  labelled with its exposed % of the step (the analyzer's headline).
"""

from __future__ import annotations

from pathlib import Path

from overlap.profile import spans as sp
from overlap.profile.metrics import analyze_rank, lane_of
from overlap.profile.trace import classify

__all__ = ["plot_timeline", "plot_lanes"]

_LANES = (("compute", "compute", "#4C72B0"), ("comm", "NCCL / comm", "#DD8452"),
          ("copy", "copy engine", "#55A868"), ("wait", "waits (signal, host)", "#C44E52"),
          ("exposed", "exposed comm", "#8C1C13"))
_FUSED = "#8172B3"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(events_per_rank: list[list[dict]], path: str | Path, *,
                  title: str = "overlap timeline") -> None:
    """Draw each rank's compute (training thread / GPU kernels) and communication (any thread
    or stream) intervals as two sub-lanes; time is relative to the earliest event."""
    plt = _pyplot()
    t0 = min((e["ts"] for evs in events_per_rank for e in evs), default=0.0)
    n = len(events_per_rank)
    fig, ax = plt.subplots(figsize=(12, 0.9 * n + 1.2))
    colors = {"compute": "#4C72B0", "comm": "#DD8452"}
    for rank, evs in enumerate(events_per_rank):
        lanes = {"compute": [], "comm": []}
        for e in evs:
            kind = classify(str(e.get("name", "")))
            if kind is not None:
                lanes[kind].append(((e["ts"] - t0) / 1e3, e["dur"] / 1e3))
        y = n - 1 - rank
        ax.broken_barh(lanes["compute"], (y + 0.05, 0.4), facecolors=colors["compute"])
        ax.broken_barh(lanes["comm"], (y + 0.5, 0.4), facecolors=colors["comm"])
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
              labels=["compute (lower half)", "communication (upper half)"], loc="upper right",
              fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def plot_lanes(traces: list[tuple[str, sp.RankTrace]], path: str | Path, *,
               title: str = "overlap-analyze") -> None:
    """One block of lanes per (label, trace); each block's time starts at its first row, so
    traces from different runs (``--compare``) line up at zero."""
    plt = _pyplot()
    n_lanes = len(_LANES)
    fig, ax = plt.subplots(figsize=(13, 0.32 * n_lanes * len(traces) + 1.4))
    ticks, labels = [], []
    for block, (label, trace) in enumerate(traces):
        report = analyze_rank(trace, top=0)
        main, device_mode = report.main_track, report.mode == "device"
        pct = report.total.exposed_pct
        exposed_name = f"exposed comm, {'-' if pct is None else f'{pct:.1f}'}% of the step"
        t0 = min((s.start for s in trace.spans), default=0.0)
        lanes: dict[str, list[tuple[float, float]]] = {k: [] for k, _, _ in _LANES}
        fused: list[tuple[float, float]] = []
        for s in trace.spans:
            lane = lane_of(s, main, device_mode)
            if lane == "fused":
                fused.append((s.start, s.end))
            elif lane is not None:
                lanes[lane].append((s.start, s.end))
        lanes["exposed"] = report.exposed_intervals
        base = (len(traces) - 1 - block) * (n_lanes + 1)
        for i, (key, name, color) in enumerate(_LANES):
            y = base + n_lanes - 1 - i
            bars = [((s - t0) / 1e3, (e - s) / 1e3) for s, e in sp.merge(lanes[key])]
            ax.broken_barh(bars, (y + 0.1, 0.8), facecolors=color)
            if key == "compute":
                ax.broken_barh([((s - t0) / 1e3, (e - s) / 1e3) for s, e in sp.merge(fused)],
                               (y + 0.1, 0.8), facecolors=_FUSED)
            ticks.append(y + 0.5)
            labels.append(f"{label}  {exposed_name if key == 'exposed' else name}")
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=_FUSED)],
              labels=["fused comm+GEMM (counts as compute)"], loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
