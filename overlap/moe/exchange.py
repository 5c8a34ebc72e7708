"""The expert-parallel exchange: dispatch rows to the ranks that own their experts, run the
experts there, combine the results back, in pieces so the all-to-alls hide under the experts.

Legend: ``ep`` ranks, ``El`` local experts per rank, ``c`` pieces. ``rows [R, d]`` on a source
rank are sorted by global expert, i.e. by (owner rank, local expert); block (dst, j) holds
``n[dst][j]`` rows. A piece takes a sub-range of every block: capacity mode splits each
block's ``C`` slots into ``c`` ranges (Tutel's split of the capacity dimension); dropless mode
gives each piece a range of local experts (at most ``El`` pieces). Forward: every piece's
dispatch is posted at once; piece p's experts run as soon as its rows arrive, and its combine
is posted while piece p+1 computes. The backward mirrors it (the output gradient travels like
a dispatch, the input gradient like a combine) with each piece's wgrad and dgrad under the
other pieces' transfers. ``c = 1`` is the sequential reference schedule. No host syncs: the
split sizes come from host integers (static in capacity mode, counted once in dropless mode).
The narrative: docs/moe.md.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from overlap.comm.quant import kernels as quant
from overlap.moe.comm import EPComm
from overlap.profile import names, nvtx

__all__ = ["Pieces", "static_pieces", "counted_pieces", "exchange", "encode", "decode",
           "wire_row_bytes", "piece_range"]


def piece_range(backend: str, role: str, index: object):
    """The profiler range of one piece of the MoE exchange: ``moe.<backend>.<role>[<index>]``
    (role comm, gemm or compute; overlap-analyze classifies it by the role)."""
    return nvtx.range(names.chunk("moe", backend, role, index))


class Pieces(NamedTuple):
    send_index: list[torch.Tensor]   # per piece: rows of ``rows`` it sends, by destination
    send_splits: list[list[int]]     # per piece: rows to each destination
    recv_splits: list[list[int]]     # per piece: rows from each source
    regroup: list[torch.Tensor]      # per piece: received rows in expert-major order
    ungroup: list[torch.Tensor]      # its inverse
    offsets: list[torch.Tensor]      # per piece: int32 [El] end row of each local expert


def _ranges(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` over the pairs, built without a Python loop over
    rows."""
    n = torch.tensor(lengths, dtype=torch.int64)
    total = sum(lengths)  # host integers: no tensor read
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    first = torch.tensor(starts, dtype=torch.int64) - (torch.cumsum(n, 0) - n)
    return torch.repeat_interleave(first, n, output_size=total) + torch.arange(total)


def _prefix(counts: list[list[int]]) -> list[list[int]]:
    """Start of each block of a [outer][inner] row-major layout."""
    out, at = [], 0
    for row in counts:
        out.append([])
        for n in row:
            out[-1].append(at)
            at += n
    return out


def _length(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]


def _build(send_n, recv_n, take_send, take_recv, pieces: int, device) -> Pieces:
    """``take_*(p, a, j, n) -> (lo, hi)``: piece p's sub-range of block (a, j) of length n."""
    ep, el = len(send_n), len(send_n[0])
    s_start = _prefix(send_n)
    out = Pieces([], [], [], [], [], [])
    for p in range(pieces):
        starts, lengths, splits = [], [], []
        for dst in range(ep):
            total = 0
            for j in range(el):
                lo, hi = take_send(p, dst, j, send_n[dst][j])
                starts.append(s_start[dst][j] + lo)
                lengths.append(hi - lo)
                total += hi - lo
            splits.append(total)
        out.send_index.append(_ranges(starts, lengths).to(device))
        out.send_splits.append(splits)
        # Received: by source, then local expert; m[s][j] rows of (s, j) in this piece.
        m = [[_length(take_recv(p, s, j, recv_n[s][j])) for j in range(el)] for s in range(ep)]
        out.recv_splits.append([sum(row) for row in m])
        pos = _prefix(m)
        regroup = _ranges([pos[s][j] for j in range(el) for s in range(ep)],
                          [m[s][j] for j in range(el) for s in range(ep)])
        out.regroup.append(regroup.to(device))
        out.ungroup.append(torch.argsort(regroup).to(device))
        per_expert = [sum(m[s][j] for s in range(ep)) for j in range(el)]
        out.offsets.append(torch.tensor(per_expert, dtype=torch.int64).cumsum(0)
                           .to(torch.int32).to(device))
    return out


def static_pieces(ep: int, el: int, cap: int, pieces: int, device) -> Pieces:
    """Capacity mode: every block is ``cap`` slots; piece p takes slots
    ``[p*cap//c, (p+1)*cap//c)`` of each."""
    c = max(1, min(pieces, cap))
    n = [[cap] * el for _ in range(ep)]

    def take(p, a, j, length):
        return p * length // c, (p + 1) * length // c

    return _build(n, n, take, take, c, device)


def counted_pieces(send_n: list[list[int]], recv_n: list[list[int]], pieces: int,
                   device) -> Pieces:
    """Dropless mode: piece p takes the whole blocks of local experts
    ``[p*El//c, (p+1)*El//c)`` (c at most El)."""
    el = len(send_n[0])
    c = max(1, min(pieces, el))

    def take(p, a, j, length):
        inside = p * el // c <= j < (p + 1) * el // c
        return (0, length) if inside else (0, 0)

    return _build(send_n, recv_n, take, take, c, device)


def encode(x: torch.Tensor, comm: EPComm) -> torch.Tensor:
    """The dispatch's wire rows: ``x`` itself, bf16, or per row ``[d int8 codes | d/block fp32
    scales]`` as one int8 row (the quantized collectives' kernels, round to nearest)."""
    if comm.dispatch == "same":
        return x
    if comm.dispatch == "bf16":
        return x.to(torch.bfloat16)
    rows, d = x.shape
    block = comm.quant_block
    wire = torch.empty(rows, d + 4 * (d // block), dtype=torch.int8, device=x.device)
    if rows:
        quant.quantize_into(x.contiguous().reshape(-1), wire[:, :d],
                            wire[:, d:].view(torch.float32), block=block, flat_row=d)
    return wire


def wire_row_bytes(comm: EPComm, d: int, dtype: torch.dtype) -> int:
    """Bytes of one row as ``encode`` puts it on the wire."""
    return {"same": d * dtype.itemsize, "bf16": 2 * d,
            "int8": d + 4 * (d // comm.quant_block)}[comm.dispatch]


def decode(wire: torch.Tensor, comm: EPComm, d: int, dtype: torch.dtype) -> torch.Tensor:
    if comm.dispatch == "same":
        return wire
    if comm.dispatch == "bf16":
        return wire.to(dtype)
    out = torch.empty(wire.shape[0] * d, dtype=torch.float32, device=wire.device)
    if wire.shape[0]:
        quant.dequantize_into(wire[:, :d], wire[:, d:].view(torch.float32), out,
                              block=comm.quant_block, flat_row=d)
    return out.view(-1, d).to(dtype)


def shared_backward(ctx, g_local, backend: str):
    """(input gradient or None, parameter gradients) of the shared expert an exchange ran
    (``ctx.local = (input, output)`` or None); the graph is kept for a zero-bubble replay."""
    if ctx.local is None:
        return None, ()
    lx, ly = ctx.local
    with piece_range(backend, "compute", "shared_grad"):
        grads = torch.autograd.grad(ly, (lx, *ctx.local_params), g_local, allow_unused=True,
                                    retain_graph=True)
    return grads[0], grads[1:]


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, w1, w2, local_x, pieces: Pieces, comm: EPComm, experts: Callable,
                local: Callable | None, *local_params):
        n = len(pieces.send_index)
        posted = []
        # A pipeline pair's other action runs at the first wait of each loop below (the later
        # pieces hide under this layer's own compute).
        for p in range(n):
            with piece_range("chunked", "comm", f"dispatch.{p}"):
                posted.append(comm.post(encode(rows.index_select(0, pieces.send_index[p]), comm),
                                        pieces.recv_splits[p], pieces.send_splits[p],
                                        op="moe dispatch"))
        local_saved = None
        if local is not None:  # the shared expert, while the dispatch is in flight
            with torch.enable_grad(), piece_range("chunked", "compute", "shared"):
                lx = local_x.detach().requires_grad_()
                ly = local(lx)
            local_saved = (lx, ly)
        w1_, w2_ = w1.detach().requires_grad_(), w2.detach().requires_grad_()
        saved, combines = [], []
        for p in range(n):
            got = decode(comm.finish(posted[p], switch=p == 0), comm, rows.shape[1],
                         rows.dtype)
            with torch.enable_grad(), piece_range("chunked", "gemm", p):
                x = got.index_select(0, pieces.regroup[p]).requires_grad_()
                y = experts(x, w1_, w2_, pieces.offsets[p])
            saved.append((x, y))
            with piece_range("chunked", "comm", f"combine.{p}"):
                combines.append(comm.post(y.detach().index_select(0, pieces.ungroup[p]),
                                          pieces.send_splits[p], pieces.recv_splits[p],
                                          op="moe combine"))
        back = rows.new_zeros(rows.shape)
        for p in range(n):
            back.index_copy_(0, pieces.send_index[p],
                             comm.finish(combines[p], switch=p == 0))
        ctx.pieces, ctx.comm, ctx.saved, ctx.weights = pieces, comm, saved, (w1_, w2_)
        ctx.local, ctx.local_params = local_saved, local_params
        ctx.rows_shape = rows.shape
        local_out = local_saved[1].detach() if local_saved is not None else rows.new_zeros(0)
        return back, local_out

    @staticmethod
    def backward(ctx, g_back, g_local):
        pieces, comm, saved = ctx.pieces, ctx.comm, ctx.saved
        n = len(pieces.send_index)
        g_back = g_back.contiguous()
        posted = []
        for p in range(n):
            with piece_range("chunked", "comm", f"combine_grad.{p}"):
                posted.append(comm.post(g_back.index_select(0, pieces.send_index[p]),
                                        pieces.recv_splits[p], pieces.send_splits[p],
                                        op="moe combine grad"))
        # the shared expert's backward under the first transfers
        d_local_x, local_grads = shared_backward(ctx, g_local, "chunked")
        w1_, w2_ = ctx.weights
        dw1, dw2, returns = None, None, []
        for p in range(n):
            g = comm.finish(posted[p], switch=p == 0).index_select(0, pieces.regroup[p])
            x, y = saved[p]
            with piece_range("chunked", "gemm", f"grad.{p}"):
                dx, d1, d2 = torch.autograd.grad(y, (x, w1_, w2_), g, allow_unused=True,
                                                 retain_graph=True)
                dw1 = d1 if dw1 is None else dw1 + d1
                dw2 = d2 if dw2 is None else dw2 + d2
            with piece_range("chunked", "comm", f"dispatch_grad.{p}"):
                returns.append(comm.post(dx.index_select(0, pieces.ungroup[p]),
                                         pieces.send_splits[p], pieces.recv_splits[p],
                                         op="moe dispatch grad"))
        d_rows = g_back.new_zeros(ctx.rows_shape)
        for p in range(n):
            d_rows.index_copy_(0, pieces.send_index[p],
                               comm.finish(returns[p], switch=p == 0))
        # ctx keeps its state (and the inner graphs are retained): a zero-bubble W pass
        # replays this backward (overlap.pp.backward); it all goes with the outer graph
        return (d_rows, dw1, dw2, d_local_x, None, None, None, None, *local_grads)


def exchange(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, pieces: Pieces,
             comm: EPComm, experts: Callable, *, local: torch.nn.Module | None = None,
             local_x: torch.Tensor | None = None):
    """``experts(x, w1, w2, offsets)`` of every row on its owner, returned to its source, in
    ``rows``' order, and ``local(local_x)`` (the shared expert) computed while the dispatch is
    in flight: returns ``(rows_out, local_out or None)``, differentiable in ``rows``, ``w1``,
    ``w2``, ``local_x`` and ``local``'s parameters."""
    params = tuple(local.parameters()) if local is not None else ()
    back, local_out = _Exchange.apply(rows, w1, w2, local_x, pieces, comm, experts, local,
                                      *params)
    return back, (local_out if local is not None else None)
