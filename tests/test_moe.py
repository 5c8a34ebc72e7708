"""The MoE layer (overlap.moe) against the single-process reference (reference_moe), at EP 1, 2
and 4 on the NCCL-ordering twin: outputs, the input's and every parameter's gradient, the
auxiliary losses, the drop count, and the parameters after 3 AdamW steps; capacity mode (with
drops) and dropless, softmax and sigmoid scores, with and without a shared expert. Then the host
syncs per direction (capacity 0; dropless EP > 1: one in the forward, none in the backward) and
the bad-input errors, raised on every rank.

Tolerance: fp32, |ours - ref| <= 1e-5 * max(1, max|ref|). The two sides differ only in the
summation order of each dot product (grouped GEMM vs one GEMM per expert; index_add order), a
few ulps (2^-23 each) times reduction lengths of at most 64 here: below 1e-5 relative with
margin on any x86 summation order. The AdamW steps divide by sqrt(v) + eps, which can magnify a
gradient difference in a coordinate whose gradient is near zero: Adam's step is invariant to the
gradient's scale, so it is known only to the gradient's relative accuracy there. The parameters
after the steps are compared at 1e-5 on the coordinates whose reference gradient stayed above
1e-3 of its tensor's (its expert's) largest, or exactly zero (an expert no token reached), at
every step (there a rounding difference of the gradient moves the step by ~1e-4 of lr or less);
the others (asserted to be under 20%: the seeds are fixed, so this share is a property of the
data, not of the machine) are only checked against the largest change 3 steps can make (3 * lr *
1.1).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

D, FF, E, K = 16, 32, 8, 2
LR = 1e-2
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / max(1.0, float(b.float().abs().max())))


def _batches(world: int, step: int):
    xs = [torch.randn(2, 12, D, generator=torch.Generator().manual_seed(100 * step + r))
          for r in range(world)]
    gs = [torch.randn(2, 12, D, generator=torch.Generator().manual_seed(7000 + 100 * step + r))
          for r in range(world)]
    return xs, gs


def _loss(y, g, aux):
    return (y * g).sum() + 0.01 * aux.load_balancing + 0.001 * aux.z


def _comm(backend, **kw):
    from overlap.moe import EPComm

    extra = {}
    if backend.startswith("symmetric"):  # "symmetric-triton": its send as the Triton kernel
        extra = dict(max_tokens=24, kernel="triton" if backend.endswith("triton") else "torch")
        backend = "symmetric"
    return EPComm(dist.group.WORLD, backend=backend, timeout=30, **extra, **kw)


def _ep_case(cf, score, shared, chunks, backend):
    from overlap.moe import MoE, reference_moe

    rank, world = dist.get_rank(), dist.get_world_size()
    kw = dict(capacity_factor=cf, score=score, shared_d_ff=16 if shared else None)
    torch.manual_seed(0)
    comm = _comm(backend, chunks=chunks)
    layer = MoE(D, FF, E, K, comm=comm, **kw)
    torch.manual_seed(0)
    ref = MoE(D, FF, E, K, **kw)
    el = E // world
    mine = slice(rank * el, (rank + 1) * el)
    opt = torch.optim.AdamW(layer.parameters(), lr=LR)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    replicated = [p for n, p in layer.named_parameters() if not n.startswith("experts.")]
    errs: dict[str, float] = {}
    steady = {n: torch.ones_like(p, dtype=torch.bool) for n, p in ref.named_parameters()}

    def note(key, got, want):
        errs[key] = max(errs.get(key, 0.0), _rel(got.detach(), want.detach()))

    for step in range(3):
        xs, gs = _batches(world, step)
        x = xs[rank].clone().requires_grad_()
        y = layer(x)
        _loss(y, gs[rank], layer.aux).backward()
        for p in replicated:  # data-parallel replicas over the EP ranks: sum their gradients
            dist.all_reduce(p.grad, group=dist.group.WORLD)
        xr = [t.clone().requires_grad_() for t in xs]
        outs = [reference_moe(t, ref) for t in xr]
        sum(_loss(yr, g, aux) for (yr, aux), g in zip(outs, gs)).backward()
        yr, aux = outs[rank]
        note("out", y, yr)
        note("dx", x.grad, xr[rank].grad)
        note("lb", layer.aux.load_balancing, aux.load_balancing)
        note("z", layer.aux.z, aux.z)
        errs["dropped_diff"] = max(errs.get("dropped_diff", 0),
                                   abs(int(layer.aux.dropped) - int(aux.dropped)))
        errs["dropped"] = errs.get("dropped", 0) + int(aux.dropped)
        rp = dict(ref.named_parameters())
        for n, p in layer.named_parameters():
            want = rp[n].grad[mine] if n.startswith("experts.") else rp[n].grad
            note(f"grad {n}", p.grad, want)
            g = rp[n].grad
            # per expert for the expert tensors: an expert that few tokens reached has small
            # gradients everywhere, which is no conditioning problem
            top = (g.abs().amax(dim=(1, 2), keepdim=True) if n.startswith("experts.")
                   else g.abs().max())
            steady[n] &= (g.abs() >= 1e-3 * top) | (g == 0)
        opt.step()
        ropt.step()
        opt.zero_grad(set_to_none=True)
        ropt.zero_grad(set_to_none=True)
    rp = dict(ref.named_parameters())
    for n, p in layer.named_parameters():
        pick = (lambda t: t[mine]) if n.startswith("experts.") else (lambda t: t)
        want, ok = pick(rp[n].detach()), pick(steady[n])
        note(f"param {n}", p.detach()[ok], want[ok])
        errs[f"bound {n}"] = float((p.detach() - want).abs().max()) / (3 * LR * 1.1) * TOL
        errs[f"ill-conditioned share {n}"] = float((~ok).float().mean()) * TOL / 0.2
    comm.close()
    return errs


# chunks 1 is the sequential schedule; dropless pieces are capped at El (2 at EP 4).
CASES = [(None, "softmax", False, 1), (1.0, "softmax", True, 2), (0.5, "sigmoid", False, 3),
         (None, "sigmoid", True, 4), (1.0, "sigmoid", False, 1)]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("cf,score,shared,chunks", CASES)
@pytest.mark.parametrize("backend", ["chunked", "symmetric", "symmetric-triton"])
def test_ep_layer_matches_reference(world, cf, score, shared, chunks, backend):
    res = run_ranks(_ep_case, world, cf, score, shared, chunks, backend, timeout=120)
    for rank, errs in enumerate(res):
        assert errs["dropped_diff"] == 0, f"rank {rank}: drop counts differ: {errs}"
        if cf == 0.5:
            assert errs["dropped"] > 0, f"rank {rank}: the capacity case must drop: {errs}"
        if cf is None:
            assert errs["dropped"] == 0
        bad = {k: v for k, v in errs.items() if not k.startswith("dropped") and v > TOL}
        assert not bad, f"rank {rank} (world {world}): beyond {TOL}: {bad}"


def _host_syncs(cf, backend):
    from overlap.moe import MoE
    from overlap.profile.syncs import count_host_syncs

    torch.manual_seed(0)
    comm = _comm(backend)
    layer = MoE(D, FF, E, K, comm=comm, capacity_factor=cf)
    x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    layer(x).sum().backward()  # warm-up
    counts = []
    for _ in range(2):
        with count_host_syncs() as fwd:
            y = layer(x)
            loss = y.sum() + layer.aux.load_balancing
        with count_host_syncs() as bwd:
            loss.backward()
        counts.append((fwd.count, bwd.count, fwd.where))
    comm.close()
    return counts


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cf,backend,want_fwd", [(1.0, "chunked", 0), (None, "chunked", 1),
                                                 (1.0, "symmetric", 0),
                                                 (None, "symmetric", 0)])
def test_host_syncs_per_direction(world, cf, backend, want_fwd):
    """Capacity mode: 0; dropless: 1 in the forward on the chunked backend (NCCL's uneven
    all_to_all takes host split sizes), 0 on the symmetric one (offsets on the device)."""
    for rank, counts in enumerate(run_ranks(_host_syncs, world, cf, backend, timeout=60)):
        for fwd, bwd, where in counts:
            assert (fwd, bwd) == (want_fwd, 0), f"rank {rank}: fwd {fwd} bwd {bwd}: {where}"


def test_single_rank_capacity_mode_makes_no_host_sync():
    from overlap.moe import MoE
    from overlap.profile.syncs import count_host_syncs

    for cf in (None, 1.25):
        torch.manual_seed(0)
        layer = MoE(D, FF, E, K, capacity_factor=cf)
        x = torch.randn(24, D)
        with count_host_syncs() as syncs:
            layer(x).sum().backward()
        assert syncs.count == 0, syncs.where


def _bad_inputs():
    from overlap.moe import EPComm, MoE

    rank = dist.get_rank()
    comm = EPComm(dist.group.WORLD, timeout=30)
    errors = []
    for make in (lambda: MoE(D, FF, 6, K, comm=comm),                      # 6 % 4
                 lambda: MoE(D, FF, E, E + 1, comm=comm),                  # top_k > E
                 lambda: MoE(D, FF, E, K, comm=comm, capacity_factor=1.0 + rank),  # disagree
                 lambda: MoE(D, FF, E, K, comm=comm, capacity_factor=-1.0),
                 lambda: MoE(D, FF, E, K, comm=dist.group.WORLD),
                 lambda: MoE(D, 30, E, K, comm=comm),                     # unaligned d_ff
                 lambda: MoE(D, FF, E, K, comm=comm)(torch.randn(3, D + 1)),
                 lambda: MoE(D, FF, E, K, comm=EPComm(dist.group.WORLD, dispatch="int8",
                                                      quant_block=5)),
                 lambda: MoE(D, FF, E, K, comm=EPComm(dist.group.WORLD, chunks=1 + rank % 2)),
                 lambda: EPComm(dist.group.WORLD, dispatch="fp8")):
        try:
            make()
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def test_bad_inputs_raise_on_every_rank():
    for rank, errs in enumerate(run_ranks(_bad_inputs, 4, timeout=60)):
        assert all(e is not None for e in errs), f"rank {rank}: some bad input passed: {errs}"
        assert "num_experts=6 is not divisible by the EP size 4" in errs[0], errs[0]
        assert "top_k=9 is larger than num_experts=8" in errs[1], errs[1]
        assert "disagree on capacity" in errs[2] and "[1, 2, 3, 4]" in errs[2], errs[2]
        assert f"(rank {rank})" in errs[2]
        assert "capacity_factor must be None (dropless) or a positive number" in errs[3]
        assert errs[4].startswith("TypeError") and "EPComm" in errs[4]
        assert "d_ff=30 must be a multiple of 4" in errs[5], errs[5]
        assert "input last dim must be 16" in errs[6] and f"rank {rank}" in errs[6]
        assert "d_model=16 is not a multiple of the EPComm's quant_block=5" in errs[7], errs[7]
        assert "disagree on chunks" in errs[8] and "[1, 2, 1, 2]" in errs[8], errs[8]
        assert "dispatch must be one of" in errs[9] and "'fp8'" in errs[9], errs[9]


def _peer_fault(kind, cf, timeout, backend="chunked"):
    from harness import last_rank_fails_during
    from overlap.moe import EPComm, MoE

    torch.manual_seed(0)
    extra = dict(max_tokens=12) if backend == "symmetric" else {}
    layer = MoE(D, FF, E, K, comm=EPComm(dist.group.WORLD, chunks=2, timeout=timeout,
                                         backend=backend, **extra),
                capacity_factor=cf)
    x = torch.randn(12, D)
    return last_rank_fails_during(kind, timeout, lambda: layer(x).sum().backward())


@pytest.mark.parametrize("kind", ["dead", "stalled"])
@pytest.mark.parametrize("cf", [1.0, None])
def test_dead_or_stalled_peer_is_an_error_on_every_survivor(kind, cf):
    from harness import run_ranks_outcomes

    timeout, world = 2.0, 4
    outcomes = run_ranks_outcomes(_peer_fault, world, kind, cf, timeout, timeout=60, grace=20)
    first_op = "moe dispatch" if cf is not None else "moe counts"
    for out in outcomes[:-1]:
        assert out.status == "ok", (out.status, out.error)
        took, msg = out.value
        assert msg.startswith("RuntimeError"), msg
        assert f"ep {first_op}" in msg and f"(rank {out.rank})" in msg, msg
        assert took <= 2 * timeout + 1, (took, msg)
        if kind == "stalled":
            assert "timed out" in msg, msg


# The symmetric exchange has no stream-twin work (its waits are the workspace's), so the delay
# pass would only rerun it under a heavier load.
@pytest.mark.no_delay_pass
@pytest.mark.parametrize("kind", ["dead", "stalled"])
@pytest.mark.parametrize("cf", [1.0, None])
def test_symmetric_dead_or_stalled_peer_is_an_error_on_every_survivor(kind, cf):
    """The userbuffer waits end with the cause (PeerDied at once for a dead peer, SignalTimeout
    after the timeout for a stalled one); the first survivor to see it aborts the workspace, so
    the others end too, with its reason."""
    from harness import run_ranks_outcomes

    timeout, world = 2.0, 4
    outcomes = run_ranks_outcomes(_peer_fault, world, kind, cf, timeout, "symmetric",
                                  timeout=60, grace=20)
    for out in outcomes[:-1]:
        assert out.status == "ok", (out.status, out.error)
        took, msg = out.value
        assert msg.startswith("RuntimeError") and "moe dispatch" in msg, msg
        assert f"(rank {out.rank}" in msg and "rank 3" in msg, msg
        assert took <= 2 * timeout + 1, (took, msg)
        if kind == "stalled":
            assert "within 2s" in msg, msg
        else:
            assert "has exited" in msg, msg


def _too_many_tokens(tokens_on_1):
    import time

    from overlap.moe import EPComm, MoE

    rank = dist.get_rank()
    comm = EPComm(dist.group.WORLD, backend="symmetric", max_tokens=24, timeout=30)
    torch.manual_seed(0)
    layer = MoE(D, FF, E, K, comm=comm)
    layer(torch.randn(24, D)).sum().backward()  # at the limit: fine
    t0 = time.monotonic()
    try:
        layer(torch.randn(tokens_on_1 if rank == 1 else 12, D))
    except (ValueError, RuntimeError) as exc:
        took, msg = time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    else:
        took, msg = time.monotonic() - t0, "returned"
    try:  # the communicator stays failed
        layer(torch.randn(12, D))
    except RuntimeError as exc:
        after = str(exc)
    else:
        after = "returned"
    comm.close()
    return took, msg, after


@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_buffers_too_small_is_an_error_on_every_rank(world):
    """More tokens than max_tokens on one rank: a ValueError there, and on every peer a
    RuntimeError with that reason at once (the workspace is aborted), not a timeout."""
    for rank, (took, msg, after) in enumerate(run_ranks(_too_many_tokens, world, 25,
                                                        timeout=60)):
        assert "25 tokens on rank 1 exceed the EPComm's max_tokens=24" in msg, (rank, msg)
        assert msg.startswith("ValueError" if rank == 1 else "RuntimeError"), (rank, msg)
        assert took < 10, (rank, took)
        assert "failed earlier" in after, (rank, after)


def _nonfinite(cf, backend, check_finite):
    from overlap.moe import MoE

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = _comm(backend)
    torch.manual_seed(0)
    layer = MoE(D, FF, E, K, comm=comm, capacity_factor=cf, check_finite=check_finite)
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(rank))
    if rank == world - 1:
        x[3, 5] = float("nan")
        x[7, 0] = float("inf")
    try:
        y = layer(x)
    except ValueError as exc:
        result = f"ValueError: {exc}"
    else:
        bad_rows = (~torch.isfinite(y)).any(1).nonzero().flatten().tolist()
        result = (bad_rows, int(layer.aux.nonfinite))
    comm.close()
    return result


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cf,backend,check_finite", [
    (None, "chunked", False),      # carried on the counts exchange: always checked
    (1.0, "chunked", True), (1.0, "symmetric", True), (None, "symmetric", True)])
def test_nonfinite_router_logits_raise_on_every_rank(world, cf, backend, check_finite):
    for rank, res in enumerate(run_ranks(_nonfinite, world, cf, backend, check_finite,
                                         timeout=60)):
        assert isinstance(res, str), (rank, res)
        assert "NaN or inf router logits" in res and f"{{{world - 1}: 2}}" in res, (rank, res)
        assert f"(rank {rank})" in res, res


@pytest.mark.parametrize("cf,backend", [(1.0, "chunked"), (1.0, "symmetric"),
                                        (None, "symmetric")])
def test_nonfinite_router_logits_unchecked_poison_only_their_tokens(cf, backend):
    """Without check_finite (0 host syncs), a token whose logits are not finite comes out
    non-finite, every other token stays finite, and aux.nonfinite counts it."""
    for rank, res in enumerate(run_ranks(_nonfinite, 2, cf, backend, False, timeout=60)):
        assert res == (([3, 7], 2) if rank == 1 else ([], 0)), (rank, res)


def _wire_round_trip(dispatch, cf):
    """The exchange with identity experts: what comes back is exactly what the owner received
    (the combine travels in the activation dtype), so the error is the dispatch's alone."""
    from overlap.moe import EPComm
    from overlap.moe.exchange import counted_pieces, exchange, static_pieces

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = EPComm(dist.group.WORLD, chunks=2, dispatch=dispatch, quant_block=8, timeout=30)
    el, d = 2, 16
    gen = torch.Generator().manual_seed(rank)
    if cf is not None:
        cap = 5
        rows = torch.randn(world * el * cap, d, generator=gen)
        pieces = static_pieces(world, el, cap, comm.chunks, rows.device)
    else:
        send_n = [[(3 * rank + 2 * dst + j) % 4 for j in range(el)] for dst in range(world)]
        recv_n = [[(3 * src + 2 * rank + j) % 4 for j in range(el)] for src in range(world)]
        rows = torch.randn(sum(map(sum, send_n)), d, generator=gen)
        pieces = counted_pieces(send_n, recv_n, comm.chunks, rows.device)
    # Spread the magnitudes over many binades, so the blockwise scales matter.
    rows = rows * torch.logspace(-6, 6, rows.numel(), base=2.0).reshape(rows.shape)
    rows.requires_grad_()
    w1, w2 = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    back, _ = exchange(rows, w1, w2, pieces, comm, lambda x, a, b, offs: x * 1.0)
    g = torch.randn(back.shape, generator=gen)
    back.backward(g)
    exact = rows.detach()
    err = (back.detach() - exact).abs()
    if dispatch == "int8":
        blocks = exact.reshape(-1, 8).abs().amax(1, keepdim=True)
        bound = (blocks / 254 + blocks * 2.0 ** -21 + 2.0 ** -118).expand(-1, 8).reshape(err.shape)
    elif dispatch == "bf16":
        bound = exact.abs() * 2.0 ** -8
    else:
        bound = torch.zeros_like(exact)
    return (bool((err <= bound).all()), float((err / bound.clamp_min(1e-30)).max()),
            float(err.max()), bool(torch.equal(rows.grad, g)))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dispatch", ["same", "bf16", "int8"])
@pytest.mark.parametrize("cf", [1.0, None])
def test_dispatch_on_the_wire_within_its_bound(world, dispatch, cf):
    """INT8: each value within Q(M) = M/254 + M*2^-21 + 2^-118 of the exact one, M the absmax
    of its block of quant_block values (the quantized collectives' bound for one quantization);
    BF16: within |x| * 2^-8 (round to nearest); "same": exact. The gradient is passed straight
    through (the combine-side exchanges carry the activation dtype) and arrives exactly."""
    for rank, (ok, worst, err, grad_exact) in enumerate(
            run_ranks(_wire_round_trip, world, dispatch, cf, timeout=60)):
        assert ok, f"rank {rank}: error {err} at {worst:.3g}x its bound"
        assert grad_exact, f"rank {rank}: the straight-through gradient changed"
        if dispatch != "same":
            assert err > 0, f"rank {rank}: {dispatch} dispatch sent exact values"


def test_bench_moe_runs_every_variant_and_traces_the_exchange(tmp_path):
    """A tiny bench_moe run as a user starts it: every variant of both modes in the table,
    ratios against the same run's sequential row, and with --profile the trace column filled
    from the moe.<backend> ranges (the chunked rows' transfers partly hidden, so above 0)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "moe"
    proc = subprocess.run([sys.executable, "-m", "bench.bench_moe", "--world-sizes", "2",
                           "--rounds", "1", "--warmup", "1", "--shapes", "mixtral-like",
                           "--out", str(out), "--profile", str(tmp_path / "traces")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    got = {(r["mode"], r["variant"]) for r in rows}
    for mode in ("capacity", "dropless"):
        for name in ("sequential", "chunked 2", "chunked 4", "symmetric", "symmetric int8"):
            assert (mode, name) in got, (mode, name, sorted(got))
    assert {("capacity", "torch"), ("capacity", "chunked 2 int8")} <= got
    for r in rows:
        assert r["ms"] > 0 and r["dropped"] == 0, r
        seq = next(s for s in rows if s["mode"] == r["mode"] and s["variant"] == "sequential")
        assert abs(r["ratio"] - seq["ms"] / r["ms"]) < 1e-9, r
        assert 0 <= r["trace_overlap%"] <= 100, r
    assert any(r["trace_overlap%"] > 0 for r in rows if r["variant"].startswith("chunked")), rows


def _late_writes(cf):
    """The userbuffer rule a GPU enforces by stream order: a source's rows (and an owner's
    results) must be stored before the signal that announces them. The shared-memory twin
    stores synchronously, so a reordered store would only race; here rank 0 pauses after each
    signal to a peer (and rank 1 never does, so it reads at once), so anything rank 0 stores
    after its signal lands after rank 1 has read: wrong numbers every time, not now and then."""
    import time

    from overlap.symm.shm import ShmWorkspace

    plain = ShmWorkspace.signal

    def signal_then_pause(self, peer, slot, value):
        plain(self, peer, slot, value)
        if self.rank == 0 and peer != 0:
            time.sleep(0.1)

    ShmWorkspace.signal = signal_then_pause
    return _ep_case(cf, "softmax", True, 1, "symmetric")


@pytest.mark.parametrize("cf", [None, 1.0])
def test_symmetric_stores_land_before_their_signal(cf):
    for rank, errs in enumerate(run_ranks(_late_writes, 2, cf, timeout=120)):
        bad = {k: v for k, v in errs.items() if not k.startswith("dropped") and v > TOL}
        assert not bad, f"rank {rank}: beyond {TOL}: {bad}"


def _uneven_tokens(cf, backend):
    """After a call with equal token counts, rank r routes 8 + 4r tokens: dropless mode and
    the symmetric backend take it (the counts travel with the rows); chunked capacity mode
    cannot (every rank's static splits follow its own capacity, built once per capacity), so
    the exchange must refuse that later call on every rank: the transport where the first
    piece's sizes differ, its stamps (overlap.moe.stamps) where they still match."""
    from overlap.moe import MoE, reference_moe

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = _comm(backend)
    torch.manual_seed(0)
    layer = MoE(D, FF, E, K, comm=comm, capacity_factor=cf)
    torch.manual_seed(0)
    ref = MoE(D, FF, E, K, capacity_factor=cf)
    xs = [torch.randn(8 + 4 * r, D, generator=torch.Generator().manual_seed(r))
          for r in range(world)]
    with torch.no_grad():  # a good call first: the refusal must hold on later calls too
        layer(torch.randn(12, D, generator=torch.Generator().manual_seed(99)))
    x = xs[rank].clone().requires_grad_()
    try:
        y = layer(x)
        y.sum().backward()
    except (RuntimeError, ValueError) as exc:
        comm.close()
        return f"{type(exc).__name__}: {exc}"
    xr = [t.clone().requires_grad_() for t in xs]
    outs = [reference_moe(t, ref)[0] for t in xr]
    sum(o.sum() for o in outs).backward()
    mine = slice(rank * (E // world), (rank + 1) * (E // world))
    comm.close()
    return max(_rel(y, outs[rank]), _rel(x.grad, xr[rank].grad),
               _rel(layer.experts.w_gate_up.grad, ref.experts.w_gate_up.grad[mine]),
               _rel(layer.experts.w_down.grad, ref.experts.w_down.grad[mine]))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cf,backend", [(None, "chunked"), (None, "symmetric"),
                                        (1.0, "symmetric"), (1.0, "chunked")])
def test_ranks_with_different_token_counts(world, cf, backend):
    for rank, res in enumerate(run_ranks(_uneven_tokens, world, cf, backend, timeout=60)):
        if (cf, backend) == (1.0, "chunked"):
            assert isinstance(res, str), (rank, res)
            if world == 2:  # capacities 2, 3: piece 0's sizes match (1 slot), its stamps differ
                assert res.startswith("Disagreement: moe dispatch: call 5: ranks disagree on "
                                      f"capacity: rank {rank}={2 + rank}, "), (rank, res)
            else:  # capacities 2..5: piece 0's sizes differ, the transport refuses them
                assert "moe dispatch" in res, (rank, res)
                assert "disagree on the sizes" in res and f"(rank {rank})" in res, (rank, res)
        else:
            assert isinstance(res, float) and res <= TOL, (rank, res)


_COMPILE_EP = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from overlap.kernels.triton import ep_dispatch as ep

fn = ep._ep_dispatch_kernel
out = {}
for cc, dt in ((80, "*fp32"), (90, "*bf16"), (90, "*i8")):
    ptrs = {"src_ptr": dt, "index_ptr": "*i64", "owner_ptr": "*i64", "place_ptr": "*i64",
            "counts_ptr": "*i64", "data_table": "*i64", "flag_table": "*i64",
            "counter_ptr": "*i32"}
    consts = dict(BLOCK_R=16, BLOCK_W=128)
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "i64" if a == "phase" else "i32")
           for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", cc, 32))
    out[f"sm_{cc} {dt}"] = k.asm["ptx"]
json.dump(out, sys.stdout)
"""


def test_ep_dispatch_kernel_compiles_for_sm80_and_sm90():
    """The interpreter accepts what ptxas may not: the kernel compiles for both GPU targets,
    and its signal is a release store at system scope after the rows (the peer reads them)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", _COMPILE_EP], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    ptx = json.loads(run.stdout)
    assert len(ptx) == 3
    for name, code in ptx.items():  # tp_sync.store_release: a release exchange, sys scope
        assert "atom.global.sys.release.exch.b64" in code, name


def _quantized_backends(dispatch, cf):
    """One batch through the same layer with the quantized dispatch on each backend."""
    from overlap.moe import EPComm, MoE

    rank = dist.get_rank()
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(rank))
    got = {}
    for name in ("chunked", "symmetric", "symmetric-triton", "exact"):
        comm = (_comm(name, dispatch=dispatch, quant_block=8) if name != "exact"
                else EPComm(dist.group.WORLD, timeout=30))
        torch.manual_seed(0)
        layer = MoE(D, FF, E, K, comm=comm, capacity_factor=cf)
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.square().sum().backward()
        got[name] = (y.detach(), xx.grad, layer.experts.w_gate_up.grad, layer.experts.w_down.grad)
        comm.close()
    base = got["chunked"]
    same = max(_rel(a, b) for name in ("symmetric", "symmetric-triton")
               for a, b in zip(got[name], base))
    return same, _rel(base[0], got["exact"][0])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dispatch", ["int8", "bf16"])
@pytest.mark.parametrize("cf", [1.0, None])
def test_quantized_dispatch_is_the_same_on_every_backend(world, dispatch, cf):
    """The symmetric backend (torch stores and the Triton kernel) sends the same quantized rows
    as the chunked one (whose bound test_dispatch_on_the_wire_within_its_bound checks): equal
    outputs and gradients within the fp32 tolerance, and all differ from the exact dispatch."""
    for rank, (same, lossy) in enumerate(run_ranks(_quantized_backends, world, dispatch, cf,
                                                   timeout=120)):
        assert same <= TOL, (rank, same)
        assert lossy > 0, (rank, lossy)


def _device_waits(mode, cf, timeout):
    """The shm twin's waits as the CUDA wait kernel's (record the error and return): the call
    runs to its end on whatever the buffers hold, so only poisoning stands between the caller
    and stale rows."""
    import os

    from harness import fail_signals_then_call

    os.environ["OVERLAP_SHM_DEVICE_WAITS"] = "1"
    from overlap.moe import EPComm, MoE

    rank = dist.get_rank()
    comm = EPComm(dist.group.WORLD, backend="symmetric", max_tokens=12, timeout=timeout)
    torch.manual_seed(0)
    layer = MoE(D, FF, E, K, comm=comm, capacity_factor=cf)
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(rank))
    good = layer(x)
    dist.barrier()
    if rank == 1:
        fail_signals_then_call(mode, timeout * 2.5, lambda: layer(x))
        return None
    out = layer(x)  # returns: the device-side waits gave up without raising
    try:
        layer(x)
        second = "returned"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        second = f"{type(exc).__name__}: {exc}"
    return bool(out.isnan().all()), bool(torch.isfinite(good).all()), second


@pytest.mark.parametrize("mode", ["stall", "kill"])
@pytest.mark.parametrize("cf", [4.0, None])
def test_symmetric_device_side_wait_failure_poisons_the_output_and_the_next_call_raises(
        mode, cf):
    from harness import run_ranks_outcomes

    outcomes = run_ranks_outcomes(_device_waits, 2, mode, cf, 1.5, timeout=60, grace=20)
    assert outcomes[0].status == "ok", (outcomes[0].status, outcomes[0].error)
    nan, finite_before, second = outcomes[0].value
    assert finite_before and nan, (finite_before, nan)  # NaN, never stale numbers
    # SignalTimeout (a stalled peer) or PeerDied (a dead one), naming the op, slot and peer
    assert second.split(":")[0] in ("SignalTimeout", "PeerDied"), second
    assert "moe dispatch" in second and "slot" in second and "rank 1" in second, second
