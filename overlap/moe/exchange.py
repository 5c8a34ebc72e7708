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
other pieces' transfers. ``c = 1`` is the sequential reference schedule. Each block sent to a
peer ends with ``k`` rows holding the call's stamp (overlap.moe.stamps), compared on arrival.
No host syncs: the split sizes come from host integers (static in capacity mode, counted once in
dropless mode). The narrative: docs/moe.md.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from overlap.comm.quant import kernels as quant
from overlap.moe.comm import EPComm
from overlap.moe.stamps import STAMP_BYTES, Signature, stamp_rows
from overlap.profile import names, nvtx

__all__ = ["Pieces", "PieceLayout", "static_pieces", "counted_pieces", "exchange", "encode",
           "decode", "wire_row_bytes", "piece_range"]


def piece_range(backend: str, role: str, index: object):
    """The profiler range of one piece of the MoE exchange: ``moe.<backend>.<role>[<index>]``
    (role comm, gemm or compute; overlap-analyze classifies it by the role)."""
    return nvtx.range(names.chunk("moe", backend, role, index))


class PieceLayout(NamedTuple):
    """One piece's index tensors and splits, with ``k`` stamp rows closing each block."""
    gather: torch.Tensor         # rows of the source it sends, by destination (stamp rows: 0)
    scatter: torch.Tensor        # where each row of the way back lands (stamp rows: row R)
    send_splits: list[int]       # rows to each destination (its rows, then k stamp rows)
    recv_splits: list[int]       # rows from each source
    regroup: torch.Tensor        # received rows (stamp rows skipped) in expert-major order
    ungroup: torch.Tensor        # expert-major rows in the receive layout (stamp rows: 0)
    offsets: torch.Tensor        # int32 [El] end row of each local expert
    stamps: dict[str, list[int]]  # first stamp row of each block: "send" / "recv" layout
    at: dict                     # byte positions of the stamps, by (side, row bytes)

    def stamp_bytes(self, side: str, buf: torch.Tensor) -> torch.Tensor:
        """[ep, STAMP_BYTES] byte positions of the stamps in ``buf`` laid out as ``side``."""
        row = buf.shape[1] * buf.element_size()
        key = (side, row)
        at = self.at.get(key)
        if at is None:  # once per layout and row size: a host-to-device copy of a few ints
            first = torch.tensor(self.stamps[side], dtype=torch.int64) * row
            at = self.at[key] = (first.unsqueeze(1) + torch.arange(STAMP_BYTES)).to(
                self.gather.device)
        return at


class Pieces:
    """The pieces of one exchange: per piece p, the (start, rows) of every block (dst, j) of
    the source that it sends and the rows of every block (source, j) it receives. ``layout(k)``
    builds (once per k) the index tensors with ``k`` stamp rows at the end of each block."""

    def __init__(self, send: list, recv: list, rows: int, ep: int, el: int, capacity: int,
                 device):
        self.send, self.recv, self.rows = send, recv, rows
        self.ep, self.el, self.capacity, self.device = ep, el, capacity, device
        self._layouts: dict[int, list[PieceLayout]] = {}

    def __len__(self) -> int:
        return len(self.send)

    def layout(self, k: int) -> list[PieceLayout]:
        out = self._layouts.get(k)
        if out is None:
            out = self._layouts[k] = [self._piece(p, k) for p in range(len(self))]
        return out

    def _piece(self, p: int, k: int) -> PieceLayout:
        starts, lengths, steps, splits, stamps_send = [], [], [], [], []
        at = 0
        for blocks in self.send[p]:
            n = sum(length for _, length in blocks)
            for start, length in blocks:
                starts.append(start), lengths.append(length), steps.append(1)
            starts.append(0), lengths.append(k), steps.append(0)
            stamps_send.append(at + n)
            splits.append(n + k)
            at += n + k
        gather = _ranges(starts, lengths, steps)
        trash = [self.rows if step == 0 else start for start, step in zip(starts, steps)]
        scatter = _ranges(trash, lengths, steps)
        # Received: by source, then local expert, then the source's k stamp rows.
        m = self.recv[p]
        pos, stamps_recv, recv_splits, at = [], [], [], 0
        for row in m:
            pos.append([])
            for n in row:
                pos[-1].append(at)
                at += n
            stamps_recv.append(at)
            recv_splits.append(sum(row) + k)
            at += k
        regroup = _ranges([pos[s][j] for j in range(self.el) for s in range(self.ep)],
                          [m[s][j] for j in range(self.el) for s in range(self.ep)])
        ungroup = torch.zeros(at, dtype=torch.int64).index_copy_(
            0, regroup, torch.arange(regroup.shape[0]))
        per_expert = [sum(m[s][j] for s in range(self.ep)) for j in range(self.el)]
        offsets = torch.tensor(per_expert, dtype=torch.int64).cumsum(0).to(torch.int32)
        dev = self.device
        return PieceLayout(gather.to(dev), scatter.to(dev), splits, recv_splits,
                           regroup.to(dev), ungroup.to(dev), offsets.to(dev),
                           {"send": stamps_send, "recv": stamps_recv}, {})


def _ranges(starts: list[int], lengths: list[int], steps: list[int] | None = None
            ) -> torch.Tensor:
    """Concatenation of ``start + step * arange(n)`` over the triples (step 1 by default),
    built without a Python loop over rows."""
    n = torch.tensor(lengths, dtype=torch.int64)
    total = sum(lengths)  # host integers: no tensor read
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    seg = torch.cumsum(n, 0) - n
    if steps is None:
        return torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64) - seg, n,
                                       output_size=total) + torch.arange(total)
    step = torch.tensor(steps, dtype=torch.int64)
    first = torch.tensor(starts, dtype=torch.int64) - step * seg
    return (torch.repeat_interleave(first, n, output_size=total)
            + torch.repeat_interleave(step, n, output_size=total) * torch.arange(total))


def _prefix(counts: list[list[int]]) -> list[list[int]]:
    """Start of each block of a [outer][inner] row-major layout."""
    out, at = [], 0
    for row in counts:
        out.append([])
        for n in row:
            out[-1].append(at)
            at += n
    return out


def _build(send_n, recv_n, take_send, take_recv, pieces: int, capacity: int,
           device) -> Pieces:
    """``take_*(p, a, j, n) -> (lo, hi)``: piece p's sub-range of block (a, j) of length n."""
    ep, el = len(send_n), len(send_n[0])
    s_start = _prefix(send_n)
    send, recv = [], []
    for p in range(pieces):
        send.append([])
        for dst in range(ep):
            blocks = []
            for j in range(el):
                lo, hi = take_send(p, dst, j, send_n[dst][j])
                blocks.append((s_start[dst][j] + lo, hi - lo))
            send[-1].append(blocks)
        recv.append([[_length(take_recv(p, s, j, recv_n[s][j])) for j in range(el)]
                     for s in range(ep)])
    rows = sum(sum(row) for row in send_n)
    return Pieces(send, recv, rows, ep, el, capacity, device)


def _length(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]


def static_pieces(ep: int, el: int, cap: int, pieces: int, device) -> Pieces:
    """Capacity mode: every block is ``cap`` slots; piece p takes slots
    ``[p*cap//c, (p+1)*cap//c)`` of each."""
    c = max(1, min(pieces, cap))
    n = [[cap] * el for _ in range(ep)]

    def take(p, a, j, length):
        return p * length // c, (p + 1) * length // c

    return _build(n, n, take, take, c, cap, device)


def counted_pieces(send_n: list[list[int]], recv_n: list[list[int]], pieces: int,
                   device) -> Pieces:
    """Dropless mode: piece p takes the whole blocks of local experts
    ``[p*El//c, (p+1)*El//c)`` (c at most El)."""
    el = len(send_n[0])
    c = max(1, min(pieces, el))

    def take(p, a, j, length):
        inside = p * el // c <= j < (p + 1) * el // c
        return (0, length) if inside else (0, 0)

    return _build(send_n, recv_n, take, take, c, 0, device)


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


def _gather(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]``; a source without rows lends a zero row to the stamp rows' index 0."""
    if src.shape[0] == 0 and index.shape[0]:
        src = src.new_zeros((1, *src.shape[1:]))
    return src.index_select(0, index)


class _Stamper:
    """The stamps of one exchange call (none on one rank): ``send`` counts a call and writes
    its stamp into the rows it sends, ``check`` compares the peers' in the rows received."""

    def __init__(self, comm: EPComm, sign: Signature, rows: torch.Tensor):
        self.comm, self.sign = comm, sign
        self.d, self.dtype, self.device = rows.shape[1], rows.dtype, rows.device
        self.k = 0
        if comm.world > 1:
            row = min(wire_row_bytes(comm, self.d, self.dtype), self.d * self.dtype.itemsize)
            self.k = stamp_rows(row)

    def send(self, op: str, p: int, lay: PieceLayout, side: str, buf: torch.Tensor):
        if not self.k:
            return None
        tick = self.comm.stamps.begin(op, self.sign, self.d, self.dtype, p, self.device)
        self.comm.stamps.write(tick, buf, lay.stamp_bytes(side, buf))
        return tick

    def check(self, tick, lay: PieceLayout, side: str, buf: torch.Tensor) -> None:
        if tick is not None:
            self.comm.stamps.verify(tick, buf, lay.stamp_bytes(side, buf))

    def poison(self, tick, *outs: torch.Tensor) -> None:
        """GPU: NaN the outputs if any stamp of this direction disagreed (recorded)."""
        if tick is not None:
            tick.agree.poison(*outs)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, w1, w2, local_x, pieces: Pieces, comm: EPComm, experts: Callable,
                local: Callable | None, sign: Signature, *local_params):
        n = len(pieces)
        stamper = _Stamper(comm, sign, rows)
        lays = pieces.layout(stamper.k)
        posted, sent = [], []
        # A pipeline pair's other action runs at the first wait of each loop below (the later
        # pieces hide under this layer's own compute).
        for p in range(n):
            with piece_range("chunked", "comm", f"dispatch.{p}"):
                wire = encode(_gather(rows, lays[p].gather), comm)
                sent.append(stamper.send("moe dispatch", p, lays[p], "send", wire))
                posted.append(comm.post(wire, lays[p].recv_splits, lays[p].send_splits,
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
            got = comm.finish(posted[p], switch=p == 0)
            stamper.check(sent[p], lays[p], "recv", got)  # before the experts read the rows
            got = decode(got, comm, rows.shape[1], rows.dtype)
            with torch.enable_grad(), piece_range("chunked", "gemm", p):
                x = got.index_select(0, lays[p].regroup).requires_grad_()
                y = experts(x, w1_, w2_, lays[p].offsets)
            saved.append((x, y))
            with piece_range("chunked", "comm", f"combine.{p}"):
                out = _gather(y.detach(), lays[p].ungroup)
                sent[p] = stamper.send("moe combine", p, lays[p], "recv", out)
                combines.append(comm.post(out, lays[p].send_splits, lays[p].recv_splits,
                                          op="moe combine"))
        back = rows.new_zeros((pieces.rows + 1, rows.shape[1]))  # the last row: stamp rows
        for p in range(n):
            got = comm.finish(combines[p], switch=p == 0)
            stamper.check(sent[p], lays[p], "send", got)
            back.index_copy_(0, lays[p].scatter, got)
        back = back[:pieces.rows]
        stamper.poison(sent[-1] if n else None, back)
        ctx.lays, ctx.stamper, ctx.comm, ctx.saved = lays, stamper, comm, saved
        ctx.weights, ctx.rows = (w1_, w2_), pieces.rows
        ctx.local, ctx.local_params = local_saved, local_params
        ctx.rows_shape = rows.shape
        local_out = local_saved[1].detach() if local_saved is not None else rows.new_zeros(0)
        return back, local_out

    @staticmethod
    def backward(ctx, g_back, g_local):
        lays, stamper, comm, saved = ctx.lays, ctx.stamper, ctx.comm, ctx.saved
        n = len(lays)
        g_back = g_back.contiguous()
        posted, sent = [], []
        for p in range(n):
            with piece_range("chunked", "comm", f"combine_grad.{p}"):
                buf = _gather(g_back, lays[p].gather)
                sent.append(stamper.send("moe combine grad", p, lays[p], "send", buf))
                posted.append(comm.post(buf, lays[p].recv_splits, lays[p].send_splits,
                                        op="moe combine grad"))
        # the shared expert's backward under the first transfers
        d_local_x, local_grads = shared_backward(ctx, g_local, "chunked")
        w1_, w2_ = ctx.weights
        dw1, dw2, returns = None, None, []
        for p in range(n):
            got = comm.finish(posted[p], switch=p == 0)
            stamper.check(sent[p], lays[p], "recv", got)
            g = got.index_select(0, lays[p].regroup)
            x, y = saved[p]
            with piece_range("chunked", "gemm", f"grad.{p}"):
                dx, d1, d2 = torch.autograd.grad(y, (x, w1_, w2_), g, allow_unused=True,
                                                 retain_graph=True)
                dw1 = d1 if dw1 is None else dw1 + d1
                dw2 = d2 if dw2 is None else dw2 + d2
            with piece_range("chunked", "comm", f"dispatch_grad.{p}"):
                buf = _gather(dx, lays[p].ungroup)
                sent[p] = stamper.send("moe dispatch grad", p, lays[p], "recv", buf)
                returns.append(comm.post(buf, lays[p].send_splits, lays[p].recv_splits,
                                         op="moe dispatch grad"))
        d_rows = g_back.new_zeros((ctx.rows + 1, ctx.rows_shape[1]))
        for p in range(n):
            got = comm.finish(returns[p], switch=p == 0)
            stamper.check(sent[p], lays[p], "send", got)
            d_rows.index_copy_(0, lays[p].scatter, got)
        d_rows = d_rows[:ctx.rows]
        stamper.poison(sent[-1] if n else None, *(t for t in (d_rows, dw1, dw2)
                                                  if t is not None))
        # ctx keeps its state (and the inner graphs are retained): a zero-bubble W pass
        # replays this backward (overlap.pp.backward); it all goes with the outer graph
        return (d_rows, dw1, dw2, d_local_x, None, None, None, None, None, *local_grads)


def exchange(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, pieces: Pieces,
             comm: EPComm, experts: Callable, *, local: torch.nn.Module | None = None,
             local_x: torch.Tensor | None = None, layer: int = -1):
    """``experts(x, w1, w2, offsets)`` of every row on its owner, returned to its source, in
    ``rows``' order, and ``local(local_x)`` (the shared expert) computed while the dispatch is
    in flight: returns ``(rows_out, local_out or None)``, differentiable in ``rows``, ``w1``,
    ``w2``, ``local_x`` and ``local``'s parameters. ``layer``: the caller's index on ``comm``
    (``EPComm.new_layer``), which every call's stamp carries (-1: none)."""
    params = tuple(local.parameters()) if local is not None else ()
    sign = Signature(layer, pieces.ep * pieces.el, pieces.capacity == 0, pieces.capacity)
    back, local_out = _Exchange.apply(rows, w1, w2, local_x, pieces, comm, experts, local,
                                      sign, *params)
    return back, (local_out if local is not None else None)
