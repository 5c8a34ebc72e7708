"""The multi-process harness itself: results, failures, hangs, deaths, and no leftovers."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from harness import WORLD_SIZES, LaunchError, run_ranks, run_ranks_outcomes, shm_leaks_since
from overlap.dist.launch import orphaned_shm_segments

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")


def _sum_of_ranks(scale):
    t = torch.full((3,), float(dist.get_rank()) * scale)
    dist.all_reduce(t)
    return dist.get_rank(), t.tolist(), os.environ["WORLD_SIZE"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_results_come_back_in_rank_order(world):
    want = sum(range(world)) * 2.0
    got = run_ranks(_sum_of_ranks, world, 2.0)
    assert got == [(r, [want] * 3, str(world)) for r in range(world)]


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()  # the others block here until the launcher tears them down


@pytest.mark.parametrize("world", [2, 4])
def test_failing_rank_traceback_reaches_pytest_quickly(world):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(_raise_on_rank_1, world, timeout=60)
    took = time.monotonic() - t0
    msg = str(info.value)
    first = msg.index("--- rank")
    # The root cause comes first, with its traceback pointing at the raising line.
    assert msg[first:].startswith("--- rank 1: error: ValueError: bad shard on purpose")
    assert "in _raise_on_rank_1" in msg and 'raise ValueError("bad shard on purpose")' in msg
    assert took < 15, f"failure took {took:.1f}s to surface"


def _hang_on_rank(hung):
    if dist.get_rank() in hung:
        time.sleep(3600)
    return dist.get_rank()


def test_hanging_ranks_are_killed_and_named_with_their_stacks():
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(_hang_on_rank, 4, [1, 3], timeout=3)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert "ranks [1, 3] of 4 hung past the 3s timeout" in msg
    assert msg.count("in _hang_on_rank") >= 2  # each hung rank's stack shows where it sat
    outcomes = info.value.outcomes
    assert [o.status for o in outcomes] == ["ok", "hung", "ok", "hung"]
    assert [o.value for o in outcomes] == [0, None, 2, None]
    assert took < 15


def _die_after_making_segment():
    rank = dist.get_rank()
    # The communicator exists before the death: NCCL creates it at the first op, and a rank
    # that died before joining its creation is seen only at the timeout (tests/test_twin_rules).
    dist.barrier()
    if rank == 1:
        # A segment named like a workspace's, never unlinked: the launcher must remove it.
        with open(f"/dev/shm/overlap_{os.getpid()}_leak", "wb") as f:
            f.write(b"x" * 64)
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)  # fails: the peer is gone
    return float(t)


@pytest.mark.parametrize("world", [2, 4])
def test_dead_rank_fails_the_others_and_leaks_nothing(world):
    threads_before = len(os.listdir("/proc/self/task"))
    shm_before = set(orphaned_shm_segments())
    t0 = time.monotonic()
    outcomes = run_ranks_outcomes(_die_after_making_segment, world, timeout=60, grace=20)
    took = time.monotonic() - t0
    assert outcomes[1].status == "died" and outcomes[1].exitcode == 3
    others = [o for o in outcomes if o.rank != 1]
    assert all(o.status == "error" for o in others), others
    assert took < 20
    # (other workers' tests may hold live segments of their own: only orphans count)
    assert shm_leaks_since(shm_before) == []
    assert len(os.listdir("/proc/self/task")) <= threads_before


def _my_pid():
    return os.getpid()


def test_no_rank_process_outlives_the_call():
    pids = run_ranks(_my_pid, 4)
    assert len(set(pids)) == 4
    time.sleep(0.2)  # the fork server reaps its children asynchronously
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        assert state == "Z", f"rank process {pid} is still running (state {state})"


def test_bad_world_size_is_rejected():
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        run_ranks(_my_pid, 0)


def _unpicklable():
    return lambda: None


def test_unpicklable_result_is_an_error_not_a_hang():
    with pytest.raises(LaunchError, match="result could not be sent"):
        run_ranks(_unpicklable, 2, timeout=20)


def _return_tensors():
    return [torch.full((3,), float(dist.get_rank())), {"w": torch.arange(4.0)}]


def test_tensor_results_survive_the_rank_exiting():
    # Tensors must come back by value: a shared-memory handle would die with the rank.
    got = run_ranks(_return_tensors, 2)
    assert [r[0].tolist() for r in got] == [[0.0] * 3, [1.0] * 3]
    assert all(r[1]["w"].tolist() == [0.0, 1.0, 2.0, 3.0] for r in got)
