"""Quantized collectives on 1, 2 and 4 gloo ranks: results vs the exact fp64 reduction within the
documented bounds (overlap/comm/quant/__init__.py), bit-exact vs a single-process simulation
built from the reference kernels, identical on every rank, NaN/Inf handling, error feedback,
async ordering and bytes on the wire. Input validation, the comm_dtype vocabulary and the
import paths are in test_quant_api.py; failures (a refused call, a dead or stalled peer, group
lifetime) in test_quant_failures.py."""

import math

import pytest
import torch
import torch.distributed as dist

from overlap.comm import quant
from overlap.comm.quant import kernels as qk, paths, work
from tests.harness import WORLD_SIZES, run_ranks

F64 = torch.float64
OUT_REL = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
OUT_ABS = {torch.float32: 0.0, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}


def _np(t):
    """Tensors leave a rank as numpy (a torch tensor is pickled as a shared-memory handle that
    dies with the rank process); bf16 widens to fp32 exactly."""
    return (t.float() if t.dtype == torch.bfloat16 else t).detach().numpy().copy()


def _t(a):
    return torch.from_numpy(a)


def _inputs(n, numel, dtype, seed):
    """Every rank's input (so any rank can compute the exact result): heavy-tailed magnitudes,
    a different scale per rank."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))
          * 10.0 ** (r - 1) for r in range(n)]
    return [x.clamp(-6e4, 6e4).to(dtype) for x in xs]


def _absmax(xs, m, block):
    """Per-element absmax of its quantization block, rows of m elements padded to whole blocks:
    xs [n_src, N] float64 -> [n_src, N]."""
    n_src, N = xs.shape
    rows = -(-N // m)
    L = -(-m // block) * block
    flat = torch.zeros(n_src, rows * m, dtype=F64)
    flat[:, :N] = torch.where(torch.isfinite(xs), xs.abs(), 0.0)
    grid = torch.zeros(n_src, rows, L, dtype=F64)
    grid[:, :, :m] = flat.view(n_src, rows, m)
    M = grid.view(n_src, rows, L // block, block).amax(-1).repeat_interleave(block, -1)
    return M[:, :, :m].reshape(n_src, -1)[:, :N]


def _Q(M, stochastic):
    # One quantization of a block with absmax M (quant.py); stochastic rounding: a full step.
    q = M / 254 + M * 2.0**-21 + 2.0**-118
    return 2 * q if stochastic else q


def _bound(opname, comm, xs, n, avg, block, stochastic, dtype):
    """The documented per-element bound, xs [n, N] float64 (all_gather: [n, m])."""
    A = xs.abs().sum(0)
    if comm == "int8" and opname == "all_gather":
        b = _Q(_absmax(xs, xs.shape[1], block), stochastic).reshape(-1)
        return b + OUT_REL[dtype] * (xs.abs().reshape(-1) + b) + OUT_ABS[dtype]
    if opname == "all_gather":
        rel = 2.0**-8 if comm == "bf16" else 0.0  # bf16 unit roundoff
        return (rel * xs.abs() + (2.0**-133 if comm != "fp32" else 0.0)).reshape(-1)
    m = -(-xs.shape[1] // n)
    if comm == "int8":
        M = _absmax(xs, m, block)
        S = M.sum(0)
        b = _Q(M, stochastic).sum(0) + n * 2.0**-23 * S
        if opname == "all_reduce":
            b = b + _Q(S * (1 + 2.0**-7) + n * 2.0**-118, stochastic)
    elif comm == "bf16":
        casts = 2 if opname == "all_reduce" else 1
        b = (casts * 2.0**-8 * 1.01 + n * 2.0**-22) * A + 2.0**-132
    else:
        b = n * (2.0**-22 if dtype == torch.float32 else 4 * OUT_REL[dtype]) * A \
            + n * OUT_ABS[dtype]
    if avg:
        S = _absmax(xs, m, block).sum(0) if comm == "int8" else A
        b = b / n + 2.0**-23 * S / n + 2.0**-117
    exact = xs.sum(0) / (n if avg else 1)
    return b + OUT_REL[dtype] * (exact.abs() + b) + OUT_ABS[dtype]


CASES = [(opname, comm, dtype, avg, stochastic)
         for opname in ("all_reduce", "reduce_scatter", "all_gather")
         for comm in ("fp32", "bf16", "int8")
         for dtype in (torch.float32, torch.bfloat16, torch.float16)
         for avg in ((False, True) if opname != "all_gather" else (False,))
         for stochastic in ((False, True) if comm == "int8" else (False,))]


def _rank_accuracy(block):
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    failures, results = [], []
    for i, (opname, comm, dtype, avg, stochastic) in enumerate(CASES):
        shape = {"all_reduce": (9, 41), "reduce_scatter": (3 * n, 37), "all_gather": (5, 7)}[opname]
        xs = _inputs(n, math.prod(shape), dtype, seed=i)
        t = xs[rank].view(shape).clone()
        kw = dict(group=group, comm_dtype=comm, block_size=block, stochastic=stochastic, seed=i)
        if opname != "all_gather":
            kw["op"] = "avg" if avg else "sum"
        out = getattr(quant, opname)(t, **kw)
        stacked = torch.stack([x.to(F64) for x in xs])
        if opname == "all_gather":
            exact = stacked.reshape(-1)
        else:
            exact = stacked.sum(0) / (n if avg else 1)
            if opname == "reduce_scatter":
                m = exact.numel() // n
                exact = exact[rank * m:(rank + 1) * m]
        bound = _bound(opname, comm, stacked, n, avg, block, stochastic, dtype)
        if opname == "reduce_scatter":
            bound = bound[rank * m:(rank + 1) * m]
        err = (out.reshape(-1).to(F64) - exact).abs()
        if out.dtype != dtype or not (err <= bound).all():
            worst = int((err - bound).argmax())
            failures.append(f"{opname} {comm} {dtype} avg={avg} st={stochastic}: dtype "
                            f"{out.dtype}, err {err[worst]:.3e} > bound {bound[worst]:.3e} at "
                            f"{worst}")
        results.append(_np(out if opname != "reduce_scatter" else quant.all_gather(
            out, group=group)))
    return failures, results


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("block", [32, 128])
def test_within_documented_bound_and_identical_on_ranks(world_size, block):
    per_rank = run_ranks(_rank_accuracy, world_size, block)
    for failures, _ in per_rank:
        assert not failures, "\n".join(failures)
    first = per_rank[0][1]
    for _, results in per_rank[1:]:
        for a, b in zip(first, results):
            assert a.tobytes() == b.tobytes(), "ranks disagree on the result"


def _simulate_int8(opname, xs, n, block, divisor):
    """The two-shot algorithm in one process from the torch reference kernels."""
    N = xs[0].numel()
    m = {"all_reduce": -(-N // n), "reduce_scatter": N // n, "all_gather": N}[opname]
    L, C = paths.int8_geometry(m, block)
    rows = 1 if opname == "all_gather" else n
    sends = []
    for x in xs:
        buf = torch.empty(rows, C, dtype=torch.uint8)
        q, s = paths._views(buf, L)
        qk.quantize_into(x, q, s, block=block, flat_row=m, impl="torch")
        sends.append(buf)
    if opname == "all_gather":
        out = torch.empty(n * m)
        q, s = paths._views(torch.cat(sends), L)
        qk.dequantize_into(q, s, out, block=block, flat_row=m, impl="torch")
        return [out] * n
    shards = []
    for j in range(n):
        q, s = paths._views(torch.stack([b[j] for b in sends]), L)
        if opname == "reduce_scatter":
            y = torch.empty(L)
            qk.dequant_reduce_into(q, s, block=block, divisor=divisor, out=y, impl="torch")
            shards.append(y[:m])
        else:
            mine = torch.empty(1, C, dtype=torch.uint8)
            qo, so = paths._views(mine, L)
            qk.dequant_reduce_into(q, s, block=block, divisor=divisor, q_out=qo.view(-1),
                                   s_out=so.view(-1), impl="torch")
            shards.append(mine)
    if opname == "reduce_scatter":
        return shards
    out = torch.empty(N)
    q, s = paths._views(torch.cat(shards), L)
    qk.dequantize_into(q, s, out, block=block, flat_row=m, impl="torch")
    return [out] * n


def _rank_bitwise(numel, backend):
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    mismatches = []
    for i, opname in enumerate(("all_reduce", "reduce_scatter", "all_gather")):
        for avg in (False, True):
            N = numel * n if opname == "reduce_scatter" else numel
            xs = _inputs(n, N, torch.float32, seed=100 + i)
            kw = dict(group=group, comm_dtype="int8", block_size=64, impl=backend)
            if opname != "all_gather":
                kw["op"] = "avg" if avg else "sum"
            out = getattr(quant, opname)(xs[rank].clone(), **kw)
            want = _simulate_int8(opname, xs, n, 64, float(n) if avg else 1.0)[rank]
            if not torch.equal(out.view(-1).view(torch.int32), want.view(torch.int32)):
                mismatches.append(f"{opname} avg={avg}")
    return mismatches


@pytest.mark.parametrize("world_size,numel,backend",
                         [(2, 1000, "cpp"), (4, 3001, "cpp"), (4, 5, "cpp"), (2, 1000, "torch"),
                          (2, 300, "triton")])
def test_int8_bit_exact_vs_simulation(world_size, numel, backend):
    for mismatches in run_ranks(_rank_bitwise, world_size, numel, backend):
        assert not mismatches, f"not bit-exact vs the simulated two-shot algorithm: {mismatches}"


def _rank_rms(numel):
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    exact = torch.stack(xs).to(F64).sum(0)
    ar = quant.all_reduce(xs[rank].clone(), group=group, comm_dtype="int8").to(F64)
    rs = quant.reduce_scatter(xs[rank].clone(), group=group, comm_dtype="int8").to(F64)
    m = numel // n
    rel = lambda a, b: ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()  # noqa
    return rel(ar, exact), rel(rs, exact[rank * m:(rank + 1) * m])


def test_int8_relative_rms_4_ranks():
    # The documented figure: relative RMS error < 1e-2 for N(0,1) over 4 ranks (block 128).
    for ar, rs in run_ranks(_rank_rms, 4, 1 << 16):
        assert ar < 1e-2 and rs < 1e-2, (ar, rs)


def _rank_non_finite(block):
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    N = 4 * block * n + 3
    xs = _inputs(n, N, torch.float32, seed=7)
    bad = {0: (5, float("nan")), 1: (block + 2, float("inf"))}
    for r, (i, v) in bad.items():
        if r < n:
            xs[r][i] = v
    for x in xs:
        x[2 * block: 3 * block] = 0.0  # an all-zero block on every rank
    out = {}
    out["all_reduce"] = quant.all_reduce(xs[rank].clone(), group=group, comm_dtype="int8",
                                         block_size=block)
    out["reduce_scatter"] = quant.all_gather(quant.reduce_scatter(
        xs[rank][: N - N % n].clone(), group=group, comm_dtype="int8", block_size=block),
        group=group)
    out["all_gather"] = quant.all_gather(xs[rank].clone(), group=group, comm_dtype="int8",
                                         block_size=block)
    return {k: _np(v) for k, v in out.items()}, [i for r, (i, _) in bad.items() if r < n]


@pytest.mark.parametrize("world_size", [2, 4])
def test_non_finite_stays_non_finite_and_zero_blocks_exact(world_size):
    block = 32
    per_rank = run_ranks(_rank_non_finite, world_size, block)
    out, bad = per_rank[0]
    N = 4 * block * world_size + 3
    for name in ("all_reduce", "reduce_scatter"):
        r = _t(out[name])
        bad_mask = torch.zeros(r.numel(), dtype=torch.bool)
        bad_mask[bad] = True
        assert torch.isnan(r[bad_mask]).all(), name  # never silently finite
        assert torch.isfinite(r[~bad_mask]).all(), f"{name}: non-finite leaked to neighbours"
        assert (r[2 * block: 3 * block] == 0).all(), f"{name}: zero block not exact"
    g = _t(out["all_gather"]).view(world_size, N)
    assert torch.isnan(g[0, 5]) and torch.isnan(g[1, block + 2])
    assert torch.isfinite(g).sum() == g.numel() - len(bad)


def _ef_data(comm, n, N, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if comm == "int8":
        # One large element per 32-block: the 0.15s fall below half a step and round to 0.
        x = torch.full((N,), 0.15) + 0.01 * torch.randn(N, generator=g)
        x[::32] = 40.0
    else:
        # 1.0029 rounds down to 1.0 in bf16, every time.
        x = torch.full((N,), 1.0029) + 1e-5 * torch.randn(N, generator=g)
    return x


def _rank_error_feedback(comm, opname, steps):
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    N = 32 * 12 * n + 8
    if opname == "reduce_scatter":
        N -= N % n
    ef = quant.ErrorFeedback(N)
    acc_ef = acc_plain = exact = 0.0
    fn = getattr(quant, opname)
    for step in range(steps):
        xs = [_ef_data(comm, n, N, step, r) for r in range(n)]
        total = torch.stack(xs).to(F64).sum(0)
        if opname == "reduce_scatter":
            total = total[rank * (N // n):(rank + 1) * (N // n)]
        exact = exact + total
        kw = dict(group=group, comm_dtype=comm, block_size=32)
        acc_ef = acc_ef + fn(xs[rank].clone(), error_feedback=ef, **kw).to(F64)
        acc_plain = acc_plain + fn(xs[rank].clone(), **kw).to(F64)
    shard = ef.shard_residual if ef.shard_residual is not None else torch.zeros(0)
    return tuple(_np(t) for t in (acc_ef, acc_plain, exact, ef.residual, shard))


@pytest.mark.parametrize("comm,opname,world_size",
                         [("int8", "all_reduce", 2), ("int8", "all_reduce", 4),
                          ("bf16", "all_reduce", 4), ("int8", "reduce_scatter", 4)])
def test_error_feedback_accumulated_sum_converges(comm, opname, world_size):
    steps = 30
    per_rank = [tuple(_t(a) for a in r)
                for r in run_ranks(_rank_error_feedback, world_size, comm, opname, steps)]
    n = world_size
    for rank, (acc_ef, acc_plain, exact, _, _) in enumerate(per_rank):
        err_ef = (acc_ef - exact).abs().max().item()
        err_plain = (acc_plain - exact).abs().max().item()
        # Plain quantization drifts linearly in the step count; error feedback stays bounded
        # by the last residuals (one quantization step per rank plus the shard's).
        assert err_plain > 8 * err_ef, (rank, err_plain, err_ef)
    # The telescoping identity: sum_t result_t - sum_t exact_t = -(sum_r e_r + f_owner).
    acc_ef, _, exact, _, _ = per_rank[0]
    N = per_rank[0][3].numel()
    resid = torch.stack([p[3] for p in per_rank]).to(F64).sum(0)
    if opname == "all_reduce":
        m = -(-N // n)
        f = torch.cat([p[4][:m] for p in per_rank]).to(F64)[:N]
        predicted = -(resid + f)
    else:
        m = N // n
        predicted = -resid[:m]
    scale = exact.abs().max().item()
    assert torch.allclose(acc_ef - exact, predicted, atol=steps * n * 2.0**-20 * scale)


def _rank_async():
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    xs = _inputs(n, 4 * n * 50, torch.float32, seed=3)
    a, b, c = (xs[rank].clone() for _ in range(3))
    w1 = quant.all_reduce(a, group=group, comm_dtype="int8", async_op=True)
    w2 = quant.reduce_scatter(b, group=group, comm_dtype="bf16", op="avg", async_op=True)
    w3 = quant.all_gather(c, group=group, async_op=True)
    sync_mid = quant.all_reduce(xs[rank].clone(), group=group, comm_dtype="bf16")  # queued
    w4 = quant.all_reduce(xs[rank].clone(), group=group, async_op=True)
    quant.drain(group, timeout=30)  # after this a plain collective may follow
    done = all(w.is_completed() for w in (w1, w2, w3, w4))
    dist.barrier(group=group)
    got = [w3.wait(), w1.wait(), w4.wait(timeout=30), w2.wait()]
    want = [quant.all_gather(xs[rank].clone(), group=group),
            quant.all_reduce(xs[rank].clone(), group=group, comm_dtype="int8"),
            quant.all_reduce(xs[rank].clone(), group=group),
            quant.reduce_scatter(xs[rank].clone(), group=group, comm_dtype="bf16", op="avg")]
    same = [torch.equal(g, w) for g, w in zip(got, want)]
    return done, same, got[1] is a, torch.equal(sync_mid, quant.all_reduce(
        xs[rank].clone(), group=group, comm_dtype="bf16"))


@pytest.mark.parametrize("world_size", [2, 4])
def test_async_ops_keep_order_and_match_sync(world_size):
    for done, same, in_place, mid in run_ranks(_rank_async, world_size):
        assert done and all(same) and in_place and mid, (done, same, in_place, mid)


def _rank_wire_bytes(numels):
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    sent = [0]
    a2a, ag = dist.all_to_all_single, work._all_gather

    def count_a2a(out, inp, *a, **k):
        sent[0] += inp.numel() * inp.element_size() * (n - 1) // n
        return a2a(out, inp, *a, **k)

    def count_ag(out, inp, *a, **k):
        sent[0] += inp.numel() * inp.element_size() * (n - 1)
        return ag(out, inp, *a, **k)

    dist.all_to_all_single, work._all_gather = count_a2a, count_ag
    rows = []
    try:
        for N in numels:
            for opname in ("all_reduce", "reduce_scatter", "all_gather"):
                for comm in ("bf16", "int8"):
                    sent[0] = 0
                    getattr(quant, opname)(torch.randn(N), group=group, comm_dtype=comm,
                                           check_ranks=False)
                    rows.append((N, opname, comm, sent[0],
                                 quant.wire_bytes(opname, N, 4, comm, n, 128),
                                 quant.wire_bytes(opname, N, 4, "fp32", n, 128)))
    finally:
        dist.all_to_all_single, work._all_gather = a2a, ag
    return rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_on_the_wire(world_size):
    rows = run_ranks(_rank_wire_bytes, world_size, [1024, 4096 * world_size, 3 * 128 * 4 * 22])[0]
    # Every call's stamp (issue 23) is a fixed STAMP_BYTES per row of its first exchange, not
    # a fraction of the payload: at 1024 elements it is 2% of an all-gather row, so the ratios
    # allow it on top (the fp32 side carries its own stamp too).
    stamp = (world_size - 1) * paths.STAMP_BYTES
    for N, opname, comm, sent, documented, fp32 in rows:
        assert sent == documented, (N, opname, comm, sent, documented)
        if comm == "int8":
            assert sent <= 0.27 * fp32 + stamp, (N, opname, sent / fp32)
        else:
            assert sent <= 0.5 * fp32 + 2 * world_size + stamp, (N, opname, sent / fp32)
