"""Restart after a fault, on the same layout or on the surviving nodes.

``run(cfg)`` launches the job on local processes (``overlap.dist.launch``). When any rank dies
or raises, the launcher tears every rank down (survivors get ``grace`` seconds, then SIGKILL;
every ``/dev/shm`` segment of the job is unlinked), so no communicator of the old layout
survives. Up to ``--max-restarts`` times it starts again as attempt k
(``OVERLAP_RESTART_ATTEMPT=k``), each rank resuming from ``latest_checkpoint(--save)``: the
newest complete ``step_<N>``. With ``--min-nodes``, the node of a rank that died is presumed
lost (``shrink.nodes_down``) and, while enough remain, the next attempt runs on the survivors
with ``shrink.choose_layout``'s layout (resharded resume); with ``--grow-back`` a watcher asks
the shrunk job to stop at a checkpoint once the nodes return, and the full layout resumes from
it. Each event goes to the output and ``--log-json``. Under torchrun, torchrun restarts the
workers (``TORCHELASTIC_RESTART_COUNT``).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

from overlap.dist.launch import LaunchError, RankOutcome, launch
from overlap.train.config import ConfigError, TrainConfig
from overlap.train.events import log_event
from overlap.train.loop import train_rank
from overlap.train.shrink import (choose_layout, layout_dict, layout_name, mark_node_down,
                                  nodes_down)

__all__ = ["run", "root_cause"]

# Imported once by the fork server, not by every rank (local launches are CPU processes):
# torch's optimizers import torch._dynamo on their first construction, 1.5-2 s of CPU per rank
# and most of a small job's start-up.
_PRELOAD = ("overlap.train.loop", "overlap.tp", "overlap.pp", "overlap.dp", "overlap.nn",
            "overlap.moe", "overlap.cp", "torch._dynamo")
# Only for a job that saves or resumes: torch.distributed.checkpoint (DTensor with it) is 0.6 s
# of CPU to import, wasted on every job that does neither.
_PRELOAD_CHECKPOINT = ("overlap.train.checkpoint", "torch.distributed.checkpoint")


def preload_for(cfg: TrainConfig) -> tuple[str, ...]:
    """What the fork server imports once for this job's ranks."""
    return _PRELOAD + (_PRELOAD_CHECKPOINT if cfg.save or cfg.resume else ())


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


def _say(msg: str) -> None:
    print(f"overlap-train: {msg}", file=sys.stderr, flush=True)


class _GrowWatch:
    """After a shrink with --grow-back: watch the emulated nodes; when one returns, ask the
    ranks to stop at a checkpoint (a file rank 0 looks for every step)."""

    def __init__(self, cfg: TrainConfig, down: int, path: str):
        self.cfg, self.down, self.path = cfg, down, path
        self._stop = threading.Event()
        self.requested_at: float | None = None
        self._thread = threading.Thread(target=self._watch, name="overlap-grow-watch",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            if nodes_down(self.cfg.save) < self.down:
                self.requested_at = time.time()
                with open(self.path, "w") as f:
                    f.write(repr(self.requested_at))
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if os.path.exists(self.path):
            os.unlink(self.path)


def _mark_lost_nodes(cur: TrainConfig, exc: LaunchError, attempt: int) -> None:
    """With --min-nodes, the node of every rank that died (exited without a result: SIGKILL,
    a crash, the OOM killer) is presumed lost until its marker is removed."""
    for node in sorted({o.rank // cur.node_size for o in exc.outcomes if o.status == "died"}):
        mark_node_down(cur.save, f"a{attempt}_n{node}")


def _next_layout(full: TrainConfig) -> tuple[TrainConfig, int, str]:
    """The configuration of the next attempt after a fault: the full layout when every node
    is up, a planner-chosen one on the survivors when --min-nodes allows, else SystemExit.
    Returns (config, nodes down, why)."""
    rpn = full.node_size
    nodes = full.world_size // rpn
    down = nodes_down(full.save)
    if not down:
        return full, 0, "every node is up"
    alive = nodes - down
    if not full.min_nodes or alive < full.min_nodes:
        raise SystemExit(f"overlap-train: error: {down} of {nodes} nodes ({rpn} ranks each) "
                         f"are down and {alive} remain, fewer than --min-nodes "
                         f"{full.min_nodes or nodes} (0: never shrink); the job stops")
    try:
        choice = choose_layout(full, alive * rpn, ranks_per_node=rpn)
    except ConfigError as exc:
        raise SystemExit(f"overlap-train: error: {down} of {nodes} nodes are down: {exc}") \
            from None
    why = (f"{down} of {nodes} nodes down; the planner ranked {choice.ranked} layouts of the "
           f"{alive * rpn} surviving ranks ({full.plan_profile}: "
           f"{choice.step_time_s * 1e3:.3g} ms per step)"
           + ("" if choice.batch_kept else "; " + "; ".join(choice.changes)))
    return choice.cfg, down, why


def run(cfg: TrainConfig) -> list[dict]:
    """Every rank's result of the last (successful) attempt; raises LaunchError once the
    restarts are used up. ``results[0]["events"]`` lists the faults and layout changes, and
    ``results[0]["final_cfg"]`` is the configuration the job finished on."""
    from overlap.train.checkpoint import latest_checkpoint  # 0.4 s: not at import

    full, cur = cfg, cfg
    if cfg.save:  # what an earlier job under this directory left: its faults are not ours
        shutil.rmtree(os.path.join(cfg.save, ".nodes"), ignore_errors=True)
        for name in ("fault_time", ".grow_request"):
            if os.path.exists(os.path.join(cfg.save, name)):
                os.unlink(os.path.join(cfg.save, name))
    launches = failures = 0
    down = 0
    events: list[dict] = []
    while True:
        t0 = time.monotonic()
        grow = None
        env = {"OVERLAP_RESTART_ATTEMPT": str(launches)}
        if cur is not full and full.grow_back:
            grow = _GrowWatch(full, down, os.path.join(full.save, ".grow_request"))
            env["OVERLAP_GROW_REQUEST"] = grow.path
        if launches == 0:
            print(f"overlap-train: starting {cur.world_size} local ranks, {layout_name(cur)}, "
                  f"on {cur.transport}", flush=True)
        try:
            # train_rank lives in an importable module: ranks unpickle it by reference.
            results = launch(train_rank, cur.world_size, args=(cur,), timeout=cur.timeout,
                             backend=cur.transport, preload=preload_for(cfg), env=env,
                             ranks_per_gpu=cur.ranks_per_gpu or None)
        except LaunchError as exc:
            if failures >= cfg.max_restarts:
                raise
            failures += 1
            launches += 1
            cause = root_cause(exc).splitlines()[0]
            _say(f"attempt {launches} failed after {time.monotonic() - t0:.1f}s: {cause}")
            if full.min_nodes:
                _mark_lost_nodes(cur, exc, launches)
            nxt, down, why = _next_layout(full)
            latest = latest_checkpoint(cfg.save) if cfg.save else None
            start = (f"from {os.path.basename(latest)}" if latest else
                     "from step 0 (no checkpoint was complete yet)")
            kind = "restart" if nxt.world_size == cur.world_size else (
                "shrink" if nxt.world_size < cur.world_size else "grow")
            _say(f"every rank stopped; {kind} {failures}/{cfg.max_restarts} {start}"
                 + (f" on {layout_name(nxt)} instead of {layout_name(cur)}: {why}"
                    if nxt is not cur else ""))
            events.append({"kind": kind, "attempt": launches + 1, "cause": cause,
                           "old_layout": layout_dict(cur),
                           "new_layout": layout_dict(nxt), "nodes_down": down,
                           "checkpoint": latest, "why": why})
            log_event(cfg, kind, **{k: v for k, v in events[-1].items() if k != "kind"})
            cur = nxt
            continue
        finally:
            if grow is not None:
                grow.close()
        if events and results[0].get("start_step") is not None:
            events[-1].update(resumed_step=results[0]["start_step"],
                              fault_to_resumed_s=results[0].get("fault_to_resumed_s"))
        if any(r.get("stopped_to_grow") for r in results):
            launches += 1
            latest = latest_checkpoint(cfg.save)
            _say(f"{down} lost node(s) returned: stopped at {os.path.basename(latest)}; "
                 f"grow from {layout_name(cur)} back to {layout_name(full)}")
            events.append({"kind": "grow", "attempt": launches + 1, "cause": "nodes returned",
                           "old_layout": layout_dict(cur), "new_layout": layout_dict(full),
                           "nodes_down": 0, "checkpoint": latest, "why": "every node is up",
                           "segment_records": results[0]["records"]})
            log_event(cfg, "grow", **{k: v for k, v in events[-1].items()
                                      if k not in ("kind", "segment_records")})
            with open(os.path.join(cfg.save, "fault_time"), "w") as f:
                f.write(repr(grow.requested_at or time.time()))
            cur, down = full, 0
            continue
        for r in results:
            r["attempts"] = launches + 1
        results[0]["events"] = events
        results[0]["final_cfg"] = cur
        return results
