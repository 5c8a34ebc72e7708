"""The symmetric (userbuffer) EP exchange: rows written straight into the owners' buffers.

Every rank's workspace holds, per source rank ``s``: a counts row ``[El]`` int64, a receive
region of ``R + 1`` rows (``R``: the layer's rows per source; the last row takes the writes a
destination does not want), a combine region of ``R`` rows and two stamp slots. A call (phase
``p``): each source writes its rows for owner ``o`` at their place inside ``o``'s region ``s``,
its counts and its stamp (overlap.moe.stamps), then signals ``o``; each owner compares the
stamp and runs its experts on a source's region as soon as that source's signal is there (its
own first), with offsets from the counts on the device, and writes the results and its stamp
into the source's combine region, then signals it; each source compares and gathers its rows
back. No host sync in either mode. Buffers are single: a source writes call p+1 only after
reading every combine of call p, which each owner wrote after reading that source's call-p rows.
The narrative: docs/moe.md.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from overlap.defaults import align
from overlap.dist.stamp import STAMP_WORDS
from overlap.moe.exchange import decode, encode, piece_range, shared_backward
from overlap.moe.stamps import Signature

__all__ = ["Route", "Layout", "exchange_symmetric"]

_SLOT = STAMP_WORDS * 8  # bytes of a stamp slot


class Layout(NamedTuple):
    """Byte layout of one layer's calls in a rank's workspace."""
    rows: int         # R: rows per (source, owner) pair
    num_local: int    # El
    row_in: int       # bytes of a receive row (max of the wire row and the activation row)
    row_out: int      # bytes of a combine row

    def counts_at(self, s: int) -> int:
        return 8 * self.num_local * s

    def receive_at(self, ep: int, s: int) -> int:
        return align(8 * self.num_local * ep, 64) + s * (self.rows + 1) * self.row_in

    def combine_at(self, ep: int, s: int) -> int:
        return align(self.receive_at(ep, ep), 64) + s * self.rows * self.row_out

    def stamp_at(self, ep: int, s: int, answer: bool) -> int:
        """Source ``s``'s stamp slot: of its rows (in the owner's workspace) or, ``answer``,
        of owner ``s``'s answers (in the source's)."""
        return align(self.combine_at(ep, ep), 64) + (int(answer) * ep + s) * _SLOT

    def nbytes(self, ep: int) -> int:
        return self.stamp_at(ep, 0, True) + ep * _SLOT


class Route(NamedTuple):
    """Where each of this rank's routed rows comes from and goes: its row of the source
    tensor, its owner rank and its row inside the owner's region."""
    index: torch.Tensor | None  # [rows] int64 row of the source (-1: an empty slot); None: all
    owner: torch.Tensor    # [rows] int64
    place: torch.Tensor    # [rows] int64, < layout.rows
    counts: torch.Tensor   # [ep, El] int64: rows to each (owner, local expert)
    layout: Layout


class _Call:
    """One phase of the exchange over ``comm``'s workspace (forward or backward)."""

    def __init__(self, comm, layout: Layout, op: str, *, backward: bool):
        lane = comm.lane_of(backward)
        self.comm, self.ws, self.layout, self.op = comm, comm.workspace(op, lane), layout, op
        self.ep, self.rank = comm.world, comm.rank
        self.phase = comm.next_phase(op, lane)
        self._switched = False
        self.ticks = None  # (the rows' stamp, the answers' stamp), once ``stamp`` made them

    def stamp(self, sign: Signature, answer_op: str, src: torch.Tensor) -> None:
        """Count this call's two directions (rows, answers) and make their stamps."""
        if self.ep > 1:
            begin = self.comm.stamps.begin
            self.ticks = tuple(begin(op, sign, src.shape[1], src.dtype, 0, src.device,
                                     keep=True) for op in (self.op, answer_op))

    def _write_stamp(self, peer: int, answer: bool) -> None:
        if self.ticks is not None and peer != self.rank:
            lay = self.layout
            self._typed(peer, lay.stamp_at(self.ep, self.rank, answer), 1, _SLOT,
                        torch.int64)[0].copy_(self.ticks[int(answer)].send)

    def _check_stamp(self, peer: int, answer: bool) -> None:
        """After ``peer``'s signal: its stamp of this call against ours (skipped when a
        device-side wait gave up: the slot is stale, and the outputs are poisoned)."""
        if self.ticks is None or peer == self.rank or self.ws.pending():
            return
        row = self._typed(self.rank, self.layout.stamp_at(self.ep, peer, answer), 1, _SLOT,
                          torch.int64)[0]
        self.comm.stamps.verify_row(self.ticks[int(answer)], peer, row)

    def poison(self, *outs: torch.Tensor) -> None:
        """GPU: NaN the outputs if a stamp of this direction disagreed (recorded)."""
        if self.ticks is not None:
            self.ticks[0].agree.poison(*outs)

    def _typed(self, r: int, at: int, rows: int, row_bytes: int, dtype) -> torch.Tensor:
        return self.ws.view(r, dtype, (rows, row_bytes // dtype.itemsize), at)

    def send(self, src: torch.Tensor, index: torch.Tensor | None, route: Route,
             counts: bool) -> None:
        """Write the routed rows (``src[index]``; all of ``src`` if ``index`` is None) into
        every owner's region of this rank, then signal the owner."""
        with piece_range("symmetric", "comm", f"{self.op.replace(' ', '_')}.send"):
            self._send(src, index, route, counts)

    def _send(self, src: torch.Tensor, index: torch.Tensor | None, route: Route,
              counts: bool) -> None:
        lay, dtype = self.layout, src.dtype
        if src.shape[1] * dtype.itemsize > lay.row_in:
            raise ValueError(f"{self.op}: a row of {src.shape[1]} {dtype} does not fit the "
                             f"{lay.row_in}-byte rows the layer reserved (rank {self.rank}); "
                             "inputs must have the layer's dtype")
        kernel = self.comm.kernel
        if kernel == "triton" or (kernel == "auto" and src.device.type == "cuda"):
            from overlap.kernels.triton.ep_dispatch import dispatch_rows

            if index is None:
                index = torch.arange(src.shape[0], device=src.device)
            for o in self._order():  # before the kernel's signals, in stream order
                self._write_stamp(o, False)
            dispatch_rows(self.ws, src, index, route.owner, route.place, route.counts,
                          receive_off=lay.receive_at(self.ep, 0), rows=lay.rows,
                          row_bytes=lay.row_in, phase=self.phase)
            return
        rows = src if index is None else _take(src, index)
        for o in self._order():
            region = self._typed(o, lay.receive_at(self.ep, self.rank), lay.rows + 1,
                                 lay.row_in, dtype)[:, :rows.shape[1]]
            # Rows for other owners land in the trash row R: fixed shapes, no host sync.
            where = torch.where(route.owner == o, route.place, lay.rows)
            region.index_copy_(0, where, rows)
            if counts:
                self._typed(o, lay.counts_at(self.rank), 1, 8 * lay.num_local,
                            torch.int64)[0].copy_(route.counts[o])
            self._write_stamp(o, False)
            self.ws.signal(o, self.rank, self.phase)

    def receive(self, s: int, width: int, dtype) -> torch.Tensor:
        """Source ``s``'s rows (all R of them; those past its count are stale), waited for."""
        self._wait(s, s, "rows from")
        self._check_stamp(s, False)
        lay = self.layout
        return self._typed(self.rank, lay.receive_at(self.ep, s), lay.rows, lay.row_in,
                           dtype)[:, :width].clone()

    def received_counts(self, s: int) -> torch.Tensor:
        lay = self.layout
        return self._typed(self.rank, lay.counts_at(s), 1, 8 * lay.num_local,
                           torch.int64)[0].clone()

    def answer(self, s: int, y: torch.Tensor) -> None:
        """Write the results for source ``s`` into its combine region, then signal it."""
        lay = self.layout
        with piece_range("symmetric", "comm", f"{self.op.replace(' ', '_')}.answer.{s}"):
            self._typed(s, lay.combine_at(self.ep, self.rank), lay.rows, lay.row_out,
                        y.dtype)[:, :y.shape[1]].copy_(y)
            self._write_stamp(s, True)
            self.ws.signal(s, self.ep + self.rank, self.phase)

    def gather(self, route: Route, width: int, dtype) -> torch.Tensor:
        """This rank's rows back from every owner's answer, in ``rows``' order."""
        self._switched = False  # the answers' first wait is a hand-over point too
        for o in self._order():
            if o != self.rank:
                self._wait(self.ep + o, o, "results from")
                self._check_stamp(o, True)
        lay = self.layout
        every = self._typed(self.rank, lay.combine_at(self.ep, 0), self.ep * lay.rows,
                            lay.row_out, dtype)[:, :width]
        return every.index_select(0, route.owner * lay.rows + route.place)

    def sources(self) -> list[int]:
        return self._order()

    def _order(self) -> list[int]:
        return [(self.rank + i) % self.ep for i in range(self.ep)]

    def _wait(self, slot: int, peer: int, what: str) -> None:
        if peer == self.rank:
            return
        if not self._switched:  # a pipeline pair's other action runs at the first wait
            self._switched = True
            self.comm._switch()
        self.comm.wait_signal(self.ws, slot, self.phase, peer, f"{self.op} ({what} EP rank "
                                                                 f"{peer})")


def _take(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` with zero rows where ``index`` is -1."""
    rows = src.index_select(0, index.clamp_min(0))
    return torch.where((index >= 0).unsqueeze(1), rows, 0)


def _valid(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 end row of each expert, [rows, 1] bool: row holds a real token)."""
    ends = counts.cumsum(0)
    valid = torch.arange(rows, device=counts.device) < ends[-1]
    return ends.to(torch.int32), valid.unsqueeze(1)


class _SymmetricExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, w1, w2, local_x, route: Route, comm, experts: Callable,
                local: Callable | None, sign: Signature, *local_params):
        d = src.shape[1]
        call = _Call(comm, route.layout, "moe dispatch", backward=False)
        with comm.guard(call.op):
            call.ws.raise_pending(call.op)  # what a device-side wait of an earlier call recorded
            call.stamp(sign, "moe combine", src)
            # Encoded once per source row (not per routed row); the send gathers.
            wire = encode(src, comm)
            call.send(wire, route.index, route, counts=True)
            local_saved = None
            if local is not None:  # the shared expert, while the peers' rows arrive
                with torch.enable_grad(), piece_range("symmetric", "compute", "shared"):
                    lx = local_x.detach().requires_grad_()
                    ly = local(lx)
                local_saved = (lx, ly)
            w1_, w2_ = w1.detach().requires_grad_(), w2.detach().requires_grad_()
            saved = []
            for s in call.sources():
                got = call.receive(s, wire.shape[1], wire.dtype)
                ends, valid = _valid(call.received_counts(s), route.layout.rows)
                x = torch.where(valid, decode(got, comm, d, src.dtype), 0)
                with torch.enable_grad(), piece_range("symmetric", "gemm", s):
                    x.requires_grad_()
                    y = experts(x, w1_, w2_, ends)
                saved.append((s, x, y, ends, valid))
                call.answer(s, y.detach())
            back = call.gather(route, d, src.dtype)
            call.ws.poison_if_error(back)  # a device-side wait gave up: NaN, never stale rows
            call.poison(back)
        ctx.sign = sign
        ctx.route, ctx.comm, ctx.saved, ctx.weights = route, comm, saved, (w1_, w2_)
        ctx.local, ctx.local_params, ctx.src_shape = local_saved, local_params, src.shape
        local_out = local_saved[1].detach() if local_saved is not None else src.new_zeros(0)
        return back, local_out

    @staticmethod
    def backward(ctx, g_back, g_local):
        route, comm = ctx.route, ctx.comm
        g_back = g_back.contiguous()
        d = g_back.shape[1]
        call = _Call(comm, route.layout, "moe combine grad", backward=True)
        with comm.guard(call.op):
            call.ws.raise_pending(call.op)
            call.stamp(ctx.sign, "moe dispatch grad", g_back)
            call.send(g_back, None, route, counts=False)
            # the shared expert's backward under the transfers
            d_local_x, local_grads = shared_backward(ctx, g_local, "symmetric")
            w1_, w2_ = ctx.weights
            dw1 = dw2 = None
            for s, x, y, ends, valid in ctx.saved:
                g = torch.where(valid, call.receive(s, d, g_back.dtype), 0)
                with piece_range("symmetric", "gemm", f"grad.{s}"):
                    dx, d1, d2 = torch.autograd.grad(y, (x, w1_, w2_), g, retain_graph=True)
                    dw1 = d1 if dw1 is None else dw1 + d1
                    dw2 = d2 if dw2 is None else dw2 + d2
                call.answer(s, torch.where(valid, dx, 0))
            d_rows = call.gather(route, d, g_back.dtype)
            dw1, dw2 = dw1.contiguous(), dw2.contiguous()
            for t in (d_rows, dw1, dw2):
                call.ws.poison_if_error(t)
            call.poison(d_rows, dw1, dw2)
        if route.index is not None:  # the gradient of the gather: sum into the source rows
            index = route.index
            d_rows = g_back.new_zeros(ctx.src_shape).index_add_(
                0, index.clamp_min(0), torch.where((index >= 0).unsqueeze(1), d_rows, 0))
        # ctx keeps its state (and the inner graphs are retained): a zero-bubble W pass
        # replays this backward (overlap.pp.backward); it all goes with the outer graph
        return (d_rows, dw1, dw2, d_local_x, None, None, None, None, None, *local_grads)


def exchange_symmetric(src: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, route: Route,
                       comm, experts: Callable, *, local: torch.nn.Module | None = None,
                       local_x: torch.Tensor | None = None, layer: int = -1,
                       dropless: bool = True):
    """As ``overlap.moe.exchange.exchange``, over ``comm``'s workspace: routed row i is
    ``src[route.index[i]]`` (zeros for -1; ``src[i]`` without an index) and goes to
    ``route.owner[i]`` at ``route.place[i]``; returns ``(rows_out [n, d] in routed order,
    local_out or None)``, differentiable in ``src`` (gathered rows' gradients summed).
    ``layer`` and ``dropless`` (the mode): what the calls' stamps carry besides the sizes (not
    the capacity: ranks may route different token counts here)."""
    params = tuple(local.parameters()) if local is not None else ()
    sign = Signature(layer, comm.world * route.layout.num_local, dropless, 0)
    back, local_out = _SymmetricExchange.apply(src, w1, w2, local_x, route, comm, experts,
                                               local, sign, *params)
    return back, (local_out if local is not None else None)
