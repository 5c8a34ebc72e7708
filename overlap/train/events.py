"""The job's event log: one JSON line per event (a step, a resume, a restart, a shrink or a grow)
appended to ``--log-json``. Its own module, below the training loop and the restart logic
(``overlap.train.elastic``), which both write to it.
"""

from __future__ import annotations

import json
import time

from overlap.train.config import TrainConfig

__all__ = ["log_event"]


def log_event(cfg: TrainConfig, event: str, **fields) -> None:
    """Append one JSON line to ``--log-json`` (one write: lines of other processes interleave
    whole)."""
    if not cfg.log_json:
        return
    line = json.dumps({"event": event, "time": round(time.time(), 3), **fields})
    with open(cfg.log_json, "a") as f:
        f.write(line + "\n")
