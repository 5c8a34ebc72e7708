"""Validate, simulate and print pipeline schedules (see overlap.pp.schedules for the vocabulary).

``check_schedule`` runs before any rank executes a schedule and raises ``ScheduleError`` unless
(1) each (stage, micro-batch) has one F and one B, or one I and one W, on the stage's rank, in
the order F < B, F < I < W; (2) every cross-rank message has its send right after its producer
and its receive before its consumer, posted in the sender's order; (3) no rank program can
deadlock. It returns the peak number of live activations per rank (F until B, or until W).

``simulate`` runs a schedule with per-kind costs (``DEFAULT_COSTS``: F=1, B=2, I=W=1); the bubble
fraction of rank r is ``1 - busy_r / makespan``.

The narrative: docs/design/pp.md.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from overlap.errors import OverlapError
from overlap.pp.schedules import Action, Payload, PipelineSchedule, message_of, stage_rank

__all__ = ["ScheduleError", "check_schedule", "simulate", "SimResult", "render_table",
           "render_timeline", "diagram", "DEFAULT_COSTS"]

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class ScheduleError(OverlapError, ValueError):
    """A schedule breaks a rule; the message names the schedule, the rank and the action."""


@dataclasses.dataclass(slots=True)
class SimResult:
    """Simulated timeline: ``events[r]`` = [(action, start, end)] for rank r's compute."""

    events: list[list[tuple[Action, float, float]]]
    makespan: float
    num_virtual: int = 1

    @property
    def busy(self) -> list[float]:
        return [sum(e - s for _, s, e in ev) for ev in self.events]

    @property
    def bubble_fractions(self) -> list[float]:
        return [1.0 - b / self.makespan for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        fr = self.bubble_fractions
        return sum(fr) / len(fr)


def _run(actions, num_stages: int, costs: dict[str, float], where: str) -> SimResult:
    """Event simulation of the compute actions; raises ScheduleError on deadlock."""
    p = len(actions)
    progs = [[a for a in prog if a.is_compute] for prog in actions]
    done: dict[tuple[str, int, int], float] = {}
    pc, clock = [0] * p, [0.0] * p
    events: list[list] = [[] for _ in range(p)]

    def ready_at(a: Action) -> float | None:
        s, mb = a.stage, a.microbatch
        if a.kind == "F":
            deps = [("F", s - 1, mb)] if s > 0 else []
        elif a.kind in ("B", "I"):
            deps = [("F", s, mb)]
            if s < num_stages - 1:
                deps.append(("B", s + 1, mb) if ("B", s + 1, mb) in done else ("I", s + 1, mb))
        else:
            deps = [("I", s, mb)]
        times = [done.get(d) for d in deps]
        return None if any(t is None for t in times) else max(times, default=0.0)

    remaining = sum(len(x) for x in progs)
    while remaining:
        progressed = False
        for r in range(p):
            while pc[r] < len(progs[r]):
                a = progs[r][pc[r]]
                t = ready_at(a)
                if t is None:
                    break
                start = max(t, clock[r])
                clock[r] = start + costs[a.kind]
                done[(a.kind, a.stage, a.microbatch)] = clock[r]
                events[r].append((a, start, clock[r]))
                pc[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(progs[r][pc[r]]) for r in range(p) if pc[r] < len(progs[r])}
            raise ScheduleError(f"pp schedule {where}: deadlock, every rank waits on another; "
                                f"blocked actions by rank: {stuck}")
    return SimResult(events=events, makespan=max(clock))


def check_schedule(actions, *, pp_size: int, num_stages: int, num_microbatches: int,
             name: str = "custom") -> list[int]:
    """Check the rules in the module docstring; return peak live activations per rank."""
    p, m = pp_size, num_microbatches
    if len(actions) != p:
        raise ScheduleError(f"pp schedule {name}: {len(actions)} rank programs for pp_size={p}")
    kinds: Counter = Counter()
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    peaks = []
    for r, prog in enumerate(actions):
        seen: set[tuple[str, int, int]] = set()
        live = peak = 0
        for a in prog:
            where = f"pp schedule {name}: rank {r} action {a}"
            if not (0 <= a.stage < num_stages and 0 <= a.microbatch < m):
                raise ScheduleError(f"{where}: stage must be in [0, {num_stages}) and "
                                    f"micro-batch in [0, {m})")
            if stage_rank(a.stage, p) != r:
                raise ScheduleError(f"{where}: stage {a.stage} belongs to rank "
                                    f"{stage_rank(a.stage, p)}")
            s, mb = a.stage, a.microbatch
            need = {"B": ["F"], "I": ["F"], "W": ["I"], "SEND_F": ["F"],
                    "SEND_B": ["B", "I"]}.get(a.kind, [])
            if need and not any((k, s, mb) in seen for k in need):
                raise ScheduleError(f"{where}: must come after {' or '.join(need)} of the same "
                                    "stage and micro-batch")
            if a.is_compute:
                kinds[(a.kind, s, mb)] += 1
                consumed = ("RECV_F" if a.kind == "F" and s > 0 else
                            "RECV_B" if a.kind in ("B", "I") and s < num_stages - 1 else None)
                if consumed and p > 1 and (consumed, s, mb) not in seen:
                    raise ScheduleError(f"{where}: its input needs an earlier {consumed}")
                live += a.kind == "F"
                live -= a.kind in ("B", "W")
                peak = max(peak, live)
            else:
                msg = message_of(a)
                src, dst = (r, a.peer) if a.kind.startswith("SEND") else (a.peer, r)
                want = stage_rank(msg.stage, p) if a.kind.startswith("SEND") else stage_rank(
                    msg.stage - 1 if msg.payload == Payload.ACT else msg.stage + 1, p)
                if a.peer != want or src == dst:
                    raise ScheduleError(f"{where}: peer must be rank {want} (and not itself)")
                (sends if a.kind.startswith("SEND") else recvs).setdefault(
                    (src, dst), []).append(msg)
            seen.add((a.kind, s, mb))
        peaks.append(peak)
    for s in range(num_stages):
        for mb in range(m):
            full, split = kinds[("B", s, mb)], (kinds[("I", s, mb)], kinds[("W", s, mb)])
            if kinds[("F", s, mb)] != 1 or not ((full, split) in ((1, (0, 0)), (0, (1, 1)))):
                raise ScheduleError(f"pp schedule {name}: stage {s} micro-batch {mb} needs "
                                    f"exactly one F and one B (or one I and one W); has "
                                    f"F={kinds[('F', s, mb)]} B={full} I={split[0]} W={split[1]}")
    for pair in sorted(set(sends) | set(recvs)):
        if sends.get(pair, []) != recvs.get(pair, []):
            raise ScheduleError(f"pp schedule {name}: rank {pair[0]} -> rank {pair[1]} sends "
                                f"{sends.get(pair, [])} but receives are posted in order "
                                f"{recvs.get(pair, [])}")
    _run(actions, num_stages, {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0}, name)
    return peaks


def simulate(schedule: PipelineSchedule, costs: dict[str, float] | None = None) -> SimResult:
    """Simulated timeline with ``costs`` per compute kind (default F=1, B=2, I=1, W=1)."""
    c = dict(DEFAULT_COSTS)
    c.update(costs or {})
    res = _run(schedule.actions, schedule.num_stages, c, schedule.name)
    res.num_virtual = schedule.num_virtual
    return res


def diagram(schedule: PipelineSchedule, costs: dict[str, float] | None = None) -> str:
    """ASCII timeline of the simulated run (unit costs by default), idle shown as ``.``."""
    return render_timeline(simulate(schedule, costs))


def render_table(schedule: PipelineSchedule, *, with_comm: bool = False) -> str:
    """One line per rank listing its program, e.g. ``r0: F0s0 F1s0 B0s0 ...``."""
    sc = schedule
    head = (f"{sc.name}: pp_size={sc.pp_size} num_virtual={sc.num_virtual} "
            f"num_microbatches={sc.num_microbatches}; label = kind, micro-batch, 's' stage")
    lines = [head]
    for r, prog in enumerate(sc.actions):
        shown = [str(a) for a in prog if with_comm or a.is_compute]
        lines.append(f"r{r} (peak live {sc.peak_live_activations[r]}): " + " ".join(shown))
    return "\n".join(lines)


def render_timeline(sim: SimResult) -> str:
    """One row per rank, one cell per time unit; a cell names the action running then."""
    unit = min((e - s for ev in sim.events for _, s, e in ev), default=1.0)
    cells = round(sim.makespan / unit)
    rows, width = [], 1
    grid = []
    for ev in sim.events:
        row = ["."] * cells
        for a, s, e in ev:
            label = f"{a.kind}{a.microbatch}"
            if sim.num_virtual > 1:
                label += f"c{a.stage // len(sim.events)}"
            for c in range(round(s / unit), round(e / unit)):
                row[c] = label
        grid.append(row)
        width = max([width] + [len(x) for x in row])
    for r, row in enumerate(grid):
        rows.append(f"r{r} |" + " ".join(x.ljust(width) for x in row) + "|")
    fr = ", ".join(f"{f:.3f}" for f in sim.bubble_fractions)
    rows.append(f"makespan {sim.makespan:g}; bubble fraction per rank: {fr}")
    return "\n".join(rows)

