"""Per-call agreement of the fused TP ops: when the first call agrees and a later one does not,
every rank raises within 2 s, naming the op, the call number and both ranks' values, and the
communicator stays failed. Before stamps, a later disagreement waited out the whole timeout
(the first-call check was cached per shape, so one rank ran a check collective its peer
skipped). The stamp rides in the data each backend exchanges anyway (overlap.tp.stamps)."""

import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
BACKENDS = ("chunked", "symmetric", "triton")
K, N = 16, 8


def _reference(opname, xs, ws, rank, world):
    """The unfused product from every rank's inputs (same seeds on every rank)."""
    if opname == "all_gather_matmul":
        return torch.cat(xs) @ ws[rank]
    full = sum(x @ w for x, w in zip(xs, ws))
    if opname == "matmul_reduce_scatter":
        m = full.shape[0] // world
        return full[rank * m:(rank + 1) * m]
    return full


def _inputs(rows, dtype, world, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, K, generator=g).to(dtype) for _ in range(world)]
    ws = [torch.randn(K, N, generator=g).to(dtype) for _ in range(world)]
    return xs, ws


def _disagree(backend, opname, kind, check_inputs, chunks=None):
    from overlap import tp
    from overlap.dist.stamp import Disagreement

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tp.TPComm(dist.group.WORLD, backend=backend, timeout=60, check_inputs=check_inputs,
                     chunks=chunks)
    fn = getattr(tp, opname)
    rows = 4 * world
    xs, ws = _inputs(rows, torch.float32, world, 0)
    y = fn(xs[rank], ws[rank], comm=comm)
    first_err = (y - _reference(opname, xs, ws, rank, world)).abs().max().item()
    # Second call: rank 1 disagrees, in rows (sizes differ) or in dtype (same sizes).
    if kind == "rows":
        rows2, dtype = (6 * world if rank == 1 else rows), torch.float32
    else:
        rows2, dtype = rows, (torch.float16 if rank == 1 else torch.bfloat16)
    xs2, ws2 = _inputs(rows2, dtype, world, 1)
    t0 = time.monotonic()
    try:
        fn(xs2[rank], ws2[rank], comm=comm)
        return first_err, None, time.monotonic() - t0, None
    except Disagreement as exc:
        elapsed, msg = time.monotonic() - t0, str(exc)
    try:
        fn(xs[rank], ws[rank], comm=comm)
        later = None
    except tp.TPCommFailed as exc:
        later = str(exc)
    comm.close()
    return first_err, msg, elapsed, later


@pytest.mark.parametrize("opname", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", (2, 4))
def test_later_disagreement_raises_on_every_rank(world, backend, opname):
    res = run_ranks(_disagree, world, backend, opname, "rows", True, timeout=90)
    for rank, (first_err, msg, elapsed, later) in enumerate(res):
        assert first_err <= 1e-5 * K, (rank, first_err)  # fp32 sums of K products, |x|,|w|~1
        assert msg is not None, f"rank {rank} returned from a call its peers disagreed on"
        assert elapsed < 2.0, (rank, elapsed)
        assert opname in msg and "call 2" in msg and "x shape" in msg
        # both signatures: this rank's rows and the disagreeing rank's
        assert f"({4 * world}, {K})" in msg or f"({6 * world}, {K})" in msg
        assert "rank 1" in msg
        assert later is not None and "failed earlier" in later and "call 2" in later


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_size_disagreement_is_caught(backend):
    # bf16 on one rank, fp16 on the other: the same bytes on the wire, so only the stamp can
    # tell; with check_inputs=False the stamp still runs.
    res = run_ranks(_disagree, 2, backend, "matmul_reduce_scatter", "dtype", False, timeout=90)
    for rank, (first_err, msg, elapsed, later) in enumerate(res):
        assert first_err <= 1e-5 * K
        assert msg is not None and "dtype" in msg and "bfloat16" in msg and "float16" in msg
        assert elapsed < 2.0 and later is not None


def _skipped_call(backend):
    """Rank 1 skips a call: its next call's number differs from its peer's."""
    from overlap import tp
    from overlap.dist.stamp import Disagreement

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tp.TPComm(dist.group.WORLD, backend=backend, timeout=60)
    xs, ws = _inputs(4 * world, torch.float32, world, 0)
    tp.matmul_all_reduce(xs[rank], ws[rank], comm=comm)
    if rank == 0:  # rank 0 makes an extra call of another op that rank 1 never makes
        try:
            tp.all_gather_matmul(xs[rank], ws[rank], comm=comm)
        except Disagreement as exc:
            return str(exc)
    try:
        tp.matmul_all_reduce(xs[rank], ws[rank], comm=comm)
    except Disagreement as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_extra_call_on_one_rank_is_named(backend):
    msgs = run_ranks(_skipped_call, 2, backend, timeout=90)
    assert all(m is not None and "call 2" in m and "op" in m for m in msgs), msgs


def _backends_differ():
    from overlap import tp

    try:
        tp.TPComm(dist.group.WORLD, backend="chunked" if dist.get_rank() else "symmetric")
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_that_pick_different_backends_are_refused_at_construction():
    for msg in run_ranks(_backends_differ, 2, timeout=60):
        assert msg is not None and "disagree on backend" in msg


@pytest.mark.parametrize("kind, chunks", (("dtype", None), ("rows", None), ("rows", 1)))
@pytest.mark.parametrize("opname", OPS)
@pytest.mark.parametrize("world", (2, 4))
def test_chunked_on_plain_gloo(world, opname, kind, chunks):
    """The chunked backend on a plain gloo group (what bench_host runs, and a CPU user without
    the twin) posts its transfers on the group directly: the products match the reference, and
    a later call where rank 1 disagrees raises on every rank, in pieces and in one piece. A
    size disagreement must not reach the data: gloo aborts the process when a message outgrows
    the receive it meets (run before the fix, rank 0 died with SIGABRT), so the stamps travel
    and are compared first; a same-size one (dtype) only the stamps can tell."""
    res = run_ranks(_disagree, world, "chunked", opname, kind, False, chunks, timeout=90,
                    backend="gloo")
    for rank, (first_err, msg, elapsed, later) in enumerate(res):
        assert first_err <= 1e-5 * K, (rank, first_err)
        assert msg is not None, f"rank {rank} returned from a call its peers disagreed on"
        assert opname in msg and "call 2" in msg and "rank 1" in msg, msg
        if kind == "rows":
            assert "x shape" in msg and (f"({4 * world}, {K})" in msg
                                         or f"({6 * world}, {K})" in msg), msg
        else:
            assert "dtype" in msg and "bfloat16" in msg and "float16" in msg, msg
        assert elapsed < 2.0 and later is not None and "failed earlier" in later


def _gloo_sequence(chunks, odd_chunks):
    """One communicator on plain gloo through calls of changing shapes and ops (every rank
    alike): the first of a size exchanges its stamps alone, a repeat carries them in its first
    message (or posts its one-piece collective beside them); each result against the unfused
    product. Then rank 1 alone passes ``odd_chunks`` where its peers repeat the last call
    (steady): every rank must raise, naming chunks."""
    from overlap import tp
    from overlap.dist.stamp import Disagreement
    from overlap.tp.chunked import _GLOO_FIRST

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tp.TPComm(dist.group.WORLD, backend="chunked", timeout=60, chunks=chunks)
    plan = [("all_gather_matmul", 4), ("all_gather_matmul", 4), ("matmul_all_reduce", 4),
            ("matmul_reduce_scatter", 6), ("matmul_reduce_scatter", 6),
            ("all_gather_matmul", 2), ("matmul_all_reduce", 6), ("matmul_all_reduce", 6)]
    errs, records = [], []
    for i, (opname, rows) in enumerate(plan):
        xs, ws = _inputs(rows * world, torch.float32, world, i)
        y = getattr(tp, opname)(xs[rank], ws[rank], comm=comm)
        errs.append((y - _reference(opname, xs, ws, rank, world)).abs().max().item())
        records.append(comm.agree.transport.get(_GLOO_FIRST))
    xs, ws = _inputs(6 * world, torch.float32, world, len(plan) - 1)
    msg = None
    try:
        tp.matmul_all_reduce(xs[rank], ws[rank], comm=comm,
                             chunks=odd_chunks if rank == 1 else None)
    except Disagreement as exc:
        msg = str(exc)
    return errs, records, msg


@pytest.mark.parametrize("per_shard", (0, 1, 2))
@pytest.mark.parametrize("world", (2, 4))
def test_chunked_on_plain_gloo_through_changing_shapes(world, per_shard):
    """``per_shard`` pieces per shard (0: chunks=1, one piece in all); with 2 no call is one
    message per neighbour, so every call exchanges its stamps alone and records nothing."""
    chunks = {0: 1, 1: world, 2: 2 * world}[per_shard]
    res = run_ranks(_gloo_sequence, world, chunks, world if per_shard == 0 else 1, timeout=90,
                    backend="gloo")
    hdr, f32 = 128, 4
    for rank, (errs, records, msg) in enumerate(res):
        assert max(errs) <= 1e-5 * K, (rank, errs)
        assert msg is not None and "chunks" in msg and "call 9" in msg, (rank, msg)
        assert records == res[0][1], (rank, records)
        if per_shard == 2:
            assert records == [None] * len(records), (rank, records)
            continue
        if per_shard == 0:  # the collective and its bytes (all-gather: the shard's)
            assert records[0] == records[1] == ("all-gather", 4 * world * K * f32)
            assert records[3] == records[4] == ("reduce-scatter", 6 * world * N * f32)
            assert records[6] == records[7] == ("all-reduce", 6 * world * N * f32)
            continue
        # the record after each call: the size of its stamped first message, the same on
        # every rank (the all-gather's shard of rows*world x K, the reduce-scatter's partial
        # of rows x N, the two-rank all-reduce's whole rows*world x N product; the all-reduce
        # ring at world 4 keeps its reduce-scatter's)
        assert records[0] == records[1] == hdr + 4 * world * K * f32
        assert records[3] == records[4] == hdr + 6 * N * f32
        assert records[5] == hdr + 2 * world * K * f32
        ar = 6 * world * N if world == 2 else 6 * N
        assert records[6] == records[7] == hdr + ar * f32


@pytest.mark.parametrize("device_path", (False, True))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64))
def test_chunked_first_message_carries_the_stamp(device_path, dtype):
    """The chunked first hop's message holds the stamp's bytes in front of the piece (CPU: a
    byte move; GPU: a device copy, run here on CPU tensors) and lands the left neighbour's
    stamp where Agreement.verify reads it; the receive's front starts zeroed."""
    from overlap.dist.stamp import STAMP_WORDS, Agreement
    from overlap.tp import chunked, stamps

    agree = Agreement(stamps.SCHEMA, rank=0, world=2, device=torch.device("cpu"), where="")
    # written the CPU way (staging it through pinned memory needs a GPU)
    agree.next("all_gather_matmul", stamps.stamp_values(torch.zeros(4, K), torch.zeros(K, N),
                                                        2, 0, 1))
    if device_path:
        agree._gpu = True
        agree._init_device_record()
    mine = agree.send.clone()
    x = torch.randn(3, 5).to(dtype)
    send, body = chunked._message(x, 3, 5)
    body.copy_(x)
    recv, _ = chunked._message(x, 3, 5)
    recv.view(torch.uint8).fill_(0xAB)  # stale bytes
    first = chunked._First(agree, send, recv)
    assert torch.equal(chunked._words(send), mine)
    assert torch.equal(send[-15:].view(3, 5), x)  # the piece follows the stamp untouched
    assert int(chunked._words(recv).abs().sum()) == 0
    theirs = mine.clone()
    theirs[1] += 7  # another call number
    chunked._words(recv).copy_(theirs)
    first.land(1)
    assert torch.equal(agree.recv[1], theirs) and agree.recv.shape[1] == STAMP_WORDS


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64))
def test_chunked_stamped_message_and_byte_compare(dtype):
    """The chunked ring's first message: the stamp's bytes, then the piece, written into a
    message that later calls of the same size reuse (overwritten with each call's stamp), and
    its receive compared where it landed: equal words pass, a word that differs (another call
    number, another shape) does not, and zeroed bytes never do."""
    from overlap.dist.stamp import Agreement
    from overlap.tp import chunked, stamps

    agree = Agreement(stamps.SCHEMA, rank=0, world=2, device=torch.device("cpu"), where="")
    agree.next("all_gather_matmul", stamps.stamp_values(torch.zeros(3, K), torch.zeros(K, N),
                                                        2, 0, 1))
    x = torch.randn(3, 5).to(dtype)
    send, body = chunked._message(x, 3, 5)
    hdr = chunked._header_elems(dtype)
    assert send.shape == (hdr + 15,) and send.dtype == dtype and body.shape == (3, 5)
    body.copy_(x)
    recv, _ = chunked._message(x, 3, 5)
    recv.view(torch.uint8).fill_(0xAB)  # stale bytes
    first = chunked._First(agree, send, recv)
    assert torch.equal(chunked._words(send), agree.send)  # this call's stamp in front
    assert torch.equal(send[hdr:].view(3, 5), x)  # the piece behind it, untouched
    assert not first.matches()  # zeroed front: never equal to a written stamp
    for word, delta in ((None, 0), (1, 1), (3, 2)):
        theirs = agree.send.clone()
        if word is not None:
            theirs[word] += delta
        chunked._words(recv).copy_(theirs)
        assert first.matches() == (word is None)
    agree.next("all_gather_matmul", stamps.stamp_values(torch.zeros(3, K), torch.zeros(K, N),
                                                        2, 0, 1))
    chunked._First(agree, send, recv)  # the next call reuses the message
    assert torch.equal(chunked._words(send), agree.send) and int(agree.send[1]) == 2
    assert torch.equal(send[hdr:].view(3, 5), x)


def test_chunked_scratch_is_kept_only_when_small():
    """Scratch buffers (a first message, a gather that is not returned) are kept per
    communicator and key up to SCRATCH_BYTES and made anew above it or without stamps."""
    from overlap.defaults import SCRATCH_BYTES
    from overlap.dist.stamp import Agreement
    from overlap.tp import chunked, stamps

    agree = Agreement(stamps.SCHEMA, rank=0, world=2, device=torch.device("cpu"), where="")
    small = lambda: (torch.empty(16),)  # noqa: E731
    big = lambda: (torch.empty(SCRATCH_BYTES // 4 + 1),)  # noqa: E731
    a = chunked._scratch(agree, ("s",), small)
    assert chunked._scratch(agree, ("s",), small) is a
    assert chunked._scratch(agree, ("t",), small) is not a
    b = chunked._scratch(agree, ("b",), big)
    assert chunked._scratch(agree, ("b",), big) is not b
    assert chunked._scratch(None, ("s",), small) is not a
