"""chunks="auto" (TPComm's default on CUDA; asked for explicitly here): the race picks one kind of
call (whole or pieces) per communicator and a piece count per (op, shape), the same on every
rank, without changing results beyond fp32 rounding; a disagreement at any point of the race or
after it still raises a named Disagreement on every rank within 2 s (the kind follows the race's
call number, so ranks that disagree on a call's shapes or op never wait in different kinds of
transfer); the one-piece path (chunks=1) carries its stamps in a fixed-size all-gather, so ranks
whose sizes differ are named too.

Tolerance: every output element is a fp32 sum of at most world*K products of N(0,1) values
(|x|,|w| <= ~5); another summation order moves it by at most world*K * 2^-24 * sum|x*w|,
far below 1e-5 * world*K * 25 = the bound used here.
"""

import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from test_tp_agreement import _reference  # the unfused product from every rank's inputs

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
K, N = 16, 8


def _inputs(rows, world, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, K, generator=g).to(dtype) for _ in range(world)]
    ws = [torch.randn(K, N, generator=g).to(dtype) for _ in range(world)]
    return xs, ws


def _race_to_the_end(backend):
    """Every op with gradients, two shapes each, until the race decides; every call checked."""
    from overlap import tp

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tp.TPComm(dist.group.WORLD, backend=backend, timeout=60, chunks="auto")
    worst, calls = 0.0, 0
    bound = 1e-5 * world * K * 25
    while comm.auto.kind is None and calls < 2000:
        for opname in OPS:
            for rows in (4 * world, 8 * world):
                xs, ws = _inputs(rows, world, seed=calls)
                x = xs[rank].clone().requires_grad_()
                y = getattr(tp, opname)(x, ws[rank], comm=comm)
                worst = max(worst, (y - _reference(opname, xs, ws, rank, world)).abs().max()
                            .item())
                y.square().sum().backward()
                calls += 1
                if opname != "matmul_all_reduce":  # dx of AG/RS ran a fused op in backward
                    assert x.grad is not None and torch.isfinite(x.grad).all()
    # after the decision: the chosen way, checked once more, then the numbers agree too
    xs, ws = _inputs(4 * world, world, seed=7)
    after = max((getattr(tp, o)(xs[rank], ws[rank], comm=comm)
                 - _reference(o, xs, ws, rank, world)).abs().max().item() for o in OPS)
    report = comm.auto.report
    comm.close()
    return worst <= bound and after <= bound, worst, report, calls


@pytest.mark.parametrize("backend", ("chunked", "symmetric"))
@pytest.mark.parametrize("world", (2, 4))
def test_race_decides_alike_on_every_rank_and_keeps_the_numbers(world, backend):
    res = run_ranks(_race_to_the_end, world, backend, timeout=240)
    for rank, (ok, worst, report, calls) in enumerate(res):
        assert ok, (rank, worst)
        assert report == res[0][2], f"rank {rank} chose differently:\n{report}\n{res[0][2]}"
        assert report["kind"] in ("whole", "pieces") and calls < 2000
    report = res[0][2]
    # forward and backward ops of both shapes were raced, each with whole and pieces timed
    assert len(report["ops"]) >= 6, report
    for name, entry in report["ops"].items():
        assert 1 in entry["best_ms"] and world in entry["best_ms"], (name, entry)
        assert all(t != float("inf") for t in entry["best_ms"].values()), (name, entry)
        expect = 1 if report["kind"] == "whole" else _fewest_within_margin(entry["best_ms"])
        assert entry["chunks"] == expect, (name, entry)


def _fewest_within_margin(best_ms: dict) -> int:
    """The piece count the rule picks: ascending, a larger count replaces the current one
    only when more than PIECES_MARGIN faster (best_ms is rounded to 0.1 us, far finer than the
    gaps between counts here)."""
    from overlap.tp.autochunk import PIECES_MARGIN

    counts = sorted(c for c in best_ms if c != 1)
    pick = counts[0]
    for c in counts[1:]:
        if best_ms[c] < (1.0 - PIECES_MARGIN) * best_ms[pick]:
            pick = c
    return pick


def _disagree_at(backend, opname, agreeing, how):
    """``agreeing`` agreeing calls, then one where rank 1 differs (``how``)."""
    from overlap import tp
    from overlap.dist.stamp import Disagreement

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tp.TPComm(dist.group.WORLD, backend=backend, timeout=60, chunks="auto")
    fn = getattr(tp, opname)
    xs, ws = _inputs(4 * world, world, 0)
    n = 0
    while n < agreeing or (agreeing < 0 and comm.auto.kind is None):
        fn(xs[rank], ws[rank], comm=comm)
        n += 1
    kind = comm.auto.kind
    if how == "rows":
        xs2, ws2 = _inputs((6 if rank == 1 else 4) * world, world, 1)
        call = lambda: fn(xs2[rank], ws2[rank], comm=comm)  # noqa: E731
    else:  # rank 1 calls another op
        other = getattr(tp, OPS[(OPS.index(opname) + 1) % 3])
        call = lambda: (other if rank == 1 else fn)(xs[rank], ws[rank], comm=comm)  # noqa: E731
    t0 = time.monotonic()
    try:
        call()
        msg = None
    except Disagreement as exc:
        msg = str(exc)
    elapsed = time.monotonic() - t0
    comm.close()
    return msg, elapsed, kind, n


@pytest.mark.parametrize("how", ("rows", "op"))
@pytest.mark.parametrize("backend", ("chunked", "symmetric"))
def test_disagreement_anywhere_in_the_race_or_after_is_named(backend, how):
    # A fresh communicator per point: the disagreeing call is its n-th, for n through the
    # race's first calls (whole and pieces turns) and after the decision (n = -1).
    for agreeing in (1, 2, 3, 4, 5, 6, 7, -1):
        res = run_ranks(_disagree_at, 2, backend, "all_gather_matmul", agreeing, how,
                        timeout=120)
        for rank, (msg, elapsed, kind, n) in enumerate(res):
            assert msg is not None, f"rank {rank} returned from call {n + 1}"
            assert elapsed < 2.0, (rank, agreeing, elapsed, msg)
            assert f"call {n + 1}" in msg and "rank 1" in msg, msg
            assert ("x shape" in msg) if how == "rows" else ("op" in msg), msg
            if agreeing < 0:
                assert kind in ("whole", "pieces")


def _one_piece_mismatch(kind):
    from overlap import tp
    from overlap.dist.stamp import Disagreement

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tp.TPComm(dist.group.WORLD, backend="chunked", timeout=60, chunks=1)
    xs, ws = _inputs(4 * world, world, 0)
    errs = [(getattr(tp, o)(xs[rank], ws[rank], comm=comm)
             - _reference(o, xs, ws, rank, world)).abs().max().item() for o in OPS]
    if kind == "rows":  # sizes differ: the collective cannot carry a stamp; the all-gather does
        xs2, ws2 = _inputs((6 if rank == 1 else 4) * world, world, 1)
    else:  # same bytes, other dtype: only the stamp can tell
        xs2, ws2 = _inputs(4 * world, world, 1,
                           dtype=torch.float16 if rank == 1 else torch.bfloat16)
    t0 = time.monotonic()
    try:
        tp.matmul_reduce_scatter(xs2[rank], ws2[rank], comm=comm)
        msg = None
    except Disagreement as exc:
        msg = str(exc)
    comm.close()
    return max(errs), msg, time.monotonic() - t0


@pytest.mark.parametrize("kind", ("rows", "dtype"))
@pytest.mark.parametrize("world", (2, 4))
def test_one_piece_calls_are_exact_and_named_when_ranks_differ(world, kind):
    for rank, (err, msg, elapsed) in enumerate(run_ranks(_one_piece_mismatch, world, kind,
                                                         timeout=90)):
        assert err <= 1e-5 * world * K * 25, (rank, err)
        assert msg is not None and elapsed < 2.0, (rank, msg, elapsed)
        assert "matmul_reduce_scatter" in msg and "call 4" in msg, msg
        assert ("x shape" in msg) if kind == "rows" else ("float16" in msg), msg


def _bad_chunks():
    from overlap.tp import TPComm

    out = []
    for chunks in ("fast", 0, -2, True, 2.0):
        try:
            TPComm(dist.group.WORLD, chunks=chunks)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    with TPComm(dist.group.WORLD) as comm:
        default = (comm.chunks, comm.auto is not None)
    return out, default


def test_chunks_must_be_auto_or_a_positive_int():
    for msgs, default in run_ranks(_bad_chunks, 2):
        for m in msgs:
            assert m is not None and "chunks must be a positive int or 'auto'" in m, msgs
            assert "rank" in m
        assert default == (2, False), default  # CPU default: world pieces, no race


def test_a_count_is_scored_by_its_lower_quartile_and_more_pieces_must_win_by_the_margin():
    from overlap.tp.autochunk import MARGIN, PIECES_MARGIN, TRIALS, _fewest, _score

    assert _score([5.0, 1.0, 3.0, 2.0, 4.0]) == 2.0  # one lucky call does not decide
    assert _score([9.0, 0.1, 8.0, 0.2, 7.0, 6.0, 5.0, 4.0, 3.0]) == 3.0  # nor do two
    assert _score([7.0]) == 7.0
    assert TRIALS >= 8 and PIECES_MARGIN > MARGIN
    key = ("op",)
    times = {(key, 2): 1.0, (key, 4): 1.0 - PIECES_MARGIN / 2, (key, 8): 0.5}
    assert _fewest(times, key, [2, 4, 8]) == (0.5, 8)
    times[(key, 8)] = (1.0 - PIECES_MARGIN / 2) * 0.999  # beats 2, but not by the margin
    assert _fewest(times, key, [2, 4, 8]) == (1.0, 2)
    times[(key, 2)] = float("inf")  # a count never timed loses to any timed one
    assert _fewest(times, key, [2, 4, 8]) == (1.0 - PIECES_MARGIN / 2, 4)


def _excluded_by_kind():
    """On plain gloo, a changed call of each kind: what it leaves out of a race's timing."""
    from overlap import tp
    from overlap.tp.autochunk import EXCLUDED

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for chunks in (1, world):
        comm = tp.TPComm(dist.group.WORLD, backend="chunked", timeout=60, chunks=chunks)
        got = []
        for rows in (4, 6):  # each a changed call: its stamps go alone first
            xs, ws = _inputs(rows * world, world, seed=rows)
            y = tp.all_gather_matmul(xs[rank][:rows], ws[rank], comm=comm)
            assert y.shape == (rows * world, N)
            got.append(comm.agree.transport.pop(EXCLUDED, 0.0))
        out[chunks] = got
        comm.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_race_leaves_out_only_the_exchange_a_steady_call_skips(world):
    """A race call on plain gloo exchanges its stamps alone first (its sizes changed). A steady
    call of one piece per shard carries them in its first piece, so the race leaves that
    exchange out of its time; a steady one-piece call still exchanges them beside its
    collective, so its time keeps it (leaving it out made whole win races it then lost)."""
    for got in run_ranks(_excluded_by_kind, world, timeout=90, backend="gloo"):
        assert all(t == 0.0 for t in got[1]), got  # one piece: nothing left out
        assert all(t > 0.0 for t in got[world]), got  # one piece per shard: left out
