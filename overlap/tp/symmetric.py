"""Symmetric (userbuffer) backend: collective matmuls over a SymmetricWorkspace.

Each function runs one op on a TPContext (workspace + phase + copier; one op in flight per
context) with 2-D inputs validated by overlap.tp.ops. all_gather_matmul pulls peers' shards
piece by piece while the GEMM consumes them; matmul_reduce_scatter pushes partial blocks into
their owners' slots and sums the received ones in fp32; matmul_all_reduce is the reduce-scatter
then an all-gather through a second region (two ranks: one exchange of the partial products).
Signals are phase counters (READY, ACK) and the buffers are double-buffered by phase parity, so
back-to-back calls never overwrite unread data.
The protocol in full: docs/design/tp.md.

Shape legend (per rank; ``world`` ranks, ``r`` = this rank, ``p`` = the call's phase):
    m = rows of one shard, M = world * m, K = reduction dim, N = output columns,
    s = chunks // world = pieces per shard (>= 1, at most m), isz = bytes per element.
"""

from __future__ import annotations

from typing import Callable

import torch

from overlap.profile import nvtx
from overlap.tp.chunked import split_bounds
from overlap.defaults import align, kept
from overlap.tp.context import TPContext

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "ag_bytes",
           "rs_bytes", "ar_bytes", "num_signals"]


def _isz(dtype: torch.dtype) -> int:
    return dtype.itemsize


def ag_bytes(m: int, k: int, dtype: torch.dtype) -> int:
    return 2 * align(m * k * _isz(dtype))


def rs_bytes(m: int, n: int, world: int, dtype: torch.dtype) -> int:
    return 2 * world * align(m * n * _isz(dtype))


def ar_bytes(rows: int, n: int, world: int, dtype: torch.dtype) -> int:
    if world == 2:  # the exchange: two halves, each the whole [rows, N] partial product
        return 2 * align(rows * n * _isz(dtype))
    m = -(-rows // world)
    return rs_bytes(m, n, world, dtype) + ag_bytes(m, n, dtype)


def num_signals(op: str, world: int) -> int:
    return (4 if op == "matmul_all_reduce" else 2) * world


def all_gather_matmul(context: TPContext, x_shard: torch.Tensor, w: torch.Tensor | None, *,
                      chunks: int, return_gathered: bool, op: str = "all_gather_matmul",
                      phase: int | None = None, offset: int = 0, base: int = 0,
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(y [M, N], gathered [M, K] or None); ``w=None`` only gathers."""
    ws, copier = context.ws, context.copier
    rank, world = ws.rank, ws.world
    trace = nvtx.recording()  # ranges only when something records them
    x_shard = x_shard.contiguous()
    m, k = x_shard.shape
    half = align(m * k * x_shard.element_size())
    context.require(op, offset + 2 * half, f"a shard of {m} x {k} {x_shard.dtype}")
    p = context.next_phase() if phase is None else phase
    at = offset + (p % 2) * half
    peers = [(rank + j) % world for j in range(1, world)]

    with nvtx.range(f"{op}.symmetric.comm[publish]") if trace else nvtx.NO_RANGE:
        if p > 2:  # every reader of phase p - 2 is done with this half
            for q in peers:
                ws.wait(base + world + q, p - 2, peer=q)
        ws.view(rank, x_shard.dtype, (m, k), at).copy_(x_shard)
        for q in peers:
            ws.signal(q, base + rank, p)
    for q in peers:
        context.quiesce[base + world + q] = p

    pieces = split_bounds(m, chunks // world)
    # ``gathered`` is an output when kept: new every call; otherwise small ones are kept with
    # the context, with their pieces' moves per buffer half (overlap.defaults.kept).
    keep = return_gathered or w is None
    if keep:
        gathered = x_shard.new_empty(world * m, k)
        moves = _moves(gathered, ws, m, pieces, peers, at)
    else:
        gathered, by_half = kept(context.scratch, ("all_gather_matmul", x_shard.dtype, m, k,
                                                   pieces), lambda: (
            x_shard.new_empty(world * m, k), {}))
        moves = by_half.get(at)
        if moves is None:
            moves = by_half[at] = _moves(gathered, ws, m, pieces, peers, at)
    tickets = []
    for q, i, lo, hi, dst, src in moves:
        def pull(q=q, i=i, dst=dst, src=src) -> None:
            with nvtx.range(f"{op}.symmetric.comm[{q}.{i}]") if trace else nvtx.NO_RANGE:
                if i == 0:
                    ws.wait(base + q, p, peer=q)
                dst.copy_(src)
                if i == len(pieces) - 1:
                    ws.signal(q, base + world + rank, p)
        tickets.append((q, lo, dst, copier.submit(pull, gathered)))

    y = None
    if w is not None:
        y = x_shard.new_empty(world * m, w.shape[1])
        with nvtx.range(f"{op}.symmetric.gemm[{rank}]") if trace else nvtx.NO_RANGE:
            torch.matmul(x_shard, w, out=y[rank * m:(rank + 1) * m])
    if keep:
        gathered[rank * m:(rank + 1) * m].copy_(x_shard)
    for q, lo, dst, ticket in tickets:
        copier.wait(ticket, f"{op} (rank {rank}, pulling rank {q}'s shard)")
        if w is not None:
            with nvtx.range(f"{op}.symmetric.gemm[{q}.{lo}]") if trace else nvtx.NO_RANGE:
                torch.matmul(dst, w, out=y[q * m + lo:q * m + lo + dst.shape[0]])
    return y, (gathered if keep else None)


def _moves(gathered: torch.Tensor, ws, m: int, pieces, peers, at: int) -> list[tuple]:
    """Per peer q and piece i at rows [lo, hi) of q's shard: (q, i, lo, hi, the rows of
    ``gathered`` it lands in, the rows of q's buffer half at byte ``at`` it comes from)."""
    moves = []
    for q in peers:
        src = ws.view(q, gathered.dtype, (m, gathered.shape[1]), at)
        for i, (lo, hi) in enumerate(pieces):
            moves.append((q, i, lo, hi, gathered[q * m + lo:q * m + hi],
                          src if (lo, hi) == (0, m) else src[lo:hi]))
    return moves


def matmul_reduce_scatter(context: TPContext, x: torch.Tensor, w: torch.Tensor, *, chunks: int,
                          overlap_with: Callable[[], None] | None = None,
                          op: str = "matmul_reduce_scatter", phase: int | None = None,
                          offset: int = 0, base: int = 0) -> torch.Tensor:
    """y_shard [m, N]; ``overlap_with`` runs after every GEMM, while peers' pushes land."""
    ws, copier = context.ws, context.copier
    rank, world = ws.rank, ws.world
    trace = nvtx.recording()  # ranges only when something records them
    m, n = x.shape[0] // world, w.shape[1]
    blk = align(m * n * x.element_size())
    context.require(op, offset + 2 * world * blk, f"a {x.shape[0]} x {n} {x.dtype} product")
    p = context.next_phase() if phase is None else phase
    at = offset + (p % 2) * world * blk
    pieces = split_bounds(m, chunks // world)

    for j in range(1, world):
        d = (rank + j) % world
        dst = ws.view(d, x.dtype, (m, n), at + rank * blk)
        for i, (lo, hi) in enumerate(pieces):
            with nvtx.range(f"{op}.symmetric.gemm[{d}.{i}]") if trace else nvtx.NO_RANGE:
                part = x[d * m + lo:d * m + hi] @ w

            def push(d=d, dst=dst, lo=lo, hi=hi, i=i, part=part) -> None:
                with nvtx.range(f"{op}.symmetric.comm[{d}.{i}]") if trace else nvtx.NO_RANGE:
                    if i == 0 and p > 2:  # d has reduced what we pushed at p - 2
                        ws.wait(base + world + d, p - 2, peer=d)
                    dst[lo:hi].copy_(part)
                    if i == len(pieces) - 1:
                        ws.signal(d, base + rank, p)
            copier.submit(push, part)
    with nvtx.range(f"{op}.symmetric.gemm[{rank}]") if trace else nvtx.NO_RANGE:
        acc = x[rank * m:(rank + 1) * m] @ w
    if overlap_with is not None:
        overlap_with()
    # Our pushes first: peers are waiting for them (on CPU the waiter may run them itself).
    copier.drain(f"{op} (rank {rank}, pushing partial blocks)")
    acc = acc.to(torch.promote_types(acc.dtype, torch.float32))  # fp32 or wider: fp64 stays
    for j in range(1, world):
        q = (rank - j) % world
        with nvtx.range(f"{op}.symmetric.comm[{q}].reduce") if trace else nvtx.NO_RANGE:
            ws.wait(base + q, p, peer=q)
            acc += ws.view(rank, x.dtype, (m, n), at + q * blk)
            ws.signal(q, base + world + rank, p)  # q may refill this slot at phase p + 2
    return acc.to(x.dtype)


def matmul_all_reduce(context: TPContext, x: torch.Tensor, w: torch.Tensor, *,
                      chunks: int) -> torch.Tensor:
    """y [M, N] = all_reduce(x [M, K] @ w [K, N]) as reduce-scatter + all-gather; on two ranks
    as one exchange of the partial products (``_exchange_all_reduce``)."""
    op = "matmul_all_reduce"
    world = context.world
    rows = x.shape[0]
    m = -(-rows // world)
    context.require(op, ar_bytes(rows, w.shape[1], world, x.dtype),
                f"a {rows} x {w.shape[1]} {x.dtype} product")
    s = max(1, chunks // world)
    if world == 2:
        return _exchange_all_reduce(context, x, w, blocks=s, op=op)
    if rows % world:  # zero rows make M divisible; they reduce to zeros and are dropped
        x = torch.cat([x, x.new_zeros(m * world - rows, x.shape[1])])
    p = context.next_phase()
    y_shard = matmul_reduce_scatter(context, x, w, chunks=s * world, op=op, phase=p)
    _, y = all_gather_matmul(context, y_shard, None, chunks=world, return_gathered=True, op=op,
                             phase=p, offset=rs_bytes(m, w.shape[1], world, x.dtype),
                             base=2 * world)
    return y[:rows]


def _exchange_all_reduce(context: TPContext, x: torch.Tensor, w: torch.Tensor, *, blocks: int,
                         op: str) -> torch.Tensor:
    """Two ranks: each row block's partial product is pushed into the peer's buffer as soon as
    its GEMM is done (the next block's GEMM runs meanwhile), then each rank adds the peer's
    whole partial to its own, in fp32 or wider. The same M x N bytes per rank as the
    reduce-scatter + all-gather, with one signal round instead of two and one copier handoff
    per block (one block: pushed in stream order, no handoff); the two ranks add the same two
    operands (IEEE addition commutes), so they hold the same bytes. Slots as in
    matmul_reduce_scatter: READY = the sender's rank, ACK = world + the reader's rank; the
    halves alternate by phase parity. A block holds the rows of one
    ring piece of each rank (``blocks`` = s), so a block is one hop where the ring takes two."""
    ws, copier = context.ws, context.copier
    rank, world = ws.rank, ws.world
    peer = 1 - rank
    trace = nvtx.recording()  # ranges only when something records them
    rows, n = x.shape[0], w.shape[1]
    blk = align(rows * n * x.element_size())  # the caller required ar_bytes = 2 * blk
    p = context.next_phase()
    at = (p % 2) * blk
    dst = ws.view(peer, x.dtype, (rows, n), at)
    y = x.new_empty(rows, n)
    bounds = split_bounds(rows, blocks)
    last = len(bounds) - 1

    def push(i: int, lo: int, hi: int, part: torch.Tensor) -> None:
        with nvtx.range(f"{op}.symmetric.comm[{peer}.{i}]") if trace else nvtx.NO_RANGE:
            if i == 0 and p > 2:  # the peer has added what we pushed at p - 2
                ws.wait(world + peer, p - 2, peer=peer)
            dst[lo:hi].copy_(part)
            if i == last:
                ws.signal(peer, rank, p)

    if last == 0:  # one block: no GEMM left to hide the push under, so it runs in stream order
        with nvtx.range(f"{op}.symmetric.gemm[0]") if trace else nvtx.NO_RANGE:
            torch.matmul(x, w, out=y)
        push(0, 0, rows, y)
    else:
        for i, (lo, hi) in enumerate(bounds):
            with nvtx.range(f"{op}.symmetric.gemm[{i}]") if trace else nvtx.NO_RANGE:
                part = torch.matmul(x[lo:hi], w, out=y[lo:hi])
            copier.submit(lambda i=i, lo=lo, hi=hi, part=part: push(i, lo, hi, part), part)
        # Our pushes first: the peer is waiting for them (on CPU the waiter may run them).
        copier.drain(f"{op} (rank {rank}, pushing partial products)")
    acc = y.to(torch.promote_types(y.dtype, torch.float32))  # fp32 or wider: fp64 stays
    with nvtx.range(f"{op}.symmetric.comm[{peer}].reduce") if trace else nvtx.NO_RANGE:
        ws.wait(peer, p, peer=peer)
        acc += ws.view(rank, x.dtype, (rows, n), at)
        ws.signal(peer, world + rank, p)  # the peer may refill this half at phase p + 2
    return acc.to(x.dtype)
