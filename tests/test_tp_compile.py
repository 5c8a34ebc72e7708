"""The functional fused ops under torch.compile(fullgraph=True) equal eager: every op x CPU
backend x gradient pattern (both inputs trainable, only x (frozen weight), only w (input
without grad), and all_gather_matmul's gathered output used downstream), world 2 and 4.
Outputs and gradients within 1e-6 relative: the compiled graph calls the same implementation
(through its custom op), so the only difference allowed is none at all in fp32; 1e-6 leaves
room for a compiled elementwise epilogue that fuses differently. The group= form compiles too
(its default communicator shared with eager), and a later call whose ranks disagree still
raises on every rank when compiled: the stamps run inside the op."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

pytestmark = pytest.mark.no_delay_pass("compiled runs of the ops test_tp_ops_numerics runs delayed")

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
PATTERNS = ("both", "x_only", "w_only", "gathered_used")
K, N = 16, 12


def _loss(opname, pattern, **where):
    """``where``: comm=, or group= and backend= (the group's default communicator)."""
    from overlap import tp

    fn = getattr(tp, opname)

    def loss(x, w):
        if pattern == "gathered_used":
            y, gathered = fn(x, w, **where, return_gathered=True)
            # The gathered input feeds another product: its gradient must reach x.
            return (y.relu() ** 2).sum() + (gathered.sin() * 0.5).sum()
        return (fn(x, w, **where).relu() ** 2).sum()
    return loss


def _grads(loss, x, w):
    x = x.detach().requires_grad_(x.requires_grad)
    w = w.detach().requires_grad_(w.requires_grad)
    out = loss(x, w)
    out.backward()
    return out.detach(), x.grad, w.grad


def _compare(opname, pattern, *, compiled_first=False, **where):
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    rows = 3 * world if opname != "all_gather_matmul" else 3
    x = torch.randn(rows, 2, K, generator=g)  # 3-D sequence-first, as layers pass it
    w = torch.randn(K, N, generator=g) / K ** 0.5
    x.requires_grad_(pattern != "w_only")
    w.requires_grad_(pattern != "x_only")
    loss = _loss(opname, pattern, **where)
    compiled_loss = torch.compile(loss, fullgraph=True, backend="aot_eager")
    if compiled_first:
        compiled = _grads(compiled_loss, x, w)
        eager = _grads(loss, x, w)
    else:
        eager = _grads(loss, x, w)
        compiled = _grads(compiled_loss, x, w)
    worst = 0.0
    for a, b in zip(eager, compiled):
        assert (a is None) == (b is None)
        if a is not None:
            worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item())
    return worst, [t is not None for t in eager[1:]]


def _every_case(backend):
    """Every op and gradient pattern on one communicator (one launch per backend)."""
    from overlap import tp

    comm = tp.TPComm(dist.group.WORLD, backend=backend, timeout=60)
    out = {(op, p): _compare(op, p, comm=comm) for op in OPS for p in PATTERNS
           if p != "gathered_used" or op == "all_gather_matmul"}  # return_gathered is AG's
    comm.close()
    return out


@pytest.mark.parametrize("backend", ("chunked", "symmetric", "unfused", "triton"))
@pytest.mark.parametrize("world", (2, 4))
def test_compiled_functional_ops_equal_eager(world, backend):
    for per_case in run_ranks(_every_case, world, backend, timeout=600):
        assert len(per_case) == 10
        for (opname, pattern), (worst, has) in per_case.items():
            assert worst <= 1e-6, (opname, pattern, worst)
            assert has == [pattern != "w_only", pattern != "x_only"], (opname, pattern)


def _group_form(backend):
    """The ``group=`` form, compiled before any eager call: the default communicator is made
    while torch.compile traces, and eager then finds the same one."""
    from overlap import tp

    g = dist.group.WORLD
    out = {}
    for op in OPS:
        for p in ("both", "gathered_used") if op == "all_gather_matmul" else ("both",):
            out[(op, p)] = _compare(op, p, compiled_first=True, group=g, backend=backend)
    from overlap.tp.comm import default_comm

    comm = default_comm(g, backend=backend)
    calls = comm.agree.calls if comm.agree is not None else None
    tp.close_default_comms()
    # A compiled function keeps the communicator it traced: once closed, it says so.
    x = torch.randn(2 * dist.get_world_size(), K)
    f = torch.compile(lambda x, w: tp.matmul_all_reduce(x, w, group=g, backend=backend),
                      fullgraph=True, backend="aot_eager")
    f(x, torch.randn(K, N))  # traced (a new default communicator) and run
    tp.close_default_comms()
    try:
        f(x, torch.randn(K, N))
        closed = None
    except tp.TPCommFailed as exc:
        closed = str(exc)
    return out, calls, closed


@pytest.mark.parametrize("backend", ("chunked", "symmetric", "unfused"))
@pytest.mark.parametrize("world", (2, 4))
def test_group_form_compiles_and_shares_the_default_comm(world, backend):
    for per_case, calls, closed in run_ranks(_group_form, world, backend, timeout=600):
        for (opname, pattern), (worst, has) in per_case.items():
            assert worst <= 1e-6, (opname, pattern, worst)
            assert has == [True, True], (opname, pattern)
        # Calls on the one default communicator, each case compiled and eager: AG 2 (forward,
        # dgrad's reduce-scatter), AG with the gathered output used 3 (+ its reduce-scatter),
        # RS 2 (+ dgrad's all-gather), AR 1 (no backward communication): 2 x 8. Had compiled
        # and eager each made their own communicator, this one would count 8.
        assert calls == 16, calls
        assert closed is not None and "closed" in closed and "torch._dynamo.reset" in closed


def _group_form_later_disagreement():
    """Call 1 agrees; on call 2 rank 1 passes more rows. Both calls run compiled in the
    group= form (rank 1 recompiles for its new shape, its peer does not)."""
    from overlap import tp
    from overlap.dist.stamp import Disagreement

    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD
    f = torch.compile(lambda x, w: tp.matmul_all_reduce(x, w, group=g, backend="chunked"),
                      fullgraph=True, backend="aot_eager")
    w = torch.randn(K, N, generator=torch.Generator().manual_seed(1))
    x = torch.randn(2 * world, K, generator=torch.Generator().manual_seed(2 + rank))
    every = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(every, x)
    first_err = (f(x, w) - sum(every) @ w).abs().max().item()
    x2 = torch.randn((3 if rank == 1 else 2) * world, K)
    try:
        f(x2, w)
        msg = None
    except Disagreement as exc:
        msg = str(exc)
    tp.close_default_comms()
    return first_err, msg


@pytest.mark.parametrize("world", (2, 4))
def test_group_form_compiled_later_disagreement_raises_on_every_rank(world):
    for rank, (first_err, msg) in enumerate(run_ranks(_group_form_later_disagreement, world,
                                                      timeout=300)):
        assert first_err <= 1e-5 * K, (rank, first_err)  # fp32 sums of K products, |x|,|w|~1
        assert msg is not None, f"rank {rank} returned from a call its peers disagreed on"
        assert "matmul_all_reduce" in msg and "call 2" in msg and "x shape" in msg, msg
