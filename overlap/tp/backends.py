"""The fused TP ops' backends, as classes behind one small protocol (the autograd layer is
overlap.tp.ops; the settings and state live on overlap.tp.comm.TPComm).

A backend says how big a workspace an op needs for a shape (``workspace``; None: no workspace)
and implements the three ops on 2-D, validated inputs: ``ChunkedBackend`` (ring / chunked
collectives, any transport), ``SymmetricBackend`` (userbuffers on one host), ``TritonBackend``
(Triton kernels; the "auto" choice on CUDA, never on CPU) and ``UnfusedBackend`` ("unfused":
the no-overlap baseline; its collectives, and the backward's plain gather and scatter without a
header block, carry the call's stamp in stamped rows or a SUM tail).

Contract: workspace sizes are computed only here, and the phase counter lives only on the
context. Default ``chunks`` = world for every op.
The narrative: docs/design/tp.md.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.distributed as dist

from overlap.tp import chunked, symmetric
from overlap.versions import triton_problem
from overlap.tp.context import TPContext
from overlap.dist.device import plain_gloo
from overlap.dist.stamp import (STAMP_WORDS, Agreement, pack_sum_tail, sum_tail_bits,
                                sum_tail_chunks, unpack_sum_tail)
from overlap.tp.collectives import (all_gather_dim, post_all_gather, post_all_reduce,
                                    post_reduce_scatter, reduce_scatter_dim, wait)
from overlap.tp.stamps import WORDS

__all__ = ["Backend", "ChunkedBackend", "SymmetricBackend", "TritonBackend", "UnfusedBackend",
           "backend_for", "have_triton_tp", "auto_backend", "triton_refusal", "gather",
           "scatter", "stamped_all_gather", "stamped_reduce_scatter", "stamped_all_reduce_start",
           "stamped_all_reduce_finish"]

_TRITON_MODULE = "overlap.kernels.triton.tp_gemm"
_WORKING = "'auto', 'symmetric' (one host), 'chunked', 'unfused'"


def have_triton_tp() -> bool:
    """Whether the Triton backend can run here (a supported Triton is installed)."""
    return triton_problem() is None


def triton_refusal(where: str) -> str | None:
    """The one-line refusal of backend='triton' where Triton cannot run its kernels, or None."""
    problem = triton_problem()
    if problem is None:
        return None
    return (f"TPComm: backend='triton' cannot run here: {problem}; the backends that work "
            f"here: {_WORKING}{where}")


def auto_backend(device: torch.device, one_host: bool, where: str) -> str:
    """What backend='auto' runs on a group of several ranks: the Triton kernels on CUDA where
    Triton can run them, else userbuffers on one host, else the chunked collectives. On CUDA
    without a usable Triton it says so in one warning (the fused kernels are not used)."""
    if device.type != "cuda":
        return "symmetric" if one_host else "chunked"
    problem = triton_problem()
    if problem is None:
        return "triton"
    choice = "symmetric" if one_host else "chunked"
    import warnings

    warnings.warn(f"TPComm: backend='auto' runs '{choice}', not 'triton': {problem}{where}",
                  RuntimeWarning, stacklevel=4)
    return choice


class Backend:
    """The protocol; ``comm`` is the TPComm the op runs on."""

    name = "?"

    has_workspace = False  # whether ``workspace`` can return anything but None

    def workspace(self, op: str, rows: int, k: int, n: int, world: int,
                  dtype: torch.dtype, chunks: int = 0) -> tuple[int, int] | None:
        """(bytes per rank, signals) for an op whose input has ``rows`` rows (the shard's m for
        all_gather_matmul, the full M otherwise) run in ``chunks`` pieces, or None when it
        needs no workspace."""
        return None

    def all_gather_matmul(self, comm, context, x_shard, w, *, chunks: int, return_gathered: bool):
        raise NotImplementedError

    def matmul_reduce_scatter(self, comm, context, x, w, *, chunks: int,
                              overlap_with: Callable[[], None] | None):
        raise NotImplementedError

    def matmul_all_reduce(self, comm, context, x, w, *, chunks: int):
        raise NotImplementedError


class ChunkedBackend(Backend):
    """Also the fallback of the workspace backends (no workspace for the shape): their
    header-block stamps are settled first (overlap.tp.stamps)."""

    name = "chunked"

    def all_gather_matmul(self, comm, context, x_shard, w, *, chunks, return_gathered):
        comm.settle()
        return chunked.all_gather_matmul(x_shard, w, group=comm.group, chunks=chunks,
                                         return_gathered=return_gathered, timeout=comm.timeout,
                                         agree=comm.agree)

    def matmul_reduce_scatter(self, comm, context, x, w, *, chunks, overlap_with):
        comm.settle()
        return chunked.matmul_reduce_scatter(x, w, group=comm.group, chunks=chunks,
                                             overlap_with=overlap_with, timeout=comm.timeout,
                                             agree=comm.agree)

    def matmul_all_reduce(self, comm, context, x, w, *, chunks):
        comm.settle()
        return chunked.matmul_all_reduce(x, w, group=comm.group, chunks=chunks,
                                         timeout=comm.timeout, agree=comm.agree)


class SymmetricBackend(Backend):
    name = "symmetric"
    has_workspace = True

    def workspace(self, op, rows, k, n, world, dtype, chunks=0):
        if world == 1 or chunks == 1:  # one piece: the chunked backend's whole collective
            return None
        if op == "all_gather_matmul":
            nbytes = symmetric.ag_bytes(rows, k, dtype)
        elif op == "matmul_reduce_scatter":
            nbytes = symmetric.rs_bytes(rows // world, n, world, dtype)
        else:
            nbytes = symmetric.ar_bytes(rows, n, world, dtype)
        return nbytes, symmetric.num_signals(op, world)

    def all_gather_matmul(self, comm, context, x_shard, w, *, chunks, return_gathered):
        if context is None:
            return _BACKENDS["chunked"].all_gather_matmul(comm, None, x_shard, w, chunks=chunks,
                                                          return_gathered=return_gathered)
        return _poisoned(comm, context, "all_gather_matmul", lambda: symmetric.all_gather_matmul(
            context, x_shard, w, chunks=chunks, return_gathered=return_gathered))

    def matmul_reduce_scatter(self, comm, context, x, w, *, chunks, overlap_with):
        if context is None:
            return _BACKENDS["chunked"].matmul_reduce_scatter(comm, None, x, w, chunks=chunks,
                                                              overlap_with=overlap_with)
        return _poisoned(comm, context, "matmul_reduce_scatter",
                         lambda: symmetric.matmul_reduce_scatter(context, x, w, chunks=chunks,
                                                                 overlap_with=overlap_with))

    def matmul_all_reduce(self, comm, context, x, w, *, chunks):
        if context is None:
            return _BACKENDS["chunked"].matmul_all_reduce(comm, None, x, w, chunks=chunks)
        return _poisoned(comm, context, "matmul_all_reduce",
                         lambda: symmetric.matmul_all_reduce(context, x, w, chunks=chunks))


def _poisoned(comm, context, op: str, run):
    """Run a symmetric op with the workspace's poisoned-output contract (overlap.symm.base):
    first raise what a device-side wait of an earlier op recorded (no host sync), then, after
    the op, poison its outputs in stream order if one of its own waits gave up."""
    context.ws.raise_pending(op)
    out = run()
    for t in (out if isinstance(out, tuple) else (out,)):
        if t is not None:
            context.ws.poison_if_error(t)
    return _stamp_poisoned(comm, out)


def _stamp_poisoned(comm, out):
    """Compare this call's stamps (overlap.tp.stamps; raises on CPU), then poison a workspace
    backend's outputs if the stamp wait gave up or (GPU) the device found a peer's stamp
    foreign; the next call raises."""
    comm.settle()
    outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]
    if comm.header is not None:
        for t in outs:
            comm.header.poison(t)
    if comm.agree is not None:
        comm.agree.poison(*outs)
    return out


class TritonBackend(Backend):
    """The kernels fuse the wait into the GEMM; ``chunks`` does not apply (tiles are the
    granularity). ``matmul_all_reduce`` = ``matmul_reduce_scatter`` then a plain all-gather of
    the reduced shards (M padded to a multiple of world with zero rows). The backward's wgrad
    GEMM runs after the kernel call (on a GPU both go to the current stream)."""

    name = "triton"
    has_workspace = True

    @staticmethod
    def _kernels():
        return importlib.import_module(_TRITON_MODULE)

    def workspace(self, op, rows, k, n, world, dtype, chunks=0):
        kern = self._kernels()
        if op == "all_gather_matmul":
            return (kern.all_gather_matmul_workspace_bytes(rows, k, world, dtype),
                    kern.all_gather_matmul_num_signals(world))
        m = -(-rows // world)
        return (kern.matmul_reduce_scatter_workspace_bytes(m, n, world, dtype),
                kern.matmul_reduce_scatter_num_signals(world))

    def all_gather_matmul(self, comm, context, x_shard, w, *, chunks, return_gathered):
        comm.settle()  # the kernels wait on the device: no host slow path to watch from
        m, k = x_shard.shape
        need, _ = self.workspace("all_gather_matmul", m, k, w.shape[1], context.world,
                                 x_shard.dtype)
        context.require("all_gather_matmul", need, f"a shard of {m} x {k} {x_shard.dtype}")
        # sync=False: no host read of the status word per call (see tp_sync.finish_call).
        return _stamp_poisoned(comm, self._kernels().all_gather_matmul(
            context.ws, x_shard.contiguous(), w.contiguous(), phase=context.next_phase(),
            return_gathered=return_gathered, sync=False))

    def matmul_reduce_scatter(self, comm, context, x, w, *, chunks, overlap_with,
                              op="matmul_reduce_scatter"):
        comm.settle()
        need, _ = self.workspace("matmul_reduce_scatter", x.shape[0], x.shape[1], w.shape[1],
                                 context.world, x.dtype)
        context.require(op, need, f"a {x.shape[0]} x {w.shape[1]} {x.dtype} product")
        y = self._kernels().matmul_reduce_scatter(context.ws, x.contiguous(), w.contiguous(),
                                    phase=context.next_phase(), sync=False)
        if overlap_with is not None:
            overlap_with()
        return _stamp_poisoned(comm, y)

    def matmul_all_reduce(self, comm, context, x, w, *, chunks):
        rows, world = x.shape[0], context.world
        if rows % world:
            x = torch.cat([x, x.new_zeros(world - rows % world, x.shape[1])])
        y_shard = self.matmul_reduce_scatter(comm, context, x, w, chunks=chunks, overlap_with=None,
                                             op="matmul_all_reduce")
        return all_gather_dim(y_shard, 0, group=comm.group, op="matmul_all_reduce (triton)",
                              timeout=comm.timeout)[:rows]


class UnfusedBackend(Backend):
    """Collective then GEMM (GEMM then collective), nothing overlapped; any transport. Each
    collective carries the call's stamp (stamped rows, a SUM tail: below)."""

    name = "unfused"

    def all_gather_matmul(self, comm, context, x_shard, w, *, chunks, return_gathered):
        gathered = x_shard  # 2-D and validated: the collective without all_gather_dim's logic
        if comm.world > 1:
            gathered = stamped_all_gather(comm, x_shard, "all_gather_matmul (unfused)")
        y = None if w is None else gathered @ w
        return y, (gathered if return_gathered or w is None else None)

    def matmul_reduce_scatter(self, comm, context, x, w, *, chunks, overlap_with):
        y = x @ w
        if comm.world > 1:
            y = stamped_reduce_scatter(comm, y, "matmul_reduce_scatter (unfused)")
        if overlap_with is not None:  # after the collective: nothing runs under it
            overlap_with()
        return y

    def matmul_all_reduce(self, comm, context, x, w, *, chunks):
        if comm.world == 1:
            return x @ w
        return stamped_matmul_all_reduce(comm, x, w, "matmul_all_reduce (unfused)")


# ---- stamps in the plain collectives (the unfused backend, the backward's gather/scatter) ---
# An all-gather moves bytes: each rank's row is its stamp, then its piece. A SUM carries small
# integers exactly: a tail of [world, WORDS * chunks] elements in the buffer's dtype, this
# rank's stamp in its own row and zeros elsewhere (overlap.dist.stamp.pack_sum_tail), appended
# to every rank's part. The received stamps land in ``agree.recv`` by one device copy and are
# compared before the data is read (CPU: Disagreement; GPU: recorded, outputs poisoned, raised
# without a sync). The price: a copy of the exchanged tensor into (or out of) the stamped
# buffer, and a tail of world * 12 * 64 / bits elements per part.

_HEAD_BYTES = STAMP_WORDS * 8


def _stamps_alone(comm, op: str) -> None:
    """Plain gloo, before a collective whose sizes follow the call: all-gather this call's
    stamp alone (128 bytes a rank) and compare it, so ranks whose sizes differ raise a
    Disagreement instead of gloo aborting the process (or returning garbage) on a message of
    another size. Other transports refuse such sizes themselves or hang till the timeout."""
    agree = comm.agree
    plain = agree.transport.get("plain gloo")
    if plain is None:
        plain = agree.transport["plain gloo"] = plain_gloo(comm.group)
    if plain:
        every = agree.send.new_empty(comm.world * STAMP_WORDS)
        wait(post_all_gather(every, agree.send, comm.group), op=f"{op}: the stamps alone",
             group=comm.group, timeout=comm.timeout)
        _verify(agree, op, every.view(comm.world, STAMP_WORDS))


def _verify(agree: Agreement, op: str, words: torch.Tensor) -> None:
    """Compare ``words`` [world, <= STAMP_WORDS] (row q from rank q) with this call's stamp."""
    agree.clear_received()
    agree.recv[:, :words.shape[1]].copy_(words)
    agree.verify(op, [q for q in range(agree.world) if q != agree.rank])


def stamped_all_gather(comm, x: torch.Tensor, op: str) -> torch.Tensor:
    """Every rank's ``x`` [m, k] in rank order, [world * m, k], the stamps checked."""
    _stamps_alone(comm, op)
    agree, (m, k) = comm.agree, x.shape
    nbytes = m * k * x.element_size()
    row = _HEAD_BYTES + -(-nbytes // 16) * 16  # the piece 16-byte aligned behind the stamp
    mine = torch.empty(row, dtype=torch.uint8, device=x.device)
    mine[:_HEAD_BYTES].view(torch.int64).copy_(agree.send)
    mine[_HEAD_BYTES:_HEAD_BYTES + nbytes].view(x.dtype).view(m, k).copy_(x)
    every = mine.new_empty(comm.world, row)
    wait(post_all_gather(every.view(-1), mine, comm.group), op=op, group=comm.group,
         timeout=comm.timeout)
    _verify(agree, op, every[:, :_HEAD_BYTES].view(torch.int64))
    out = x.new_empty(comm.world * m, k)
    out.view(comm.world, m * k).copy_(every[:, _HEAD_BYTES:_HEAD_BYTES + nbytes].view(x.dtype))
    agree.poison(out)
    return out


def _tail(comm, dtype: torch.dtype, op: str) -> tuple[int, int]:
    """(bits per chunk, elements) of a SUM tail in ``dtype``."""
    bits = sum_tail_bits(dtype)
    if not bits:
        raise TypeError(f"{op}: a reduction of dtype {dtype} cannot carry the call's stamp"
                        f"{comm.where}")
    return bits, comm.world * WORDS * sum_tail_chunks(bits)


def _pack(agree: Agreement, tails: torch.Tensor, bits: int) -> None:
    """``tails`` [..., world, WORDS * chunks]: this rank's row its stamp, the others zero."""
    tails.zero_()
    tails[..., agree.rank, :].copy_(pack_sum_tail(agree.send[:WORDS], bits))


def stamped_reduce_scatter(comm, y: torch.Tensor, op: str) -> torch.Tensor:
    """This rank's rows [M / world, n] of the sum over ranks of ``y`` [M, n], stamps checked."""
    world, (rows, n) = comm.world, y.shape
    part = rows // world * n
    bits, tail = _tail(comm, y.dtype, op)
    _stamps_alone(comm, op)
    # Every part carries the whole tail, so every rank receives every rank's stamp.
    send = y.new_empty(world, part + tail)
    send[:, :part].copy_(y.view(world, part))
    _pack(comm.agree, send[:, part:].view(world, world, -1), bits)
    out = y.new_empty(part + tail)
    wait(post_reduce_scatter(out, send.view(-1), comm.group), op=op, group=comm.group,
         timeout=comm.timeout)
    _verify(comm.agree, op, unpack_sum_tail(out[part:].view(world, -1), bits))
    res = out[:part].view(rows // world, n)
    comm.agree.poison(res)
    return res


def stamped_matmul_all_reduce(comm, x: torch.Tensor, w: torch.Tensor, op: str) -> torch.Tensor:
    """The sum over ranks of ``x @ w``: the GEMM writes straight into the reduced buffer, in
    front of the tail; stamps checked."""
    rows, n = x.shape[0], w.shape[1]
    bits, tail = _tail(comm, x.dtype, op)
    _stamps_alone(comm, op)
    buf = x.new_empty(rows * n + tail)
    y = buf[:rows * n].view(rows, n)
    torch.mm(x, w, out=y)
    _pack(comm.agree, buf[rows * n:].view(comm.world, -1), bits)
    wait(post_all_reduce(buf, comm.group), op=op, group=comm.group, timeout=comm.timeout)
    _verify(comm.agree, op, unpack_sum_tail(buf[rows * n:].view(comm.world, -1), bits))
    comm.agree.poison(y)
    return y


def stamped_all_reduce_start(comm, shape, like: torch.Tensor, op: str, fill):
    """Post a sum all-reduce of a [shape] tensor that ``fill(y)`` writes in front of the
    stamp tail (a copy, or a GEMM with ``out=``); returns what ``stamped_all_reduce_finish``
    takes, so independent work can run while the collective is in flight."""
    bits, tail = _tail(comm, like.dtype, op)
    _stamps_alone(comm, op)
    numel = 1
    for d in shape:
        numel *= int(d)
    buf = like.new_empty(numel + tail)
    y = buf[:numel].view(shape)
    fill(y)
    _pack(comm.agree, buf[numel:].view(comm.world, -1), bits)
    return post_all_reduce(buf, comm.group), buf, y, bits


def stamped_all_reduce_finish(comm, started, op: str) -> torch.Tensor:
    """Wait for ``stamped_all_reduce_start``'s collective, compare the stamps, return y."""
    work, buf, y, bits = started
    numel = y.numel()
    wait(work, op=op, group=comm.group, timeout=comm.timeout)
    _verify(comm.agree, op, unpack_sum_tail(buf[numel:].view(comm.world, -1), bits))
    comm.agree.poison(y)
    return y


_BACKENDS = {b.name: b for b in (ChunkedBackend(), SymmetricBackend(), TritonBackend(),
                                  UnfusedBackend())}


def backend_for(comm) -> Backend:
    """The backend object of ``comm`` (a float64 call on triton, which has no float64 kernels,
    is refused by the input checks before it gets here)."""
    return _BACKENDS[comm.backend]


def context_for(comm, backend: Backend, op: str, x: torch.Tensor, w: torch.Tensor,
                chunks: int) -> TPContext | None:
    """The comm's workspace context for this op, shape and piece count (None when the
    backend needs no workspace for it). Sized once, when the context is made; later calls
    find it by its key."""
    if not backend.has_workspace:
        return None
    rows, k, n = x.shape[0], x.shape[1], w.shape[1]
    key = (op, backend.name, rows, k, n, x.dtype, x.device)
    found = comm.find_context(key)
    if found is not None and chunks != 1:
        return found
    need = backend.workspace(op, rows, k, n, comm.world, x.dtype, chunks)
    if need is None:
        return None

    def create() -> TPContext:
        return TPContext(op=op, backend=backend.name, group=comm.group, nbytes=need[0],
                         num_signals=need[1], device=x.device, timeout=comm.timeout)

    return comm.context(key, create)


def gather(comm, x_shard: torch.Tensor) -> torch.Tensor:
    """all_gather along dim 0 with no GEMM (a backward that needs only the gathered tensor).
    Without a header block (chunked, unfused) the stamp rides in the gathered rows."""
    comm.settle()
    if comm.header is None and comm.agree is not None:
        return stamped_all_gather(comm, x_shard, "all_gather (tp backward)")
    return all_gather_dim(x_shard, 0, group=comm.group, op="all_gather (tp backward)",
                          timeout=comm.timeout)


def scatter(comm, x: torch.Tensor) -> torch.Tensor:
    """reduce_scatter along dim 0 with no GEMM; the stamp in a SUM tail as ``gather``'s."""
    comm.settle()
    if comm.header is None and comm.agree is not None:
        return stamped_reduce_scatter(comm, x.contiguous(), "reduce_scatter (tp backward)")
    return reduce_scatter_dim(x, 0, group=comm.group, op="reduce_scatter (tp backward)",
                              timeout=comm.timeout)
