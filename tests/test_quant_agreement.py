"""Per-call agreement of the quantized collectives (issue 23 items 2 and 3), on 2 and 4 ranks
under nccl_twin: every call carries a stamp (op, call number, numel/shape, dtype, comm_dtype,
op, block_size) in the data it exchanges anyway, compared where it is received.

- the first call agrees (and matches the reference), the second does not (rank 1 passes more
  rows, or a same-size disagreement: dtype, block_size or op): every rank raises within 2 s,
  naming the op and both ranks' values, for all_reduce / reduce_scatter / all_gather, sync and
  async, comm_dtype int8 / bf16 / fp32; later calls raise QuantCommFailed with that error;
- ``check_ranks=False`` with sizes that differ: every rank raises, no process dies;
- a same-size disagreement on a call after the first is caught by the stamp alone."""

import time

import pytest
import torch
import torch.distributed as dist

from overlap.comm import quant
from tests.harness import run_ranks, run_ranks_outcomes

COLS = 24  # rows of 24 elements: shards are not whole int8 blocks
OPS = ("all_reduce", "reduce_scatter", "all_gather")
COMMS = ("int8", "bf16", "fp32")
LIMIT_S = 2.0  # every rank must raise within this of entering the call


def _x(rank: int, rows: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * salt + rank)
    return torch.randn(rows, COLS, generator=g).to(dtype)


def _reference(opname: str, n: int, rows: int, rank: int, salt: int) -> torch.Tensor:
    xs = torch.stack([_x(r, rows, salt=salt) for r in range(n)]).double()
    if opname == "all_reduce":
        return xs.sum(0)
    if opname == "reduce_scatter":
        m = rows // n
        return xs.sum(0)[rank * m:(rank + 1) * m]
    return xs.reshape(n * rows, COLS)


def _tolerance(opname: str, comm: str, n: int) -> float:
    S = 4.5 * (1 if opname == "all_gather" else n)  # bounds the block maxima of N(0,1) data
    return {"fp32": 1e-5 * S, "bf16": 2 * 2.0**-8 * S, "int8": S / 127}[comm]


def _call(opname, t, group, comm, async_op, **kw):
    kw = dict(group=group, comm_dtype=comm, async_op=async_op, timeout=20.0, **kw)
    if opname == "all_gather":
        kw.pop("op", None)
    return getattr(quant, opname)(t, **kw)


def _attempt(fn):
    """("numbers", tensor) or (error type, message, seconds, kind) of one call (waited)."""
    t0 = time.monotonic()
    try:
        out = fn()
        if isinstance(out, quant.QuantWork):
            out = out.wait()
        return ("numbers", out.detach().double().clone(), time.monotonic() - t0, None)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return (type(exc).__name__, str(exc), time.monotonic() - t0, getattr(exc, "kind", None))


def _same_size_variant(opname: str, comm: str):
    """A disagreement that leaves every byte count on the wire alike: (field, rank 0's kwargs
    value, rank 1's)."""
    if comm == "int8":
        return "dtype"  # int8 codes and fp32 scales whatever the input dtype
    if comm == "fp32" and opname != "all_gather":
        return "op"
    return "block_size"  # ignored on the bf16 / fp32 wire


def _second_call(rank, n, opname, comm, async_op, variant):
    """(t, kwargs, expected words in the message) of the second call on this rank."""
    rows = 2 * n
    dtype, kw = torch.float32, {"op": "sum", "block_size": 128}
    if variant == "rows":
        want = (f"rows={rows}", f"rows={rows + n}")
        if rank == 1:
            rows += n
    elif variant == "dtype":
        want = ("dtype=float32", "dtype=bfloat16")
        if rank == 1:
            dtype = torch.bfloat16
    elif variant == "op":
        want = ("op=sum", "op=avg")
        if rank == 1:
            kw["op"] = "avg"
    else:
        want = ("block_size=128", "block_size=64")
        if rank == 1:
            kw["block_size"] = 64
    return _x(rank, rows, dtype, salt=2), kw, want


def _first_agrees_second_does_not(kind: str):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for opname in OPS:
        for comm in COMMS:
            for async_op in (False, True):
                variant = "rows" if kind == "rows" else _same_size_variant(opname, comm)
                g = dist.new_group(list(range(n)))
                first = _attempt(lambda: _call(opname, _x(rank, 2 * n, salt=1), g, comm,
                                               async_op))
                err = None
                if first[0] == "numbers":
                    ref = _reference(opname, n, 2 * n, rank, salt=1)
                    err = (first[1] - ref).abs().max().item() if first[1].shape == ref.shape \
                        else float("inf")
                t, kw, want = _second_call(rank, n, opname, comm, async_op, variant)
                second = _attempt(lambda: _call(opname, t, g, comm, async_op, **kw))
                third = _attempt(lambda: _call(opname, _x(rank, 2 * n, salt=3), g, comm,
                                               async_op))
                out.append(dict(case=(opname, comm, async_op, variant), first=first[0],
                                first_err=err, tol=_tolerance(opname, comm, n),
                                second=second[:3], third=third[:2], want=want))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["rows", "same_size"])
def test_second_call_disagrees_every_rank_raises_fast(kind, world_size):
    per_rank = run_ranks(_first_agrees_second_does_not, world_size, kind, timeout=240)
    problems = []
    for rank, cases in enumerate(per_rank):
        for c in cases:
            where = f"rank {rank} {c['case']}"
            if c["first"] != "numbers" or not c["first_err"] <= c["tol"]:
                problems.append(f"{where}: first call {c['first']} err {c['first_err']}")
                continue
            kind_, msg, seconds = c["second"]
            opname = f"quant.{c['case'][0]}"
            if kind_ == "numbers":
                problems.append(f"{where}: the disagreeing call returned numbers")
                continue
            if seconds > LIMIT_S:
                problems.append(f"{where}: raised after {seconds:.1f}s (limit {LIMIT_S}s)")
            missing = [w for w in (opname, *c["want"]) if w not in msg]
            if missing:
                problems.append(f"{where}: {kind_} message lacks {missing}: {msg[:600]}")
            if c["third"][0] != "QuantCommFailed" or "failed earlier" not in c["third"][1]:
                problems.append(f"{where}: the next call gave {c['third'][0]}")
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} problems)"


def _unchecked_sizes():
    """check_ranks=False on every call, rank 1 passing more rows on the group's first call."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for opname in OPS:
        for comm in COMMS:
            for async_op in (False, True):
                g = dist.new_group(list(range(n)))
                rows = 2 * n + (n if rank == 1 else 0)
                got = _attempt(lambda: _call(opname, _x(rank, rows), g, comm, async_op,
                                             check_ranks=False))
                out.append(((opname, comm, async_op), got[:3]))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_unchecked_size_mismatch_raises_on_every_rank_and_kills_nobody(world_size):
    outcomes = run_ranks_outcomes(_unchecked_sizes, world_size, timeout=240, grace=10)
    n = world_size
    for o in outcomes:
        assert o.status == "ok", o  # no process died (gloo's abort kills the process)
        for case, (kind, msg, seconds) in o.value:
            assert kind != "numbers", (o.rank, case)
            assert f"quant.{case[0]}" in msg and f"rows={2 * n}" in msg, (o.rank, case, msg)
            assert f"rows={3 * n}" in msg, (o.rank, case, msg)
            assert seconds < LIMIT_S, (o.rank, case, seconds, msg)


def _later_same_size(check_ranks: bool, async_op: bool):
    """Three agreeing calls, then rank 1 passes op='avg' (same bytes everywhere) on an fp32
    all_reduce; and a bf16 all_gather whose block_size differs from the group's first call on,
    which only the stamp can see."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(n)))
    kw = dict(check_ranks=check_ranks)
    agreed = [_attempt(lambda: _call("all_reduce", _x(rank, 4), g, "fp32", async_op, **kw))[0]
              for _ in range(3)]
    bad = _attempt(lambda: _call("all_reduce", _x(rank, 4), g, "fp32", async_op,
                                 op="avg" if rank == 1 else "sum", **kw))
    g2 = dist.new_group(list(range(n)))
    first_bs = _attempt(lambda: _call("all_gather", _x(rank, 4), g2, "bf16", async_op,
                                      block_size=64 if rank == 1 else 128, check_ranks=False))
    return agreed, bad[:3], first_bs[:3]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check_ranks, async_op", [(True, False), (False, True)])
def test_same_size_disagreement_after_the_first_call_is_caught_by_the_stamp(
        check_ranks, async_op, world_size):
    for rank, (agreed, bad, first_bs) in enumerate(
            run_ranks(_later_same_size, world_size, check_ranks, async_op, timeout=120)):
        assert agreed == ["numbers"] * 3, (rank, agreed)
        kind, msg, seconds = bad
        assert kind == "Disagreement" and "quant.all_reduce" in msg, (rank, bad)
        assert "call 4" in msg and "op=sum" in msg and "op=avg" in msg, msg
        assert seconds < LIMIT_S, (rank, seconds)
        kind, msg, seconds = first_bs
        assert kind == "Disagreement" and "quant.all_gather" in msg, (rank, first_bs)
        assert "block_size=64" in msg and "block_size=128" in msg, msg
        assert seconds < LIMIT_S, (rank, seconds)


# ---- the carriers ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int8, torch.uint8, torch.int32, torch.int64,
                                   torch.bool])
def test_a_stamp_survives_a_sum_tail_exactly(dtype):
    """Each rank's stamp in its own row of the tail, zeros elsewhere: after the SUM (in the
    dtype, in any order) every row decodes to that rank's words exactly."""
    from overlap.dist.stamp import (MAGIC, pack_sum_tail, sum_tail_bits, sum_tail_chunks,
                                    unpack_sum_tail)

    n, bits = 4, sum_tail_bits(dtype)
    assert bits >= 1
    words = torch.tensor([[MAGIC, 2**40 + r, r, 3 * 10**12, 0, 7, 2**63 - 1, -1, 1, 4096]
                          for r in range(n)], dtype=torch.int64)
    k = words.shape[1] * sum_tail_chunks(bits)
    per_rank = []
    for r in range(n):
        tail = torch.zeros(n, k, dtype=dtype)
        tail[r] = pack_sum_tail(words[r], bits).to(dtype)
        per_rank.append(tail)
    total = per_rank[0]
    for t in per_rank[1:]:
        total = total | t if dtype == torch.bool else total + t
    assert torch.equal(unpack_sum_tail(total, bits), words)


def _empty_on_one_rank(comm: str):
    """A rank with nothing to send still exchanges its stamp: its peer raises, it does too."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(n)))
    ok = _attempt(lambda: quant.all_reduce(_x(rank, 2 * n), group=g, comm_dtype=comm))[0]
    got = _attempt(lambda: quant.all_gather(_x(rank, 0 if rank == 1 else 2), group=g,
                                            comm_dtype=comm, timeout=20.0))
    return ok, got[:3]


@pytest.mark.parametrize("comm", COMMS)
def test_an_empty_call_on_one_rank_raises_on_every_rank(comm):
    for rank, (ok, (kind, msg, seconds)) in enumerate(run_ranks(_empty_on_one_rank, 2, comm,
                                                                 timeout=60)):
        assert ok == "numbers", (rank, ok)
        assert kind == "Disagreement" and "quant.all_gather" in msg, (rank, kind, msg)
        assert "rows=0" in msg and "rows=2" in msg and seconds < LIMIT_S, (rank, msg, seconds)


def _slow_waiter_on_rank_1(async_op: bool):
    """Rank 1 learns of its op's completion 0.5 s late (a descheduled wait thread, a delayed
    stream): its peers have compared the stamps, raised and published their failure first."""
    import threading

    from overlap.comm.quant import work

    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 1:
        real = work._completion

        def late(w):
            done, finish = real(w)
            relayed = threading.Event()

            def relay():
                done.wait()
                time.sleep(0.5)
                relayed.set()

            threading.Thread(target=relay, daemon=True).start()
            return relayed, finish

        work._completion = late
    out = []
    for opname, comm, kw in (("all_reduce", "fp32", {"op": "avg" if rank == 1 else "sum"}),
                             ("all_gather", "bf16", {"block_size": 64 if rank == 1 else 128}),
                             ("reduce_scatter", "int8",
                              {"block_size": 64 if rank == 1 else 128})):
        g = dist.new_group(list(range(n)))
        first = _attempt(lambda: _call(opname, _x(rank, 2 * n), g, comm, async_op))[0]
        bad = _attempt(lambda: _call(opname, _x(rank, 2 * n), g, comm, async_op, **kw))
        out.append((opname, first, bad[:3]))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("async_op", [False, True])
def test_a_rank_that_learns_late_raises_the_disagreement_too(async_op, world_size):
    """A peer's published disagreement reaches a slower rank as a Disagreement naming both
    calls, never as a peer's failure of unknown cause."""
    for rank, cases in enumerate(run_ranks(_slow_waiter_on_rank_1, world_size, async_op,
                                           timeout=120)):
        for opname, first, (kind, msg, seconds) in cases:
            assert first == "numbers", (rank, opname, first)
            assert kind == "Disagreement" and f"quant.{opname}" in msg, (rank, kind, msg)
            assert "call 2" in msg and seconds < LIMIT_S, (rank, msg, seconds)
            assert ("op=avg" in msg and "op=sum" in msg) or \
                ("block_size=64" in msg and "block_size=128" in msg), (rank, msg)


def _sizes_change_after_a_good_call(check_ranks: bool, async_op: bool):
    """On plain gloo (whose receive of a larger message than it posted aborts the process):
    one agreeing call per (op, comm dtype), then rank 1 passes more rows, then fewer."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for opname in OPS:
        for comm in COMMS:
            for extra in (n, -n):
                g = dist.new_group(list(range(n)))
                kw = dict(check_ranks=check_ranks)
                first = _attempt(lambda: _call(opname, _x(rank, 2 * n), g, comm, async_op,
                                               **kw))[0]
                rows = 2 * n + (extra if rank == 1 else 0)
                bad = _attempt(lambda: _call(opname, _x(rank, rows), g, comm, async_op, **kw))
                out.append(((opname, comm, extra), first, bad[:3]))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check_ranks, async_op", [(True, False), (False, False), (True, True),
                                                   (False, True)])
def test_a_size_change_on_plain_gloo_raises_on_every_rank_and_kills_nobody(
        check_ranks, async_op, world_size):
    """Sizes are agreed before the data moves on plain gloo, so a disagreement after a good
    call raises a Disagreement naming both sizes on every rank instead of aborting one."""
    n = world_size
    outcomes = run_ranks_outcomes(_sizes_change_after_a_good_call, n, check_ranks, async_op,
                                  timeout=240, grace=10, backend="gloo")
    for o in outcomes:
        assert o.status == "ok", o  # no process died
        for (opname, comm, extra), first, (kind, msg, seconds) in o.value:
            case = (o.rank, opname, comm, extra)
            assert first == "numbers", case
            assert kind == "Disagreement" and f"quant.{opname}" in msg, (case, kind, msg)
            assert f"rows={2 * n}" in msg and f"rows={2 * n + extra}" in msg, (case, msg)
            assert seconds < LIMIT_S, (case, seconds)
