"""Where a test run's time and twin work go, for CI (``OVERLAP_LAUNCH_STATS=<file>``).

When the variable names a file, ``overlap.dist.launch`` appends one JSON line per launch (its
test, from ``PYTEST_CURRENT_TEST``) and per rank (entered, ready, done), and the first stream
twin or ``nccl_twin`` work item of each process and launch appends a ``twin`` line: the point
where ``OVERLAP_STREAM_DELAY_MS`` injects its delays. ``tools/launch_stats.py`` splits launch
time into start-up and bodies; ``tools/ci_passes.py`` finds the test files whose work met that
point (the files CI's stream-delay pass must run). Lines are short single writes in append
mode, so concurrent processes do not interleave them. Off (no file): one attribute test per
twin work item.
"""

from __future__ import annotations

import json
import os

__all__ = ["enabled", "write", "read", "note_twin_op"]

_noted: set[tuple[str, str]] = set()


def enabled() -> bool:
    return bool(os.environ.get("OVERLAP_LAUNCH_STATS"))


def write(**row) -> None:
    """Append ``row`` (plus this process's launch id) as one JSON line; a no-op when off."""
    path = os.environ.get("OVERLAP_LAUNCH_STATS")
    if path:
        row.setdefault("launch", os.environ.get("OVERLAP_LAUNCH_ID", ""))
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def read(path: str) -> list[dict]:
    """Every row of a statistics file (a line cut short by a killed process is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def note_twin_op() -> None:
    """Record that twin work ran here: once per launch (in a rank) or per test (elsewhere)."""
    launch = os.environ.get("OVERLAP_LAUNCH_ID", "")
    # In a rank the launch names the test (a fork server's PYTEST_CURRENT_TEST is stale).
    test = "" if launch else os.environ.get("PYTEST_CURRENT_TEST", "")
    if (launch, test) not in _noted:
        _noted.add((launch, test))
        write(kind="twin", test=test, pid=os.getpid())
