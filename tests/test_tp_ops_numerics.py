"""overlap.tp.ops: every op x backend equals its unfused reference, forward and backward, on
1, 2 and 4 gloo ranks, 2-D and 3-D (sequence-first and batch-first), fp32 and bf16, awkward
shapes (M = 12 * world, K = 72, N = 40; M = 12 * world - 1 for all-reduce).

References are computed on every rank in float64 from the full (all ranks') tensors, rounded
to the test dtype first, with gradients from the analytic equations of the ops' docstrings.
Tolerances (max |got - ref| / max |ref|): fp32 1e-5; bf16 2e-2 (outputs are rounded to bf16,
2^-8 relative, and chunked reduce-scatter rounds partial sums at every ring hop).
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist

from harness import WORLD_SIZES, gpu_world, requires_gpu, run_ranks
from overlap.dist.device import gpu_for_rank

HAVE_TRITON_TP = importlib.util.find_spec("overlap.kernels.triton.tp_gemm") is not None
BACKENDS = ["chunked", "symmetric", "unfused"] + (["triton"] if HAVE_TRITON_TP else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.detach().cpu().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _case_ag(backend, dtype, shape3, chunks, with_gathered, k, n, seq_dim=0, m=12, dev="cpu",
             frozen_w=False, gathered_only=False):
    """``frozen_w``: w needs no gradient (dw is not computed, the gathered input is not saved
    for it); ``gathered_only``: only the gathered output reaches the loss (dy is None)."""
    from overlap.tp import all_gather_matmul

    g, r, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234 + world)
    q = lambda t: t.to(dtype).double()  # noqa: E731 - inputs as the op sees them
    xf = q(torch.randn(world * m, k, generator=gen, dtype=torch.float64))
    ws = q(torch.randn(world, k, n, generator=gen, dtype=torch.float64))
    gs = q(torch.randn(world, world * m, n, generator=gen, dtype=torch.float64))
    hs = q(torch.randn(world, world * m, k, generator=gen, dtype=torch.float64))
    x_shard = xf[r * m:(r + 1) * m]
    to3 = lambda t, rows: t.view(rows // 4, 4, t.shape[-1]) if shape3 else t  # noqa: E731
    x_in = to3(x_shard, m).to(dev, dtype)
    if seq_dim == 1:
        x_in = x_in.transpose(0, 1).contiguous()
    x_in.requires_grad_(True)
    w = ws[r].to(dev, dtype).requires_grad_(not frozen_w)
    out = all_gather_matmul(x_in, w, group=g, backend=backend, chunks=chunks,
                            return_gathered=with_gathered, seq_dim=seq_dim)
    y, gathered = out if with_gathered else (out, None)
    back = (lambda t: t.transpose(0, 1)) if seq_dim == 1 else (lambda t: t)  # noqa: E731
    dy = back(to3(gs[r], world * m).to(dev, dtype))
    if with_gathered:
        dgath = back(to3(hs[r], world * m).to(dev, dtype))
        if gathered_only:
            gathered.backward(dgath)
        else:
            torch.autograd.backward([y, gathered], [dy, dgath])
    else:
        y.backward(dy)
    flat = lambda t: back(t).reshape(-1, t.shape[-1])  # noqa: E731
    dx_full = (hs.sum(0) if gathered_only else
               sum(gs[p] @ ws[p].T for p in range(world)) + (hs.sum(0) if with_gathered else 0))
    errs = {"y": _rel(flat(y), xf @ ws[r]),
            "dx": _rel(flat(x_in.grad), dx_full[r * m:(r + 1) * m])}
    if frozen_w:
        assert w.grad is None
    else:
        errs["dw"] = _rel(w.grad, xf.T @ gs[r])
    if with_gathered:
        errs["gathered"] = _rel(flat(gathered), xf)
    return errs


def _case_rs(backend, dtype, shape3, chunks, k, n, seq_dim=0, m=12, dev="cpu"):
    from overlap.tp import matmul_reduce_scatter

    g, r, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(99 + world)
    q = lambda t: t.to(dtype).double()  # noqa: E731
    xs = q(torch.randn(world, world * m, k, generator=gen, dtype=torch.float64))
    ws = q(torch.randn(world, k, n, generator=gen, dtype=torch.float64))
    gf = q(torch.randn(world * m, n, generator=gen, dtype=torch.float64))
    to3 = lambda t, rows: t.view(rows // 4, 4, t.shape[-1]) if shape3 else t  # noqa: E731
    back = (lambda t: t.transpose(0, 1)) if seq_dim == 1 else (lambda t: t)  # noqa: E731
    x = back(to3(xs[r], world * m).to(dev, dtype)).contiguous().requires_grad_(True)
    w = ws[r].to(dev, dtype).requires_grad_(True)
    y = matmul_reduce_scatter(x, w, group=g, backend=backend, chunks=chunks, seq_dim=seq_dim)
    y.backward(back(to3(gf[r * m:(r + 1) * m], m).to(dev, dtype)))
    flat = lambda t: back(t).reshape(-1, t.shape[-1])  # noqa: E731
    total = sum(xs[p] @ ws[p] for p in range(world))
    return {"y": _rel(flat(y), total[r * m:(r + 1) * m]),
            "dx": _rel(flat(x.grad), gf @ ws[r].T),
            "dw": _rel(w.grad, xs[r].T @ gf)}


def _case_ar(backend, dtype, shape3, chunks, k, n, m=12, dev="cpu"):
    from overlap.tp import matmul_all_reduce

    g, r, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7 + world)
    rows = m * world if shape3 else m * world - 1  # 3-D: [m*world/4, 4, K]; 2-D: awkward M
    q = lambda t: t.to(dtype).double()  # noqa: E731
    xs = q(torch.randn(world, rows, k, generator=gen, dtype=torch.float64))
    ws = q(torch.randn(world, k, n, generator=gen, dtype=torch.float64))
    gf = q(torch.randn(rows, n, generator=gen, dtype=torch.float64))
    to3 = lambda t: t.view(rows // 4, 4, t.shape[-1]) if shape3 else t  # noqa: E731
    x = to3(xs[r]).to(dev, dtype).requires_grad_(True)
    w = ws[r].to(dev, dtype).requires_grad_(True)
    y = matmul_all_reduce(x, w, group=g, backend=backend, chunks=chunks)
    y.backward(to3(gf).to(dev, dtype))  # the same dy on every rank (replicated downstream)
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    return {"y": _rel(flat(y), sum(xs[p] @ ws[p] for p in range(world))),
            "dx": _rel(flat(x.grad), gf @ ws[r].T),
            "dw": _rel(w.grad, xs[r].T @ gf)}


def _cases(world, mode):
    """(op, dtype, 3-D?, chunks, kwargs) for mode "cpu", "small" (Triton interpreter) or "gpu"."""
    f32, bf16 = torch.float32, torch.bfloat16
    if mode == "small":  # the interpreter is slow: one case per op and layout, dtypes alternating
        kw = dict(k=40, n=24)
        return [("ag", f32, False, None, dict(with_gathered=False, **kw)),
                ("ag", bf16, True, None, dict(with_gathered=True, **kw)),
                ("rs", f32, True, None, kw), ("rs", bf16, False, None, kw),
                ("ar", f32, False, None, kw),
                ("ag", f32, False, None, dict(with_gathered=False, frozen_w=True, **kw))]
    kw = dict(k=72, n=40) if mode == "cpu" else dict(k=72 * 16, n=40 * 16, m=12 * 16)
    out = []
    for dtype in (f32, bf16):
        for shape3 in (False, True):
            for chunks in (None, 2 * world):
                out.append(("ag", dtype, shape3, chunks, dict(with_gathered=shape3, **kw)))
                out.append(("rs", dtype, shape3, chunks, kw))
                out.append(("ar", dtype, shape3, 3 if chunks else None, kw))
    # frozen weight: the gathered input is kept only when returned
    out.append(("ag", f32, False, None, dict(with_gathered=False, frozen_w=True, **kw)))
    out.append(("ag", f32, True, None, dict(with_gathered=True, frozen_w=True, **kw)))
    out.append(("ag", f32, False, None, dict(with_gathered=True, frozen_w=True,
                                             gathered_only=True, **kw)))
    # batch-first 3-D through seq_dim=1
    out.append(("ag", f32, True, None, dict(with_gathered=True, seq_dim=1, **kw)))
    out.append(("rs", f32, True, None, dict(seq_dim=1, **kw)))
    return out


def _run_cases(backend, mode):
    from overlap.tp import close_default_comms

    world, dev = dist.get_world_size(), "cpu"
    if mode == "gpu":
        dev = gpu_for_rank()
    fns = {"ag": _case_ag, "rs": _case_rs, "ar": _case_ar}
    results = []
    try:
        for op, dtype, shape3, chunks, kw in _cases(world, mode):
            errs = fns[op](backend, dtype, shape3, chunks, dev=dev, **kw)
            results.append((op, str(dtype), shape3, chunks, kw.get("seq_dim", 0), errs))
    finally:
        close_default_comms()
    return results


def _check(per_rank):
    for rank, results in enumerate(per_rank):
        for op, dtype, shape3, chunks, seq_dim, errs in results:
            tol = TOL[getattr(torch, dtype.split(".")[1])]
            bad = {k: v for k, v in errs.items() if not v <= tol}
            assert not bad, (f"rank {rank} {op} {dtype} {'3-D' if shape3 else '2-D'} "
                             f"chunks={chunks} seq_dim={seq_dim}: {bad} > {tol}")


@pytest.mark.parametrize("backend", ["chunked", "symmetric", "unfused"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ops_match_reference_forward_and_backward(world, backend):
    _check(run_ranks(_run_cases, world, backend, "cpu", timeout=120))


# The Triton kernels run under TRITON_INTERPRET=1 across processes: small shapes only.
# GPU-sized cases belong to the GPU tier (their CPU twin is this test).
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "triton"])
def test_triton_ops_match_reference_small(world, backend):
    _check(run_ranks(_run_cases, world, backend, "small", timeout=300))


@requires_gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_match_reference_large_gpu(backend):
    """The GPU tier: 16x larger shapes on every visible GPU under NCCL (CUDA workspaces, side
    copy stream, compiled Triton kernels). CPU twins: the two tests above."""
    world = gpu_world(most=8)
    _check(run_ranks(_run_cases, world, backend, "gpu", backend="nccl", timeout=600))


def _all_reduce_bytes(backend):
    from overlap.tp import TPComm, matmul_all_reduce

    g, r, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (12 * world, 12 * world - 1):
            for chunks in (1, world, 3, 2 * world):
                gen = torch.Generator().manual_seed(rows * 10 + chunks + r)
                x = torch.randn(rows, 72, generator=gen).to(dtype)
                w = torch.randn(72, 40, generator=gen).to(dtype)
                with TPComm(g, backend=backend, chunks=chunks) as comm:
                    y = matmul_all_reduce(x, w, comm=comm)
                every = [torch.empty_like(y) for _ in range(world)]
                dist.all_gather(every, y.contiguous(), group=g)
                ref = sum(a.double() @ b.double() for a, b in _every(x, w, g, world))
                out.append((str(dtype), rows, chunks,
                            all(torch.equal(e, every[0]) for e in every), _rel(y, ref)))
    return out


def _every(x, w, g, world):
    xs, ws = [torch.empty_like(x) for _ in range(world)], [torch.empty_like(w) for _ in range(world)]
    dist.all_gather(xs, x, group=g)
    dist.all_gather(ws, w, group=g)
    return list(zip(xs, ws))


@pytest.mark.parametrize("backend", ["chunked", "symmetric", "unfused"])
@pytest.mark.parametrize("world", (2, 4))
def test_all_reduce_leaves_the_same_bytes_on_every_rank(world, backend):
    # chunked at world 2 exchanges whole partial products (each rank adds the peer's block to
    # its own: a + b, the same operands on both ranks), at world 4 it reduces in a ring.
    for rank, rows in enumerate(run_ranks(_all_reduce_bytes, world, backend, timeout=120)):
        for dtype, m, chunks, same, rel in rows:
            assert same, (rank, dtype, m, chunks)
            assert rel <= (1e-5 if dtype == "torch.float32" else 2e-2), (rank, dtype, m, chunks,
                                                                          rel)


def _exchange_big(backend):
    from overlap.tp import TPComm, matmul_all_reduce

    g, r = dist.group.WORLD, dist.get_rank()
    out = []
    for chunks in (2, 4):  # one block, then two (the copier's path on symmetric)
        with TPComm(g, backend=backend, chunks=chunks) as comm:
            for call in range(4):  # phases 1-4: both halves of the buffer, each refilled once
                gen = torch.Generator().manual_seed(100 * call + chunks + r)
                x = torch.randn(512, 64, generator=gen)
                w = torch.randn(64, 2048, generator=gen)
                y = matmul_all_reduce(x, w, comm=comm)
                ref = sum(a.double() @ b.double() for a, b in _every(x, w, g, 2))
                out.append((chunks, call, _rel(y, ref)))
    return out


@pytest.mark.parametrize("backend", ["chunked", "symmetric"])
def test_two_rank_exchange_adds_only_finished_blocks(backend):
    # A 4 MiB partial per rank: its copy takes long enough that a peer reading a block before
    # it is complete (a READY signalled before the copy, an ACK not waited for) reads stale or
    # zero rows, far outside the fp32 bound (K = 64 products and one addition per element).
    for rank, rows in enumerate(run_ranks(_exchange_big, 2, backend, timeout=120)):
        for chunks, call, rel in rows:
            assert rel <= 1e-5, (rank, chunks, call, rel)
