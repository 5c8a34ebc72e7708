"""Autograd-aware collectives at the edges of tensor- and sequence-parallel regions.

Forward/backward pairs of collectives that are each other's adjoint (``tp`` = size of the group):
    function                    forward                     backward
    copy_to_tp                  identity                    all_reduce(dy)
    reduce_from_tp              all_reduce(x)               identity
    scatter_to_tp(dim)          x.chunk(tp, dim)[rank]      all_gather(dy, dim)
    gather_from_tp(dim)         all_gather(x, dim)          dy.chunk(tp, dim)[rank]
    reduce_scatter_to_sp(dim)   reduce_scatter(x, dim)      all_gather(dy, dim)
    gather_from_sp(dim)         all_gather(x, dim)          reduce_scatter(dy, dim)

Contract: ``sizes`` (one per rank) gives gather_from_tp/scatter_to_tp uneven shards. Each takes
``comm=`` (eager: ``group=``, ``timeout=``); every collective waits with a timeout and carries
its call's stamp (a foreign one raises Disagreement on every rank); any error fails the
communicator, which then refuses every call. Size 1: the identity. docs/design/nn.md.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from overlap.defaults import TIMEOUT_S
from overlap.dist.stamp import DTYPE_CODES, shape_words
from overlap.tp.backends import (stamped_all_gather, stamped_all_reduce_finish,
                                 stamped_all_reduce_start, stamped_reduce_scatter)
from overlap.tp.collectives import (all_gather_dim, all_reduce_async, reduce_scatter_dim,
                                    split_dim, wait)
from overlap.tp.comm import BACKENDS, TPComm, TPCommFailed, default_comm
from overlap.tp.ops import call_op, define_op

__all__ = ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
           "reduce_scatter_to_sp", "gather_from_sp", "all_reduce_async", "wait",
           "all_gather_dim", "reduce_scatter_dim", "split_dim", "stamp_call", "guarded"]


# ---------------------------------------------------------------- the implementations
# One each, reached directly in eager and through its custom op under torch.compile
# (overlap.tp.ops.call_op). ``comm`` is the layer's TPComm, or in eager a ``_Group``. Outputs
# never alias inputs (a custom op's rule). Every collective goes through the stamped ones of
# overlap.tp.backends (a row of [stamp, piece] per rank for an all-gather, a SUM tail for an
# all-reduce or reduce-scatter; on plain gloo the stamps alone first), so a call that pairs
# with another (a rank skipped one, or made an extra one) raises instead of mixing data.

class _Group:
    """The ``group=`` form: the group's default "unfused" TPComm (no workspace: its stamps
    and failure state) with this call's timeout."""

    __slots__ = ("comm", "group", "timeout", "world", "rank", "agree", "backend")

    def __init__(self, group, timeout: float):
        self.comm = default_comm(group, backend="unfused", op="overlap region collective")
        self.group, self.timeout = group, timeout
        self.world, self.rank = self.comm.world, self.comm.rank
        self.agree, self.backend = self.comm.agree, self.comm.backend

    def __getattr__(self, name: str):
        # where, check_usable, fail, guard, ...: the communicator's own (one failure rule)
        if name == "comm":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.comm, name)

    def settle(self) -> None:
        pass  # backend "unfused": no header block, nothing left open


def stamp_call(comm, op: str, shape, dtype: torch.dtype, *, w_words=(), flags: int = 0) -> None:
    """Count the call on ``comm`` and write its stamp (overlap.tp.stamps.SCHEMA, one of
    REGION_OPS): ``shape`` as every rank sends it, ``w_words`` into "w shape" and ``flags``
    (a region's dim, the column layer's number)."""
    comm.settle()  # a fused op's header-block stamp is compared before another collective
    key = ("region", op, tuple(shape), dtype, tuple(w_words), flags)
    comm.agree.next(op, key=key, make=lambda: {
        "x shape": shape_words(shape, 3), "w shape": shape_words(w_words, 2),
        "dtype": DTYPE_CODES.get(dtype, 0), "chunks": 0, "flags": flags,
        "backend": BACKENDS.index(comm.backend)})


def guarded(comm, op: str, run):
    """``run()`` on a usable communicator; any error fails it (peers raise too, later calls
    raise TPCommFailed with the first error), as every fused op's does."""
    comm.check_usable(op)
    try:
        return run()
    except TPCommFailed:
        raise
    except BaseException as exc:
        comm.fail(exc)
        raise


def _sizes_words(sizes) -> tuple[int, ...]:
    """Uneven ``sizes`` as (total, crc32 of the list): ranks must pass the same list."""
    if sizes is None:
        return ()
    return sum(sizes), zlib.crc32(",".join(str(int(s)) for s in sizes).encode())


def _reduce(x: torch.Tensor, comm: TPComm, op: str) -> torch.Tensor:
    def run():
        stamp_call(comm, op, x.shape, x.dtype)
        return stamped_all_reduce_finish(comm, stamped_all_reduce_start(
            comm, x.shape, x, op, lambda y: y.copy_(x)), op)
    return guarded(comm, op, run)


def _gather(x: torch.Tensor, dim: int, comm: TPComm, sizes: list[int] | None,
            op: str) -> torch.Tensor:
    def run():
        xm = x.movedim(dim, 0) if dim else x
        n = xm.shape[0]
        rows = max(sizes) if sizes is not None else n  # uneven shards padded on the wire
        wire = (rows, *xm.shape[1:])
        stamp_call(comm, op, wire, x.dtype, w_words=_sizes_words(sizes), flags=dim)
        piece = xm if rows == n else torch.cat([xm, xm.new_zeros((rows - n, *wire[1:]))])
        out = stamped_all_gather(comm, piece.reshape(rows, math.prod(wire[1:])), op)
        out = out.view(comm.world * rows, *wire[1:])
        if sizes is not None:
            out = torch.cat([out[r * rows: r * rows + s] for r, s in enumerate(sizes)])
        return (out.movedim(0, dim) if dim else out).contiguous()
    return guarded(comm, op, run)


def _split(x: torch.Tensor, dim: int, comm: TPComm, sizes: list[int] | None) -> torch.Tensor:
    return split_dim(x, dim, group=comm.group, sizes=sizes).clone()


def _scatter(x: torch.Tensor, dim: int, comm: TPComm, op: str) -> torch.Tensor:
    def run():
        xm = x.movedim(dim, 0) if dim else x
        rows, rest = xm.shape[0], xm.shape[1:]
        if rows % comm.world:
            raise ValueError(f"{op}: dim {dim} of shape {tuple(x.shape)} must be divisible by "
                             f"the group size {comm.world}{comm.where}")
        stamp_call(comm, op, xm.shape, x.dtype, flags=dim)
        out = stamped_reduce_scatter(comm, xm.reshape(rows, math.prod(rest)).contiguous(), op)
        out = out.view(rows // comm.world, *rest)
        return (out.movedim(0, dim) if dim else out).contiguous()
    return guarded(comm, op, run)


def _sizes(comm, n: int, sizes) -> list[int]:
    return list(sizes) if sizes is not None else [n] * comm.world


def _along(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = n
    return x.new_empty(shape)


define_op("tp_all_reduce", _reduce,
          lambda x, comm, op: torch.empty_like(x, memory_format=torch.contiguous_format))
define_op("tp_all_gather", _gather, lambda x, dim, comm, sizes, op: _along(
    x, dim, sum(_sizes(comm, x.shape[dim], sizes))))
define_op("tp_split", _split, lambda x, dim, comm, sizes: _along(
    x, dim, sizes[comm.rank] if sizes is not None else x.shape[dim] // comm.world))
define_op("tp_reduce_scatter", _scatter,
          lambda x, dim, comm, op: _along(x, dim, x.shape[dim] // comm.world))


def _reduce_op(x, comm, op):
    return call_op("tp_all_reduce", _reduce, x, comm, op)


def _gather_op(x, dim, comm, sizes, op):
    return call_op("tp_all_gather", _gather, x, dim, comm, sizes, op)


def _split_op(x, dim, comm, sizes):
    return call_op("tp_split", _split, x, dim, comm, sizes)


def _scatter_op(x, dim, comm, op):
    return call_op("tp_reduce_scatter", _scatter, x, dim, comm, op)


# ---------------------------------------------------------------- autograd: one backward each

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_op(dy.contiguous(), ctx.comm, "copy_to_tp backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _reduce_op(x, comm, "reduce_from_tp")

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, sizes):
        ctx.dim, ctx.comm, ctx.sizes = dim, comm, sizes
        return _split_op(x, dim, comm, sizes)

    @staticmethod
    def backward(ctx, dy):
        return (_gather_op(dy.contiguous(), ctx.dim, ctx.comm, ctx.sizes,
                           "scatter_to_tp backward"), None, None, None)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, sizes):
        ctx.dim, ctx.comm, ctx.sizes = dim, comm, sizes
        return _gather_op(x, dim, comm, sizes, "gather_from_tp")

    @staticmethod
    def backward(ctx, dy):
        return _split_op(dy.contiguous(), ctx.dim, ctx.comm, ctx.sizes), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _scatter_op(x, dim, comm, "reduce_scatter_to_sp")

    @staticmethod
    def backward(ctx, dy):
        return (_gather_op(dy.contiguous(), ctx.dim, ctx.comm, None,
                           "reduce_scatter_to_sp backward"), None, None)


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _gather_op(x, dim, comm, None, "gather_from_sp")

    @staticmethod
    def backward(ctx, dy):
        return (_scatter_op(dy.contiguous(), ctx.dim, ctx.comm, "gather_from_sp backward"),
                None, None)


def _comm(group, timeout, comm):
    """The TPComm, or in eager a ``_Group``; under torch.compile the custom ops need a TPComm
    (an opaque object to the tracer), so ``group=`` alone is refused there."""
    if comm is not None:
        return comm
    if group is None:
        raise TypeError(f"overlap region collective: pass group= or comm= (rank "
                        f"{dist.get_rank()})")
    if torch.compiler.is_compiling():
        raise NotImplementedError(f"overlap region collectives under torch.compile need comm= "
                                  f"(the layer's TPComm); pass it instead of group= (rank "
                                  f"{dist.get_rank()})")
    return _Group(group, timeout)


def copy_to_tp(x: torch.Tensor, *, group=None, timeout: float = TIMEOUT_S,
               comm=None) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``group`` (or ``comm.group``)."""
    c = _comm(group, timeout, comm)
    return x if c.world == 1 else _CopyToTP.apply(x, c)


def reduce_from_tp(x: torch.Tensor, *, group=None, timeout: float = TIMEOUT_S,
                   comm=None) -> torch.Tensor:
    """Forward sums ``x`` over ``group``; backward passes the (replicated) gradient through."""
    c = _comm(group, timeout, comm)
    return x if c.world == 1 else _ReduceFromTP.apply(x, c)


def scatter_to_tp(x: torch.Tensor, dim: int, *, group=None, sizes: list[int] | None = None,
                  timeout: float = TIMEOUT_S, comm=None) -> torch.Tensor:
    """Keep this rank's piece along ``dim``; backward all-gathers the gradient."""
    c = _comm(group, timeout, comm)
    return x if c.world == 1 else _ScatterToTP.apply(x, dim % x.dim(), c, sizes)


def gather_from_tp(x: torch.Tensor, dim: int, *, group=None, sizes: list[int] | None = None,
                   timeout: float = TIMEOUT_S, comm=None) -> torch.Tensor:
    """All-gather along ``dim``; backward keeps this rank's piece of the gradient."""
    c = _comm(group, timeout, comm)
    return x if c.world == 1 else _GatherFromTP.apply(x, dim % x.dim(), c, sizes)


def reduce_scatter_to_sp(x: torch.Tensor, dim: int, *, group=None, timeout: float = TIMEOUT_S,
                         comm=None) -> torch.Tensor:
    """Sum partial activations and keep this rank's sequence shard; backward all-gathers."""
    c = _comm(group, timeout, comm)
    return x if c.world == 1 else _ReduceScatterToSP.apply(x, dim % x.dim(), c)


def gather_from_sp(x: torch.Tensor, dim: int, *, group=None, timeout: float = TIMEOUT_S,
                   comm=None) -> torch.Tensor:
    """All-gather sequence shards; backward reduce-scatters the gradient."""
    c = _comm(group, timeout, comm)
    return x if c.world == 1 else _GatherFromSP.apply(x, dim % x.dim(), c)
