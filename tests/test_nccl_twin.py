"""The NCCL-ordering twin (overlap.dist.nccl_twin): orders NCCL would deadlock on are reported
within the timeout, orders NCCL accepts complete with the right numbers, and gloo alone (the
looser transport) is shown to accept the bad orders, so the twin is the stricter of the two."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import WORLD_SIZES, run_ranks

SHORT = timedelta(seconds=2)


def _batch(ops):
    return dist.batch_isend_irecv([dist.P2POp(f, t, peer) for f, t, peer in ops])


def _outcome(works):
    try:
        for w in works:
            w.wait(timeout=SHORT)
    except RuntimeError as exc:
        return str(exc)
    return "ok"


# ------------------------------------------------------------------ known-good orders


def _collectives(world):
    r = dist.get_rank()
    x = torch.arange(6, dtype=torch.float32) + r
    dist.all_reduce(x)
    want = torch.arange(6, dtype=torch.float32) * world + sum(range(world))
    out = {"all_reduce": (x - want).abs().max().item()}
    g = torch.empty(world * 3)
    dist.all_gather_into_tensor(g, torch.full((3,), float(r)))
    out["all_gather"] = (g - torch.arange(world).repeat_interleave(3).float()).abs().max().item()
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2 * world, dtype=torch.float32))
    out["reduce_scatter"] = (rs - world * torch.arange(2 * r, 2 * r + 2).float()).abs().max().item()
    b = torch.full((4,), float(r))
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = (b - (world - 1)).abs().max().item()
    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.arange(world, dtype=torch.float32) + 10 * r)
    out["all_to_all"] = (a2a - (torch.arange(world).float() * 10 + r)).abs().max().item()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": r})
    out["objects"] = float(objs != [{"rank": i} for i in range(world)])
    sub = dist.new_group(list(range(world)))
    y = torch.ones(2)
    work = dist.all_reduce(y, group=sub, async_op=True)
    fut_val = work.get_future().wait()[0]
    out["subgroup_future"] = (fut_val - world).abs().max().item()
    dist.barrier()
    return out


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_collectives_match_reference(world):
    for res in run_ranks(_collectives, world, world, backend="nccl_twin"):
        assert res == {k: 0.0 for k in res}, res


def _ring_batch(world):
    r = dist.get_rank()
    send = torch.full((1000,), float(r))
    recv = torch.empty(1000)
    # Both directions in one batch: NCCL's group semantics let every rank send first.
    works = _batch([(dist.isend, send, (r + 1) % world), (dist.irecv, recv, (r - 1) % world)])
    for w in works:
        w.wait()
    return recv[0].item(), recv[-1].item()


@pytest.mark.parametrize("world", (2, 4))
def test_batched_exchange_completes(world):
    res = run_ranks(_ring_batch, world, world, backend="nccl_twin")
    assert res == [(float((r - 1) % world),) * 2 for r in range(world)]


def _lone_p2p_beside_pending_collective():
    # Lone send/recv run on a per-pair communicator, so a collective still pending on the
    # group's communicator does not block them (as ProcessGroupNCCL's p2p communicators).
    r = dist.get_rank()
    # Both communicators exist first, made in one order on both ranks: NCCL creates one when
    # every rank of it issues its first op on it, so the crossed order below would deadlock
    # at creation (test_crossed_first_touch_of_two_communicators_is_reported).
    dist.all_reduce(torch.zeros(1))
    warm = torch.zeros(1)
    dist.send(warm, 1) if r == 0 else dist.recv(warm, 0)
    x = torch.ones(3)
    if r == 0:
        ar = dist.all_reduce(x, async_op=True)
        dist.isend(torch.full((5,), 7.0), 1).wait(timeout=SHORT)
        ar.wait(timeout=SHORT)
        return x[0].item()
    buf = torch.empty(5)
    dist.irecv(buf, 0).wait(timeout=SHORT)
    dist.all_reduce(x)
    return x[0].item() + buf.sum().item()


def test_lone_p2p_has_its_own_communicator():
    assert run_ranks(_lone_p2p_beside_pending_collective, 2, backend="nccl_twin") == [2.0, 37.0]


def _rendezvous_send(delay):
    # A send completes only once the receiver has started the receive.
    if dist.get_rank() == 0:
        t0 = time.monotonic()
        dist.isend(torch.ones(4), 1).wait()
        return time.monotonic() - t0
    time.sleep(delay)
    buf = torch.empty(4)
    dist.recv(buf, 0)
    return buf.sum().item()


def test_send_completes_only_when_receive_starts():
    took, got = run_ranks(_rendezvous_send, 2, 0.6, backend="nccl_twin")
    assert got == 4.0 and took >= 0.55


# ------------------------------------------------------------------ known-bad orders


def _lone_send_then_recv():
    # Both ranks send first, each as a lone op on the shared pair communicator.
    r, peer = dist.get_rank(), 1 - dist.get_rank()
    buf = torch.empty(8)
    works = [dist.isend(torch.full((8,), float(r)), peer), dist.irecv(buf, peer)]
    return _outcome(works)


def _issue_example():
    # The pipeline order from the issue: 1F1B, p=2, as the old executor posted it.
    r = dist.get_rank()
    t = [torch.ones(16) for _ in range(3)]
    if r == 0:
        works = _batch([(dist.isend, t[0], 1), (dist.irecv, t[1], 1)])  # {send F0, recv B0}
        works += _batch([(dist.isend, t[2], 1)])                         # {send F1}
    else:
        works = _batch([(dist.irecv, t[0], 0)])                          # {recv F0}
        works += _batch([(dist.irecv, t[1], 0)])                         # {recv F1}
        works += _batch([(dist.isend, t[2], 0)])                         # {send B0}
    return _outcome(works)


def _collective_behind_pending_batch():
    r = dist.get_rank()
    x, buf = torch.ones(2), torch.empty(2)
    if r == 0:
        works = _batch([(dist.irecv, buf, 1)])
        works.append(dist.all_reduce(x, async_op=True))
    else:
        works = [dist.all_reduce(x, async_op=True)]
        works += _batch([(dist.isend, torch.ones(2), 0)])
    return _outcome(works)


BAD = {"lone send then recv": _lone_send_then_recv, "issue 1F1B example": _issue_example,
       "collective behind a pending batch": _collective_behind_pending_batch}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_order_is_reported_within_timeout(case):
    t0 = time.monotonic()
    res = run_ranks(BAD[case], 2, backend="nccl_twin", timeout=30)
    assert time.monotonic() - t0 < 15
    assert any(r != "ok" for r in res), res
    for msg in res:
        if msg != "ok":
            assert "nccl_twin" in msg and "did not complete within 2s" in msg
            assert "in issue order" in msg and "rank" in msg


@pytest.mark.parametrize("case", sorted(BAD))
def test_gloo_alone_accepts_the_bad_orders(case):
    # Why the twin exists: plain gloo runs every one of these to completion.
    assert run_ranks(BAD[case], 2, backend="gloo") == ["ok", "ok"]


def _failure_sticks():
    peer = 1 - dist.get_rank()
    buf = torch.empty(8)
    first = _outcome([dist.isend(torch.ones(8), peer), dist.irecv(buf, peer)])
    try:
        dist.isend(torch.ones(8), peer).wait(timeout=SHORT)
        later = "returned"
    except RuntimeError as exc:
        later = str(exc)
    return first != "ok", later


def test_a_failed_communicator_stays_failed():
    for timed_out, later in run_ranks(_failure_sticks, 2, backend="nccl_twin", timeout=30):
        assert timed_out
        assert "failed earlier" in later and "did not complete within" in later


def _ddp_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x = torch.randn(4, 5) * (dist.get_rank() + 1)
    ddp(x).square().sum().backward()
    return model.weight.grad.clone()


def test_ddp_runs_on_the_twin_and_matches_gloo():
    twin = run_ranks(_ddp_step, 2, backend="nccl_twin")
    plain = run_ranks(_ddp_step, 2, backend="gloo")
    assert torch.equal(twin[0], plain[0]) and torch.equal(twin[1], twin[0])


def _threads_after_destroy():
    import threading

    r, peer = dist.get_rank(), 1 - dist.get_rank()
    sub = dist.new_group([0, 1])
    x = torch.ones(3)
    dist.all_reduce(x, group=sub)
    buf = torch.empty(3)
    if r == 0:
        dist.send(x, peer)
    else:
        dist.recv(buf, peer)
    before = sum(t.name.startswith("nccl_twin") for t in threading.enumerate())
    dist.destroy_process_group()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t.name for t in threading.enumerate() if t.name.startswith("nccl_twin")]
        if not left:
            break
        time.sleep(0.01)
    return before, left


def test_destroy_stops_every_communicator_thread():
    # World and subgroup communicators plus the world's pair communicator: 3 threads per rank.
    for before, left in run_ranks(_threads_after_destroy, 2, backend="nccl_twin"):
        assert before == 3 and left == []


# ---------------------------------------------------------------------------------- sizes
# gloo aborts the process when a receive is smaller than its send and truncates silently the
# other way; NCCL hangs or reads garbage. The twin raises a clear error on every rank instead,
# after delivering the front of the message as NCCL does (a stamp there can name the cause).

def _p2p_sizes(world, sender_bigger):
    from overlap.dist.nccl_twin import SizeMismatch

    r = dist.get_rank()
    n = 6 if (r == 0) == sender_bigger else 4  # rank 0's size differs from everyone else's
    send, recv = torch.arange(1.0, n + 1), torch.zeros(n)
    t0 = time.monotonic()
    try:
        for w in _batch([(dist.isend, send, (r + 1) % world),
                         (dist.irecv, recv, (r - 1) % world)]):
            w.wait(timeout=SHORT)
    except SizeMismatch as exc:
        return "size", str(exc), time.monotonic() - t0, recv.tolist()
    return "ok", recv.tolist(), time.monotonic() - t0, recv.tolist()


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("sender_bigger", (True, False))
def test_p2p_size_disagreement_raises_on_both_sides(world, sender_bigger):
    res = run_ranks(_p2p_sizes, world, world, sender_bigger, backend="nccl_twin", timeout=30)
    # Rank 0 sends to rank 1 and receives from rank world-1: both pairs disagree.
    for r in (0, 1, world - 1):
        kind, msg, elapsed, got = res[r]
        assert kind == "size", (r, res[r])
        assert "bytes" in msg and elapsed < 2.0
    # The receiver holds what fit of the front of the message (as NCCL delivers it), then
    # poison (NaN): rank 1 receives rank 0's message, rank 0 rank world-1's.
    for r, sent in ((1, 6 if sender_bigger else 4), (0, 4 if sender_bigger else 6)):
        got = res[r][3]
        front = min(sent, len(got))
        assert got[:front] == [float(i) for i in range(1, front + 1)], (r, got)
        assert all(v != v for v in got[front:]), (r, got)
    for r in range(2, world - 1):  # pairs of equal sizes are untouched
        assert res[r][0] == "ok" and res[r][1] == [float(i) for i in
                                                   range(1, (4 if sender_bigger else 6) + 1)]


def _collective_sizes(kind):
    from overlap.dist.nccl_twin import SizeMismatch

    r, world = dist.get_rank(), dist.get_world_size()
    n = 8 if r == 1 else 4
    t0 = time.monotonic()
    try:
        if kind == "all_reduce":
            dist.all_reduce(torch.ones(n))
        elif kind == "all_gather":
            dist.all_gather_into_tensor(torch.empty(world * n), torch.ones(n))
        elif kind == "all_to_all":
            dist.all_to_all_single(torch.empty(world * n), torch.ones(world * n))
        else:
            dist.reduce_scatter_tensor(torch.empty(n), torch.ones(world * n))
    except SizeMismatch as exc:
        later = None
        try:
            dist.all_reduce(torch.ones(1))
        except Exception as again:  # noqa: BLE001 - a failed communicator stays failed
            later = str(again)
        return str(exc), time.monotonic() - t0, later
    return None


@pytest.mark.parametrize("kind", ("all_reduce", "all_gather", "all_to_all", "reduce_scatter"))
@pytest.mark.parametrize("world", (2, 4))
def test_collective_size_disagreement_raises_on_every_rank(kind, world):
    for msg, elapsed, later in run_ranks(_collective_sizes, world, kind, backend="nccl_twin",
                                         timeout=30):
        assert "ranks disagree on the sizes" in msg and "rank 1:" in msg and elapsed < 2.0
        assert later is not None and "failed earlier" in later


def _uneven_all_to_all():
    r, world = dist.get_rank(), dist.get_world_size()
    # rank r sends r + j + 1 elements to rank j: legal uneven splits must still pass
    send_splits = [r + j + 1 for j in range(world)]
    recv_splits = [j + r + 1 for j in range(world)]
    out = torch.empty(sum(recv_splits))
    dist.all_to_all_single(out, torch.full((sum(send_splits),), float(r)), recv_splits,
                           send_splits)
    return out.tolist()


def test_uneven_all_to_all_with_matching_splits_runs():
    res = run_ranks(_uneven_all_to_all, 2, backend="nccl_twin", timeout=30)
    assert res[0] == [0.0] * 1 + [1.0] * 2 and res[1] == [0.0] * 2 + [1.0] * 3
