"""A PNG timeline: one lane per rank, compute vs communication, from per-rank trace events."""

from __future__ import annotations

from pathlib import Path

from overlap.profile.trace import classify

__all__ = ["plot_timeline"]


def plot_timeline(events_per_rank: list[list[dict]], path: str | Path, *,
                  title: str = "overlap timeline") -> None:
    """Draw each rank's compute (training thread / GPU kernels) and communication (any thread
    or stream) intervals as two sub-lanes; time is relative to the earliest event."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
