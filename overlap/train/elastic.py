"""Restart after a fault: re-launch every rank from the latest complete checkpoint.

``run(cfg)`` launches the job on local processes (``overlap.dist.launch``). When any rank dies
(a SIGKILL, a segfault) or raises (a collective that timed out on a dead peer), the launcher
tears every rank down: survivors get ``grace`` seconds to fail on their own, then are killed,
and every ``/dev/shm`` segment of the job is unlinked. Up to ``--max-restarts`` times, the job
then starts again as attempt k (``OVERLAP_RESTART_ATTEMPT=k`` in every rank), and each rank
resumes from ``latest_checkpoint(--save)`` (``overlap.train.loop._maybe_resume``): the newest
``step_<N>`` directory, which exists only once DCP finished writing it, so a checkpoint that
the fault interrupted is skipped. Under torchrun, ``--max-restarts`` is torchrun's own and
``TORCHELASTIC_RESTART_COUNT`` plays the same role.
"""

from __future__ import annotations

import os
import sys
import time

from overlap.dist.launch import LaunchError, RankOutcome
from overlap.train.config import TrainConfig

__all__ = ["run", "root_cause"]

_PRELOAD = ("overlap.train.loop", "overlap.tp", "overlap.pp", "overlap.dp",
            "torch.distributed.checkpoint")


def root_cause(exc: LaunchError) -> str:
    """The failing rank that caused the others to fail, with its error and the last frames of
    its traceback; the other ranks in one line."""
    order = {"died": 0, "error": 1, "hung": 2, "aborted": 3}
    failed = sorted((o for o in exc.outcomes if o.status != "ok"),
                    key=lambda o: (order[o.status], o.finished_at))
    if not failed:
        return str(exc)
    first: RankOutcome = failed[0]
    lines = [f"rank {first.rank} {first.status}: {first.error}"]
    if first.traceback:
        tb = [ln for ln in first.traceback.rstrip().splitlines() if ln.strip()]
        lines.append("\n".join(tb[-8:]))
    others = [f"{o.rank} ({o.status})" for o in failed[1:]]
    if others:
        lines.append(f"then ranks {', '.join(others)} failed or were stopped as a consequence")
    return "\n".join(lines)


def run(cfg: TrainConfig) -> list[dict]:
    """Every rank's result of the last (successful) attempt; raises LaunchError once the
    restarts are used up."""
    from overlap.dist.launch import launch
    from overlap.train.loop import train_rank

    attempt = 0
    while True:
        t0 = time.monotonic()
        try:
            # train_rank lives in an importable module: ranks unpickle it by reference.
            results = launch(train_rank, cfg.world_size, args=(cfg,), timeout=cfg.timeout,
                             backend=cfg.transport, preload=_PRELOAD,
                             env={"OVERLAP_RESTART_ATTEMPT": str(attempt)})
        except LaunchError as exc:
            if attempt >= cfg.max_restarts:
                raise
            attempt += 1
            from overlap.train.checkpoint import latest_checkpoint

            latest = latest_checkpoint(cfg.save) if cfg.save else None
            start = (f"from {os.path.basename(latest)}" if latest else
                     "from step 0 (no checkpoint was complete yet)")
            print(f"overlap-train: attempt {attempt} failed after "
                  f"{time.monotonic() - t0:.1f}s: {root_cause(exc).splitlines()[0]}\n"
                  f"overlap-train: every rank stopped; restart {attempt}/{cfg.max_restarts} "
                  f"{start}", file=sys.stderr, flush=True)
            continue
        for r in results:
            r["attempts"] = attempt + 1
        return results
