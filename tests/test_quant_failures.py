"""Quantized collectives when things go wrong, on 2 and 4 ranks under nccl_twin: a failure
stays a failure (a refused or failing call, then a retry, raises on every rank and never
returns numbers), a dead peer is named within the timeout, a stalled one at the timeout, and
the per-group state lives exactly as long as its group (destroyed-and-recreated groups, two
groups on the same ranks)."""

import gc
import os
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from overlap.comm import quant
from overlap.comm.quant import kernels, state
from tests.harness import run_ranks, run_ranks_outcomes

N = 3000  # not a multiple of the block: padded shards


def _x(rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(rank))


def _int8_reference(n: int) -> torch.Tensor:
    """The exact sum; the int8 result must be within ~S/127 per block of it (see quant)."""
    return torch.stack([_x(r) for r in range(n)]).sum(0)


def _attempt(call):
    """What one call did: ("numbers", values) or (error type, message, kind, peer, seconds)."""
    t0 = time.monotonic()
    try:
        out = call()
        if isinstance(out, quant.QuantWork):
            out = out.wait()
        return ("numbers", out.tolist())
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return (type(exc).__name__, str(exc), getattr(exc, "kind", None),
                getattr(exc, "peer", None), time.monotonic() - t0)


# ---- a failure stays a failure -----------------------------------------------------------------


def _fault_on_rank1(*args, **kwargs):
    raise RuntimeError("injected kernel fault on rank 1")


def _one_sided(mode: str, async_op: bool):
    """Rank 1's call fails (refused before any collective, or a kernel error mid-op) while its
    peers make a valid call; rank 1 catches the error and retries; then every rank calls
    again. Nobody may get numbers."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(n)))
    kw = dict(group=g, comm_dtype="int8", async_op=async_op, timeout=20.0)
    out = {}
    if rank == 1:
        if mode == "refused":
            out["first"] = _attempt(lambda: quant.all_reduce(_x(rank), block_size=96, **kw))
        else:
            kernels.dequant_reduce_into = _fault_on_rank1
            out["first"] = _attempt(lambda: quant.all_reduce(_x(rank), **kw))
        out["retry"] = _attempt(lambda: quant.all_reduce(_x(rank), **kw))
    else:
        out["first"] = _attempt(lambda: quant.all_reduce(_x(rank), **kw))
    out["again"] = _attempt(lambda: quant.all_reduce(_x(rank), **kw))
    out["again_other_op"] = _attempt(lambda: quant.all_gather(_x(rank), **kw))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("mode", ["refused", "mid_op"])
def test_one_sided_error_then_retry_raises_on_every_rank(mode, async_op, world_size):
    per_rank = run_ranks(_one_sided, world_size, mode, async_op, timeout=60)
    root = "'block_size'" if mode == "refused" else "injected kernel fault on rank 1"
    first1 = per_rank[1]["first"]
    assert first1[0] == ("ValueError" if mode == "refused" else "RuntimeError"), first1
    assert root in first1[1] and "rank 1" in first1[1], first1
    for rank, out in enumerate(per_rank):
        for step, got in out.items():
            assert got[0] != "numbers", f"rank {rank} {step} returned numbers: {got}"
        if rank != 1:
            kind, msg, exc_kind, peer, seconds = out["first"]
            assert kind == "QuantCommError" and exc_kind == "peer_failed" and peer == 1, out
            assert f"quant.all_reduce: rank {rank} of group" in msg and root in msg, msg
            assert seconds < 5.0, f"rank {rank} took {seconds:.1f}s to learn of rank 1's error"
        later = [out["again"], out["again_other_op"]] + ([out["retry"]] if rank == 1 else [])
        for kind, msg, exc_kind, _, seconds in later:
            assert kind == "QuantCommFailed" and "communicator failed earlier" in msg, msg
            assert seconds < 1.0, msg
        first_msg = per_rank[rank]["first"][1]
        assert first_msg in out["again"][1]  # later calls carry this rank's first error


def _queued_behind_failure():
    """Async ops queued behind a failing one raise too (the queue never hands out numbers)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(n)))
    if rank == 1:
        kernels.dequant_reduce_into = _fault_on_rank1
    calls = [lambda: quant.all_reduce(_x(rank), group=g, comm_dtype="int8", async_op=True,
                                      timeout=20) for _ in range(3)]
    handles = []
    for call in calls:  # submitted back to back: each may be refused if the first failed already
        try:
            handles.append(call())
        except quant.QuantCommFailed as exc:
            handles.append(exc)
    return [(type(h).__name__, str(h)) if isinstance(h, Exception) else _attempt(h.wait)
            for h in handles]


def test_async_ops_queued_behind_a_failure_raise():
    for rank, got in enumerate(run_ranks(_queued_behind_failure, 2, timeout=60)):
        assert [g[0] for g in got] == [
            "RuntimeError" if rank == 1 else "QuantCommError", "QuantCommFailed",
            "QuantCommFailed"], (rank, got)


# ---- dead and stalled peers --------------------------------------------------------------------


def _exit_now(*args, **kwargs):
    os._exit(3)


def _peer_dies():
    rank, n = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(n)))
    if rank == 1:
        kernels.dequant_reduce_into = _exit_now  # between the all-to-all and the all-gather
    first = _attempt(lambda: quant.all_reduce(_x(rank), group=g, comm_dtype="int8", timeout=20))
    again = _attempt(lambda: quant.all_reduce(_x(rank), group=g, comm_dtype="int8", timeout=20))
    return first, again


@pytest.mark.parametrize("world_size", [2, 4])
def test_dead_peer_is_named_within_the_timeout(world_size):
    outcomes = run_ranks_outcomes(_peer_dies, world_size, timeout=60, grace=15)
    assert outcomes[1].status == "died" and outcomes[1].exitcode == 3, outcomes[1]
    for o in outcomes:
        if o.rank == 1:
            continue
        assert o.status == "ok", o
        (kind, msg, exc_kind, peer, seconds), again = o.value
        assert kind == "QuantCommError" and f"quant.all_reduce: rank {o.rank} of group" in msg
        assert "rank 1 (pid" in msg and "has exited" in msg, msg
        assert seconds < 5.0, f"rank {o.rank}: {seconds:.1f}s to notice the dead peer: {msg}"
        assert again[0] == "QuantCommFailed" and "has exited" in again[1], again


STALL_S, TIMEOUT_S = 6.0, 1.5


def _peer_stalls(first_call: bool):
    rank, n = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(n)))
    kw = dict(group=g, comm_dtype="int8", timeout=TIMEOUT_S)
    if not first_call:  # rank 1 has used the group before it stalls
        quant.all_reduce(_x(rank), **kw)
    t0 = time.monotonic()
    if rank == 1:
        time.sleep(STALL_S)  # alive, far beyond the timeout
    first = _attempt(lambda: quant.all_reduce(_x(rank), **kw))
    again = _attempt(lambda: quant.all_reduce(_x(rank), **kw))
    if rank != 1:  # stay alive, so rank 1's late call meets a live but failed group
        time.sleep(max(0.0, t0 + STALL_S + 3.0 - time.monotonic()))
    return first, again


@pytest.mark.parametrize("world_size,first_call", [(2, True), (2, False), (4, False)])
def test_stalled_peer_is_reported_at_the_timeout(world_size, first_call):
    per_rank = run_ranks(_peer_stalls, world_size, first_call, timeout=60)
    timed_out = 0
    for rank, (first, again) in enumerate(per_rank):
        assert first[0] != "numbers" and again[0] != "numbers", (rank, first, again)
        assert again[0] == "QuantCommFailed", (rank, again)
        if rank == 1:  # woke up late: its peers gave up on the group
            assert first[0] == "QuantCommError" and "gave up waiting" in first[1], first
            continue
        kind, msg, exc_kind, peer, seconds = first
        assert f"quant.all_reduce: rank {rank} of group" in msg, msg
        assert seconds < TIMEOUT_S + 2.0, (rank, seconds, msg)
        if kind == "QuantTimeout":
            timed_out += 1
            assert seconds >= TIMEOUT_S - 0.05 and f"within {TIMEOUT_S:g}s" in msg, msg
            if first_call:
                assert peer == 1 and "rank(s) [1] never called" in msg, msg
        else:  # another waiting rank timed out first and said so
            assert kind == "QuantCommError" and "gave up waiting" in msg, msg
    assert timed_out >= 1


# ---- state lifetime ----------------------------------------------------------------------------


def _recreated_group():
    """A group that failed, destroyed and created again (the new object may well get the old
    one's id()) starts with a fresh state: not failed, no stale scratch, correct numbers."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(n)))
    big = torch.ones(8 * N)
    quant.all_reduce(big, group=g, comm_dtype="int8")  # grows g's scratch
    old = weakref.ref(state.existing_state(g))
    old_id = id(g)
    failed = _attempt(lambda: quant.all_reduce(_x(rank), group=g, comm_dtype="fp8"))
    dist.destroy_process_group(g)
    del g
    deadline = time.monotonic() + 5.0  # nccl_twin's communicator threads end asynchronously
    while gc.collect() is not None and old() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    old_state_alive = old() is not None  # the state died with its group
    g2 = dist.new_group(list(range(n)))
    got = quant.all_reduce(_x(rank), group=g2, comm_dtype="int8")
    fresh = state.existing_state(g2)
    scratch_bytes = sum(b.numel() for b in fresh._scratch.values())
    return dict(failed=failed[0], old_state_alive=old_state_alive, same_id=id(g2) == old_id,
                err=(got.double() - _int8_reference(n).double()).abs().max().item(),
                scratch_bytes=scratch_bytes, big_bytes=big.numel())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_destroyed_and_recreated_group_gets_fresh_state(world_size):
    for res in run_ranks(_recreated_group, world_size):
        assert res["failed"] == "ValueError" and not res["old_state_alive"], res
        # ~S/127 per block with S = sum of block maxima (|x| < ~4.5 for N(0,1), 4 ranks)
        assert res["err"] < 4.5 * world_size / 127 * 1.01, res
        # the small call's scratch only: nothing inherited from the big one
        assert res["scratch_bytes"] < res["big_bytes"], res


def _two_groups():
    """Two groups on the same ranks: failing one leaves the other working, sync and async,
    and their async queues do not wait on each other."""
    rank, n = dist.get_rank(), dist.get_world_size()
    a, b = dist.new_group(list(range(n))), dist.new_group(list(range(n)))
    before = quant.all_reduce(_x(rank), group=a, comm_dtype="bf16", async_op=True)
    on_b = quant.all_reduce(_x(rank), group=b, comm_dtype="int8", async_op=True)
    results = [before.wait().tolist(), on_b.wait().tolist()]
    refused = _attempt(lambda: quant.all_gather(_x(rank), group=a, comm_dtype="int4"))
    after_a = _attempt(lambda: quant.all_reduce(_x(rank), group=a, comm_dtype="int8"))
    after_b = quant.all_reduce(_x(rank), group=b, comm_dtype="int8").tolist()
    exact = quant.all_reduce(_x(rank), group=b, comm_dtype="fp32").tolist()
    return results, refused[0], after_a[0], after_b, exact


@pytest.mark.parametrize("world_size", [2, 4])
def test_two_groups_are_independent(world_size):
    ref = _int8_reference(world_size).double()
    S = 4.5 * world_size  # a bound on the sum of the ranks' block maxima of N(0,1) data
    per_rank = run_ranks(_two_groups, world_size)
    for (bf16, int8), refused, after_a, after_b, exact in per_rank:
        assert refused == "ValueError" and after_a == "QuantCommFailed"
        err = lambda got: (torch.tensor(got, dtype=torch.float64) - ref).abs().max()  # noqa: E731
        assert err(exact) < 1e-5 and err(bf16) < 2 * 2**-8 * S  # two bf16 roundings
        assert err(int8) < S / 127 and err(after_b) < S / 127  # two quantizations of ~S/254
        assert after_b == per_rank[0][3]  # identical on every rank
