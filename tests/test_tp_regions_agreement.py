"""Per-call agreement of the TP region collectives (overlap.nn.regions) and of the column
layer's dgrad all-reduce: a rank that skips one or makes an extra one pairs with its peers' next
collective; the stamps in that collective make every rank raise Disagreement naming the op
instead of mixing the data (before: silent wrong values, then a timeout). A size change on
plain gloo raises on every rank instead of aborting the process, and a failed communicator
refuses every later region call. Agreeing calls match the unsharded reference."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, run_ranks_outcomes

pytestmark = pytest.mark.numerics("its sums are held to a rounding bound derived from the "
                                   "summation order, (W - 1) 2^-23 max sum |term|")

WORLDS = (2, 4)


def _comm(timeout=5.0):
    from overlap import tp

    return tp.TPComm(dist.group.WORLD, backend="chunked", timeout=timeout)


def _reference_calls(kw, rank, world):
    """Every region function forward and backward on uneven and even shards, against the
    values computed from every rank's inputs (same seed everywhere). Returns the largest error
    over its bound: gathers and splits move bytes (exact); a sum of world float32 terms in
    another order differs by at most (world - 1) roundings, each at most eps32 times the
    largest partial sum, which the sum of the terms' magnitudes bounds."""
    from overlap.nn import regions

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 4 * world, 3, generator=g) for _ in range(world)]
    dys = [torch.randn(2, 4 * world, 3, generator=g) for _ in range(world)]
    errs = []

    x = xs[rank].clone().requires_grad_()
    y = regions.reduce_from_tp(x, **kw)
    y.backward(dys[0])
    errs += [(y - sum(xs)).abs().max(), (x.grad - dys[0]).abs().max()]

    x = xs[0].clone().requires_grad_()
    y = regions.copy_to_tp(x, **kw)
    y.backward(dys[rank])
    errs += [(y - xs[0]).abs().max(), (x.grad - sum(dys)).abs().max()]

    sizes = [1 + r % 2 for r in range(world)]  # uneven shards along dim 1
    start = sum(sizes[:rank])
    full = torch.cat([xs[r][:, :sizes[r]] for r in range(world)], 1)
    x = xs[rank][:, :sizes[rank]].clone().requires_grad_()
    y = regions.gather_from_tp(x, 1, sizes=sizes, **kw)
    y.backward(dys[0][:, :sum(sizes)])
    errs += [(y - full).abs().max(),
             (x.grad - dys[0][:, start:start + sizes[rank]]).abs().max()]

    x = xs[0][:, :sum(sizes)].clone().requires_grad_()
    y = regions.scatter_to_tp(x, 1, sizes=sizes, **kw)
    y.backward(dys[rank][:, :sizes[rank]])
    want = torch.cat([dys[r][:, :sizes[r]] for r in range(world)], 1)
    errs += [(y - xs[0][:, start:start + sizes[rank]]).abs().max(), (x.grad - want).abs().max()]

    n = 4  # even sequence shards along dim 1 (t = 4 * world)
    x = xs[rank].clone().requires_grad_()
    y = regions.reduce_scatter_to_sp(x, 1, **kw)
    y.backward(dys[rank][:, :n])
    want = torch.cat([dys[r][:, :n] for r in range(world)], 1)
    errs += [(y - sum(xs)[:, rank * n:(rank + 1) * n]).abs().max(), (x.grad - want).abs().max()]

    x = xs[rank][:, :n].clone().requires_grad_()
    y = regions.gather_from_sp(x, 1, **kw)
    y.backward(dys[rank][:, :n * world])
    full = torch.cat([xs[r][:, :n] for r in range(world)], 1)
    errs += [(y - full).abs().max(),
             (x.grad - sum(d[:, :n * world] for d in dys)[:, rank * n:(rank + 1) * n]).abs().max()]
    bound = (world - 1) * 2.0**-23 * max(sum(t.abs() for t in xs).max(),
                                          sum(t.abs() for t in dys).max())
    return max(float(e) for e in errs) / float(bound)


def _extra_reduce(form):
    """Rank 0 calls reduce_from_tp once more; the others' next collective is copy_to_tp's
    backward all-reduce of the same size, which it pairs with."""
    from overlap.dist.stamp import Disagreement
    from overlap.nn import regions
    from overlap.tp.comm import TPCommFailed

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = _comm()
    kw = {"comm": comm} if form == "comm" else {"group": dist.group.WORLD, "timeout": 5.0}
    err = _reference_calls(kw, rank, world)
    x = torch.full((4, 3), float(rank + 1))
    try:
        regions.reduce_from_tp(x, **kw)
        if rank == 0:
            regions.reduce_from_tp(x, **kw)
        else:
            p = torch.zeros(4, 3, requires_grad=True)
            regions.copy_to_tp(p, **kw).sum().backward()
        return err, None, None
    except Disagreement as exc:
        msg = str(exc)
    try:
        regions.reduce_from_tp(x, **kw)
        later = None
    except TPCommFailed as exc:
        later = str(exc)
    return err, msg, later


@pytest.mark.parametrize("form", ("comm", "group"))
@pytest.mark.parametrize("world", WORLDS)
def test_extra_region_call_raises_on_every_rank(world, form):
    """Before: rank 0's second reduce_from_tp summed with its peers' copy_to_tp gradients and
    every rank returned. Now every rank raises naming both ops, and the communicator stays
    failed. The agreeing calls before it match the reference."""
    for rank, (err, msg, later) in enumerate(run_ranks(_extra_reduce, world, form, timeout=60)):
        assert err <= 1.0, (rank, err)
        assert msg is not None, f"rank {rank} returned from a call its peers did not make"
        assert "reduce_from_tp" in msg and "copy_to_tp backward" in msg, msg
        assert later is not None and "failed earlier" in later, (rank, later)


def _skipped_dgrad(shared):
    """Two column layers of equal width; on rank 0 layer A's input needs no gradient, so its
    dgrad all-reduce runs on the other ranks only and pairs with rank 0's one of layer B."""
    from overlap.dist.stamp import Disagreement
    from overlap.nn import ColumnParallelLinear
    from overlap.nn.layers import column_parallel_shared

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = _comm()
    torch.manual_seed(0)
    a = ColumnParallelLinear(8, 4 * world, comm=comm)
    b = ColumnParallelLinear(8, 4 * world, comm=comm)
    xa = torch.randn(2, 3, 8, requires_grad=rank != 0)
    xb = torch.randn(2, 3, 8, requires_grad=True)
    yb = b(xb)
    # A's forward runs last, so its backward runs first (autograd: newest node first).
    ya = column_parallel_shared(xa, [a]) if shared else [a(xa)]
    try:
        ((ya[0] ** 2).sum() + (yb ** 2).sum()).backward()
        return None
    except Disagreement as exc:
        return str(exc)


@pytest.mark.parametrize("shared", (False, True))
@pytest.mark.parametrize("world", WORLDS)
def test_skipped_column_dgrad_raises_on_every_rank(world, shared):
    """Before: the other ranks' dx of layer A was summed with rank 0's dx of layer B (silent),
    then their dgrad of B waited out the timeout. The stamps carry the layer's number."""
    for rank, msg in enumerate(run_ranks(_skipped_dgrad, world, shared, timeout=60)):
        assert msg is not None, f"rank {rank}: backward returned"
        assert "ColumnParallelLinear dgrad all_reduce" in msg, msg
        assert "ranks disagree on flags" in msg, msg  # the layer number


def _size_change(op):
    from overlap.dist.stamp import Disagreement
    from overlap.nn import regions

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = _comm(timeout=20.0)
    err = _reference_calls({"comm": comm}, rank, world)
    rows = 4 * world * (2 if rank == 1 else 1)  # rank 1 sends twice as much
    x = torch.ones(2, rows, 3)
    try:
        if op == "gather_from_tp":
            regions.gather_from_tp(x, 1, comm=comm)
        elif op == "reduce_scatter_to_sp":
            regions.reduce_scatter_to_sp(x, 1, comm=comm)
        else:
            regions.reduce_from_tp(x, comm=comm)
        return err, None
    except Disagreement as exc:
        return err, str(exc)


@pytest.mark.parametrize("op", ("reduce_from_tp", "gather_from_tp", "reduce_scatter_to_sp"))
@pytest.mark.parametrize("world", WORLDS)
def test_size_change_on_plain_gloo_raises(world, op):
    """On plain gloo a message of another size aborts the process (before: rank 0 died with
    SIGABRT or got garbage); the stamps alone go first, so every rank raises and lives."""
    outcomes = run_ranks_outcomes(_size_change, world, op, timeout=60, backend="gloo")
    for o in outcomes:
        assert o.status == "ok", (o.rank, o.status, o.exitcode, o.error)
        err, msg = o.value
        assert err <= 1.0, (o.rank, err)
        assert msg is not None and op in msg and "x shape" in msg, (o.rank, msg)


def _after_failure():
    from overlap.nn import regions
    from overlap.tp.comm import TPCommFailed

    comm = _comm()
    comm.fail(RuntimeError("an earlier op failed"))
    out = []
    for call in (lambda: regions.reduce_from_tp(torch.ones(3), comm=comm),
                 lambda: regions.gather_from_sp(torch.ones(3), 0, comm=comm)):
        try:
            call()
            out.append(None)
        except TPCommFailed as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_failed_comm_refuses_region_calls(world):
    """A failure stays a failure: before, region collectives still ran on a failed TPComm."""
    for rank, msgs in enumerate(run_ranks(_after_failure, world, timeout=60)):
        assert all(m is not None and "an earlier op failed" in m for m in msgs), (rank, msgs)
