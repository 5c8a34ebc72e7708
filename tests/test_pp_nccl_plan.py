"""The schedule validator knows NCCL's rules: it simulates the per-rank plans (the batches
exactly as the executor posts them) with one op at a time per communicator and rendezvous
sends, for every schedule x p in {2, 4, 8} x m in {p, ..., 4p} x v in {1, 2} (single process)."""

import pytest

from overlap.pp import ScheduleError, build_schedule
from overlap.pp.programs import NcclOrderDeadlock, channels_of, check_nccl_order, rank_plan

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

GRID = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zb_h1")
        for p in (2, 4, 8) for m in range(p, 4 * p + 1)]
# Interleaved sweeps micro-batches in groups of p, so m is a multiple of p.
GRID += [("interleaved_1f1b", p, m, v) for p in (2, 4, 8) for m in range(p, 4 * p + 1, p)
         for v in (1, 2)]


@pytest.mark.parametrize("name, p, m, v", GRID)
def test_executor_plans_are_deadlock_free_under_nccl_rules(name, p, m, v):
    sched = build_schedule(name, pp_size=p, num_microbatches=m, num_virtual=v)  # checks too
    for header_mode in (False, True):
        check_nccl_order(sched, header_mode=header_mode)
        for r in range(p):
            plan = rank_plan(sched, r, header_mode=header_mode)
            # Every post is on a channel of this rank, carries one direction only, and every
            # received message is waited for exactly once, before the compute that uses it.
            chans = set(channels_of(sched, r))
            posts = [s for s in plan if s[0] == "post"]
            assert {s[1] for s in posts} == chans
            for _, (src, dst), items in posts:
                assert all(is_send == (src == r) for _, _, is_send in items)
            recvd = [(part, msg) for s in posts for part, msg, is_send in s[2] if not is_send]
            waits = [s[1] for s in plan if s[0] == "wait"]
            assert sorted(recvd) == sorted(waits) and len(set(waits)) == len(waits)


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "interleaved_1f1b"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_one_communicator_for_both_directions_is_rejected(name, p):
    # The old executor's layout: the simulation must fail on it, as NCCL would hang.
    v = 2 if name == "interleaved_1f1b" else 1
    sched = build_schedule(name, pp_size=p, num_microbatches=2 * p, num_virtual=v)
    with pytest.raises(NcclOrderDeadlock, match="deadlock under NCCL ordering") as err:
        check_nccl_order(sched, header_mode=False, channels="single")
    assert isinstance(err.value, ScheduleError)
    assert "rank 0 blocked at" in str(err.value) or "rank 1 blocked at" in str(err.value)


def test_issue_example_is_reported_with_the_stuck_batches():
    sched = build_schedule("1f1b", pp_size=2, num_microbatches=4)
    with pytest.raises(NcclOrderDeadlock) as err:
        check_nccl_order(sched, header_mode=False, channels="single")
    msg = str(err.value)
    # Rank 0 waits on recv B0 inside {send F0, recv B0}; rank 1 on recv F1 behind it.
    assert "rank 0 blocked at wait for ('data', ('grad', 0, 0))" in msg
    assert "{send data ('act', 1, 0), recv data ('grad', 0, 0)}" in msg
    assert "rank 1 blocked at wait for ('data', ('act', 1, 1))" in msg
