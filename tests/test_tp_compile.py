"""The functional fused ops under torch.compile(fullgraph=True) equal eager: every op x CPU
backend x gradient pattern (both inputs trainable, only x (frozen weight), only w (input
without grad), and all_gather_matmul's gathered output used downstream), world 2 and 4.
Outputs and gradients within 1e-6 relative: the compiled graph calls the same implementation
(through its custom op), so the only difference allowed is none at all in fp32; 1e-6 leaves
room for a compiled elementwise epilogue that fuses differently."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
PATTERNS = ("both", "x_only", "w_only", "gathered_used")
K, N = 16, 12


def _loss(opname, comm, pattern):
    from overlap import tp

    fn = getattr(tp, opname)

    def loss(x, w):
        if pattern == "gathered_used":
            y, gathered = fn(x, w, comm=comm, return_gathered=True)
            # The gathered input feeds another product: its gradient must reach x.
            return (y.relu() ** 2).sum() + (gathered.sin() * 0.5).sum()
        return (fn(x, w, comm=comm).relu() ** 2).sum()
    return loss


def _grads(loss, x, w):
    x = x.detach().requires_grad_(x.requires_grad)
    w = w.detach().requires_grad_(w.requires_grad)
    out = loss(x, w)
    out.backward()
    return out.detach(), x.grad, w.grad


def _compare(comm, opname, pattern):
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    rows = 3 * world if opname != "all_gather_matmul" else 3
    x = torch.randn(rows, 2, K, generator=g)  # 3-D sequence-first, as layers pass it
    w = torch.randn(K, N, generator=g) / K ** 0.5
    x.requires_grad_(pattern != "w_only")
    w.requires_grad_(pattern != "x_only")
    loss = _loss(opname, comm, pattern)
    eager = _grads(loss, x, w)
    compiled = _grads(torch.compile(loss, fullgraph=True, backend="aot_eager"), x, w)
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
    out = {(op, p): _compare(comm, op, p) for op in OPS for p in PATTERNS
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
