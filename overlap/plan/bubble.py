"""Pipeline timing from the project's own schedules, fed with per-stage costs.

Contract: the schedules are ``overlap.pp``'s builders (the same per-rank action lists the
executor runs), and :func:`simulate_stages` follows ``overlap.pp.check.simulate``'s timing rules
exactly, with a per-stage cost table instead of one cost per action kind (tests pin the two
together whenever the stages cost the same). Transfers take no time (the caller folds their
cost into the action costs). For m > ``6p`` micro-batches the replay extrapolates from the
schedules' period p (tests check it against the full replay).

Closed forms (F, B per micro-batch per stage, uniform stages), as a fraction of the step:
GPipe and 1F1B ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v*m+p-1)``, ZB-H1 with F = I = W
``(p-1)/(3m+p-1)``.
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses
import functools

from overlap.pp.schedules import SCHEDULES, Action

__all__ = ["PipelineSim", "simulate_stages", "peak_live", "live_pairs", "closed_form_bubble",
           "PP_NAMES"]

# Planner schedule names -> overlap.pp names.
PP_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b",
            "zb-h1": "zb_h1"}


@dataclasses.dataclass(slots=True, frozen=True)
class PipelineSim:
    """Per pp rank: ``busy`` compute seconds, ``first_start`` of its first action, ``finish`` of
    its last, ``last_backward`` the duration of its last gradient-producing action."""

    makespan: float
    busy: tuple[float, ...]
    first_start: tuple[float, ...]
    finish: tuple[float, ...]
    last_backward: tuple[float, ...]

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of idle time over the makespan (as ``overlap.pp.check``)."""
        if self.makespan <= 0:
            return 0.0
        return sum(1.0 - b / self.makespan for b in self.busy) / len(self.busy)


@functools.lru_cache(maxsize=256)
def _actions(name: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(prog) for prog in SCHEDULES[PP_NAMES[name]](p, m, v))


def peak_live(schedule: str, pp: int, m: int, v: int = 1) -> list[int]:
    """Peak live activations (stage-micro-batches) per pp rank, counted as
    ``overlap.pp.check.check_schedule`` counts them. Depends on m only up to the warm-up, so it is
    computed at ``min(m, 4p)`` (rounded to a multiple of p), except for GPipe, which runs every
    forward before any backward (its peak is m)."""
    peaks = []
    for prog in _actions(schedule, pp, _warmup_m(schedule, pp, m), v):
        live = peak = 0
        for a in prog:
            live += a.kind == "F"
            live -= a.kind in ("B", "W")
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _warmup_m(schedule: str, pp: int, m: int) -> int:
    return m if m <= 4 * pp or schedule == "gpipe" else 4 * pp


@functools.lru_cache(maxsize=256)
def live_pairs(schedule: str, pp: int, m: int, v: int = 1) -> tuple[tuple[tuple[int, int], ...],
                                                                     ...]:
    """Per pp rank, the (before, after) counts of live stage-micro-batches its program passes
    through: ``before`` ran F and not yet B or I, ``after`` ran I and not yet W (ZB-H1's split
    backward; 0 for the other schedules). Only the states no other one dominates are kept, so
    ``max(a * x + b * y)`` over them is the peak of any positive weights. ``before + after``
    peaks at :func:`peak_live`; m as there."""
    out = []
    for prog in _actions(schedule, pp, _warmup_m(schedule, pp, m), v):
        pre = post = 0
        seen = {(0, 0)}
        for a in prog:
            pre += (a.kind == "F") - (a.kind in ("B", "I"))
            post += (a.kind == "I") - (a.kind == "W")
            seen.add((pre, post))
        out.append(tuple(sorted(s for s in seen if not any(
            t != s and t[0] >= s[0] and t[1] >= s[1] for t in seen))))
    return tuple(out)


_KIND = {"F": 0, "B": 1, "I": 2, "W": 3}


@functools.lru_cache(maxsize=64)
def _program(name: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank: (kind, stage, index of this action's completion, dependency indices) with
    completion times kept in one flat list indexed ``(kind*S + stage)*m + mb``; a B or I of
    stage s waits on the next stage's B or I, whichever that stage's program runs."""
    num_stages = p * v
    acts = _actions(name, p, m, v)
    split = any(a.kind == "I" for prog in acts for a in prog)
    back = _KIND["I"] if split else _KIND["B"]

    def idx(kind: int, stage: int, mb: int) -> int:
        return (kind * num_stages + stage) * m + mb

    out = []
    for prog in acts:
        steps = []
        for a in prog:
            k, st, mb = _KIND[a.kind], a.stage, a.microbatch
            if a.kind == "F":
                deps = (idx(0, st - 1, mb),) if st > 0 else ()
            elif a.kind in ("B", "I"):
                deps = (idx(0, st, mb),) + ((idx(back, st + 1, mb),)
                                            if st < num_stages - 1 else ())
            else:
                deps = (idx(_KIND["I"], st, mb),)
            steps.append((k, st, idx(k, st, mb)) + deps)
        out.append(tuple(steps))
    return tuple(out)


def _replay(name: str, p: int, m: int, v: int,
            costs: tuple[dict[str, float], ...]) -> PipelineSim:
    progs = _program(name, p, m, v)
    table = [[c["F"], c["B"], c.get("I", 0.0), c.get("W", 0.0)] for c in costs]
    done = [-1.0] * (4 * p * v * m)
    pc, clock = [0] * p, [0.0] * p
    busy, first = [0.0] * p, [-1.0] * p
    last_b = [0.0] * p
    remaining = sum(len(x) for x in progs)
    while remaining:
        progressed = False
        for r in range(p):
            prog, i, now = progs[r], pc[r], clock[r]
            n = len(prog)
            while i < n:
                step = prog[i]
                t = 0.0
                for d in step[3:]:
                    x = done[d]
                    if x < 0.0:
                        t = -1.0
                        break
                    if x > t:
                        t = x
                if t < 0.0:
                    break
                start = t if t > now else now
                dur = table[step[1]][step[0]]
                now = start + dur
                done[step[2]] = now
                busy[r] += dur
                if first[r] < 0.0:
                    first[r] = start
                if step[0] in (1, 3):
                    last_b[r] = dur
                i += 1
            if i != pc[r]:
                remaining -= i - pc[r]
                pc[r], clock[r] = i, now
                progressed = True
        if not progressed:
            raise RuntimeError("overlap.plan: pipeline replay deadlocked (a schedule bug)")
    return PipelineSim(makespan=max(clock), busy=tuple(busy),
                       first_start=tuple(max(f, 0.0) for f in first), finish=tuple(clock),
                       last_backward=tuple(last_b))


def simulate_stages(schedule: str, pp: int, m: int, v: int,
                    stage_costs: list[dict[str, float]]) -> PipelineSim:
    """Replay ``schedule`` with ``stage_costs[s]`` = {"F","B","I","W": seconds} per stage."""
    if schedule not in PP_NAMES:
        raise ValueError(f"--schedule {schedule!r} is unknown; expected one of {list(PP_NAMES)}")
    costs = tuple(dict(c) for c in stage_costs)
    if len(costs) != pp * v:
        raise ValueError(f"stage_costs: {len(costs)} entries for {pp} x {v} stages")
    if m <= 6 * pp:
        return _replay(schedule, pp, m, v, costs)
    # Sample m = p, 2p, 3p, ... until two consecutive differences agree (the steady state),
    # then extrapolate; if that never happens below m, replay m itself.
    prev = _replay(schedule, pp, pp, v, costs)
    cur = _replay(schedule, pp, 2 * pp, v, costs)
    m_cur = 2 * pp
    while m_cur + pp <= m:
        nxt = _replay(schedule, pp, m_cur + pp, v, costs)
        if _same_step(prev, cur, nxt):
            return _extrapolate(cur, nxt, (m - m_cur) / pp)
        prev, cur, m_cur = cur, nxt, m_cur + pp
    return _replay(schedule, pp, m, v, costs)


def _vector(sim: PipelineSim) -> list[float]:
    return [sim.makespan, *sim.busy, *sim.finish]


def _same_step(a: PipelineSim, b: PipelineSim, c: PipelineSim) -> bool:
    for x, y, z in zip(_vector(a), _vector(b), _vector(c)):
        if abs((z - y) - (y - x)) > 1e-9 * max(abs(z), 1e-30):
            return False
    return True


def _extrapolate(b: PipelineSim, c: PipelineSim, k: float) -> PipelineSim:
    """``b`` at m0 and ``c`` at m0 + p, extended to m0 + k*p (k >= 1)."""
    def ext(x: float, y: float) -> float:
        return x + (y - x) * k

    return PipelineSim(makespan=ext(b.makespan, c.makespan),
                       busy=tuple(ext(x, y) for x, y in zip(b.busy, c.busy)),
                       first_start=c.first_start,
                       finish=tuple(ext(x, y) for x, y in zip(b.finish, c.finish)),
                       last_backward=c.last_backward)


def closed_form_bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Ideal bubble fraction of the step (uniform stages; ZB-H1 with F = I = W)."""
    p = pp
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"--schedule {schedule!r} is unknown; expected one of {list(PP_NAMES)}")
