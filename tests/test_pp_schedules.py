"""overlap.pp schedules as data (single process): validation, peak memory, simulated bubbles.

Bubble formulas tested exactly, with per-action costs F=1, B=2 (I=W=1 when split) and the
bubble fraction of a rank = idle / makespan:
  GPipe, 1F1B:       (p-1) / (m + p - 1)
  interleaved 1F1B:  (p-1) / (v*m + p - 1)   (m a multiple of p; costs per chunk)
  ZB-H1:             (p-1) / (3m + p - 1)
(equivalently idle / compute = (p-1)/m, (p-1)/(v*m), (p-1)/(3m)).
"""

import dataclasses

import pytest

from overlap.pp import (ScheduleError, build_schedule, check_schedule, diagram, render_table,
                        simulate)
from overlap.pp.schedules import Action, lower, one_f_one_b

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

CASES = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zb_h1")
         for p in (1, 2, 3, 4, 5) for m in range(p, 4 * p + 1)]
CASES += [("interleaved_1f1b", p, m, v) for p in (1, 2, 3, 4) for v in (2, 3)
          for m in range(p, 4 * p + 1, p)]


def _expected_bubble(name, p, m, v):
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def _expected_peak(name, p, m, v, r):
    if name == "gpipe":
        return m
    if name == "1f1b":
        return p - r
    if name == "zb_h1":
        return p
    return min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_schedule_valid_peak_and_bubble(name, p, m, v):
    sched = build_schedule(name, pp_size=p, num_microbatches=m, num_virtual=v)
    assert list(sched.peak_live_activations) == [_expected_peak(name, p, m, v, r)
                                                 for r in range(p)]
    if name == "1f1b":
        assert max(sched.peak_live_activations) <= p
    sim = simulate(sched)
    for frac in sim.bubble_fractions:  # every rank has the same idle time
        assert frac == pytest.approx(_expected_bubble(name, p, m, v), abs=1e-12)
    # Every receive is posted at least one compute action before the compute that needs it
    # (unless that compute is the rank's first), so the transfer overlaps that compute.
    for prog in sched.actions:
        computes_before = 0
        posted_at = {}
        for a in prog:
            if a.kind.startswith("RECV"):
                posted_at[(a.kind[-1], a.stage, a.microbatch)] = computes_before
            elif a.is_compute:
                need = "F" if a.kind == "F" else "B" if a.kind in ("B", "I") else None
                key = (need, a.stage, a.microbatch)
                if key in posted_at and computes_before > 0:
                    assert posted_at[key] < computes_before, (name, a)
                computes_before += 1


@pytest.mark.parametrize("p, m", [(2, 2), (4, 4), (4, 8), (3, 7)])
def test_zb_h1_bubble_lower_than_1f1b(p, m):
    zb = simulate(build_schedule("zb_h1", pp_size=p, num_microbatches=m)).bubble_fraction
    fb = simulate(build_schedule("1f1b", pp_size=p, num_microbatches=m)).bubble_fraction
    assert zb < fb
    # W twice as expensive as I still leaves ZB-H1 ahead.
    zb2 = simulate(build_schedule("zb_h1", pp_size=p, num_microbatches=m),
                   {"I": 1.0, "W": 2.0}).bubble_fraction
    fb2 = simulate(build_schedule("1f1b", pp_size=p, num_microbatches=m),
                   {"B": 3.0}).bubble_fraction
    assert zb2 < fb2


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="num_microbatches=3 must be >= pp_size=4"):
        build_schedule("gpipe", pp_size=4, num_microbatches=3)
    with pytest.raises(ValueError, match="num_microbatches=6 must be a multiple of pp_size=4"):
        build_schedule("interleaved_1f1b", pp_size=4, num_microbatches=6, num_virtual=2)
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        build_schedule("pipedream", pp_size=2, num_microbatches=2)
    with pytest.raises(ValueError, match="num_virtual=2 needs 'interleaved_1f1b'"):
        build_schedule("1f1b", pp_size=2, num_microbatches=2, num_virtual=2)
    with pytest.raises(ValueError, match="pp_size must be a positive int"):
        build_schedule("1f1b", pp_size=0, num_microbatches=2)


def _validate(actions, p, m, v=1):
    return check_schedule(actions, pp_size=p, num_stages=p * v, num_microbatches=m, name="test")


def test_validation_rejects_deadlock():
    # Rank 1 runs micro-batch 1 first, but rank 0 only sends it after B0, which needs rank 1.
    compute = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
               [Action("F", 1, 1), Action("F", 1, 0), Action("B", 1, 0), Action("B", 1, 1)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        _validate(lower(compute, 2, 2), 2, 2)


def test_validation_rejects_broken_programs():
    good = lower(one_f_one_b(2, 3), 2, 2)
    assert _validate(good, 2, 3) == [2, 1]
    # A missing backward.
    bad = [list(good[0]), [a for a in good[1] if (a.kind[-1], a.microbatch) != ("B", 2)]]
    with pytest.raises(ScheduleError, match="stage 1 micro-batch 2 needs exactly one F"):
        _validate(bad, 2, 3)
    # B before its F.
    prog = list(good[1])
    i_f = prog.index(Action("F", 1, 0))
    i_b = prog.index(Action("B", 1, 0))
    prog[i_f], prog[i_b] = prog[i_b], prog[i_f]
    with pytest.raises(ScheduleError, match="must come after F"):
        _validate([good[0], prog], 2, 3)
    # Two receives on the same channel swapped: the sender's order is not matched.
    prog = list(good[1])
    recvs = [i for i, a in enumerate(prog) if a.kind == "RECV_F"]
    prog.insert(recvs[0], prog.pop(recvs[1]))
    with pytest.raises(ScheduleError, match="rank 0 -> rank 1 sends"):
        _validate([good[0], prog], 2, 3)
    # A receive after the compute that consumes it.
    prog = list(good[1])
    r = prog.pop(recvs[0])  # RECV_F of micro-batch 0
    prog.insert(prog.index(Action("F", 1, 0)) + 1, r)
    with pytest.raises(ScheduleError, match="needs an earlier RECV_F"):
        _validate([good[0], prog], 2, 3)
    # A stage on the wrong rank.
    with pytest.raises(ScheduleError, match="stage 1 belongs to rank 1"):
        _validate([list(good[0]) + [Action("F", 1, 0)], good[1]], 2, 3)
    # W before its I.
    zb = build_schedule("zb_h1", pp_size=2, num_microbatches=2)
    prog = list(zb.actions[0])
    i_i, i_w = prog.index(Action("I", 0, 0)), prog.index(Action("W", 0, 0))
    prog[i_i], prog[i_w] = prog[i_w], prog[i_i]
    with pytest.raises(ScheduleError, match="must come after I"):
        _validate([prog, zb.actions[1]], 2, 2)


def test_table_and_diagram():
    sched = build_schedule("1f1b", pp_size=2, num_microbatches=3)
    table = render_table(sched)
    assert table.splitlines()[1] == "r0 (peak live 2): F0s0 F1s0 B0s0 F2s0 B1s0 B2s0"
    assert table.splitlines()[2] == "r1 (peak live 1): F0s1 B0s1 F1s1 B1s1 F2s1 B2s1"
    assert "SEND_F0s0->1" in render_table(sched, with_comm=True)
    assert "RECV_F0s1<-0" in render_table(sched, with_comm=True)
    rows = diagram(sched).splitlines()
    assert rows[0] == "r0 |F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2|"
    assert rows[1] == "r1 |.  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  . |"
    assert "makespan 12" in rows[-1] and "0.250, 0.250" in rows[-1]


def test_schedule_is_immutable_data():
    sched = build_schedule("zb_h1", pp_size=2, num_microbatches=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sched.name = "x"
    assert sched.split_backward and sched.num_stages == 2 and sched.stages_of(1) == [1]
    assert not build_schedule("gpipe", pp_size=2, num_microbatches=2).split_backward
