"""The TP region collectives and the column linear (no sequence parallelism) as
``torch.library`` custom ops, for ``torch.compile``. (The fused ops are implemented once in
overlap.tp.ops, with their own custom ops.)

Under ``torch.compile`` the region functions (``overlap.nn.regions.copy_to_tp`` and friends)
and the column layer's linear call these ops instead of their eager autograd Functions. Each
op is one opaque node: a fake implementation gives its shapes, its autograd is registered, its
real implementation runs the eager collective at run time.

Each op takes the TPComm itself (an opaque object to torch.compile): no registry of
communicators exists, so none can go stale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overlap.tp.comm import TPComm

__all__ = ["column_linear", "all_reduce", "copy", "all_gather", "split", "reduce_scatter"]

# ---------------------------------------------------------------- column linear (no SP)

@torch.library.custom_op("overlap::col_linear", mutates_args=())
def _col_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                comm: TPComm) -> torch.Tensor:
    return F.linear(x, w, b)


@_col_linear.register_fake
def _(x, w, b, comm):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("overlap::col_linear_bwd", mutates_args=())
def _col_linear_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                    comm: TPComm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx = all_reduce(dy @ w) launched first; dw, db computed while it is in flight."""
    from overlap.tp.collectives import all_reduce_async, wait

    comm.ensure_usable("ColumnParallelLinear dgrad all_reduce")
    dx = dy.matmul(w).contiguous()
    work = all_reduce_async(dx, group=comm.group)
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw = dy2.t().matmul(x.reshape(-1, x.shape[-1]))
    db = dy2.sum(0)
    if work is not None:
        wait(work, op="ColumnParallelLinear dgrad all_reduce", group=comm.group,
             timeout=comm.timeout)
    return dx, dw, db


@_col_linear_bwd.register_fake
def _(dy, x, w, comm):
    return x.new_empty(x.shape), w.new_empty(w.shape), w.new_empty(w.shape[0])


def _col_setup(ctx, inputs, output):
    x, w, b, comm = inputs
    ctx.save_for_backward(x, w)
    ctx.comm, ctx.has_bias = comm, b is not None


def _col_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw, db = _col_linear_bwd(dy.contiguous(), x, w, ctx.comm)
    return dx, dw, (db if ctx.has_bias else None), None


_col_linear.register_autograd(_col_backward, setup_context=_col_setup)


def column_linear(x, w, b, comm):
    return _col_linear(x, w, b, comm)


# ---------------------------------------------------------------- region collectives

def _comm_and_args(comm):
    return comm, {"group": comm.group, "timeout": comm.timeout}


@torch.library.custom_op("overlap::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    from overlap.tp.collectives import all_reduce as _ar

    comm, kw = _comm_and_args(comm)
    return _ar(x.clone(memory_format=torch.contiguous_format), op="reduce_from_tp", **kw)


@torch.library.custom_op("overlap::tp_copy", mutates_args=())
def _tp_copy(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("overlap::tp_all_gather", mutates_args=())
def _tp_all_gather(x: torch.Tensor, dim: int, comm: TPComm, sizes: list[int] | None,
                   backward_reduces: bool) -> torch.Tensor:
    from overlap.tp.collectives import all_gather_dim

    comm, kw = _comm_and_args(comm)
    return all_gather_dim(x, dim, sizes=sizes, op="gather (compiled)", **kw).contiguous()


@torch.library.custom_op("overlap::tp_split", mutates_args=())
def _tp_split(x: torch.Tensor, dim: int, comm: TPComm, sizes: list[int] | None) -> torch.Tensor:
    from overlap.tp.collectives import split_dim

    return split_dim(x, dim, group=comm.group, sizes=sizes).clone()


@torch.library.custom_op("overlap::tp_reduce_scatter", mutates_args=())
def _tp_reduce_scatter(x: torch.Tensor, dim: int, comm: TPComm) -> torch.Tensor:
    from overlap.tp.collectives import reduce_scatter_dim

    comm, kw = _comm_and_args(comm)
    return reduce_scatter_dim(x, dim, op="reduce_scatter (compiled)", **kw).contiguous()


def _sizes(comm, n, sizes):
    world = comm.world
    return list(sizes) if sizes is not None else [n] * world


@_tp_all_reduce.register_fake
def _(x, comm):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_tp_copy.register_fake
def _(x, comm):
    return torch.empty_like(x)


@_tp_all_gather.register_fake
def _(x, dim, comm, sizes, backward_reduces):
    shape = list(x.shape)
    shape[dim] = sum(_sizes(comm, shape[dim], sizes))
    return x.new_empty(shape)


@_tp_split.register_fake
def _(x, dim, comm, sizes):
    shape = list(x.shape)
    shape[dim] = sizes[comm.rank] if sizes is not None else shape[dim] // comm.world
    return x.new_empty(shape)


@_tp_reduce_scatter.register_fake
def _(x, dim, comm):
    shape = list(x.shape)
    shape[dim] //= comm.world
    return x.new_empty(shape)


def _save_args(*names):
    def setup(ctx, inputs, output):
        for name, value in zip(names, inputs[1:]):
            setattr(ctx, name, value)
    return setup


_tp_all_reduce.register_autograd(lambda ctx, dy: (dy, None), setup_context=_save_args())
_tp_copy.register_autograd(lambda ctx, dy: (_tp_all_reduce(dy.contiguous(), ctx.comm), None),
                           setup_context=_save_args("comm"))
_tp_all_gather.register_autograd(
    lambda ctx, dy: ((_tp_reduce_scatter(dy.contiguous(), ctx.dim, ctx.comm)
                      if ctx.backward_reduces
                      else _tp_split(dy.contiguous(), ctx.dim, ctx.comm, ctx.sizes)),
                     None, None, None, None),
    setup_context=_save_args("dim", "comm", "sizes", "backward_reduces"))
_tp_split.register_autograd(
    lambda ctx, dy: (_tp_all_gather(dy.contiguous(), ctx.dim, ctx.comm, ctx.sizes, False),
                     None, None, None),
    setup_context=_save_args("dim", "comm", "sizes"))
_tp_reduce_scatter.register_autograd(
    lambda ctx, dy: (_tp_all_gather(dy.contiguous(), ctx.dim, ctx.comm, None, True),
                     None, None),
    setup_context=_save_args("dim", "comm"))


def all_reduce(x, comm):
    return _tp_all_reduce(x, comm)


def copy(x, comm):
    return _tp_copy(x, comm)


def all_gather(x, dim, comm, sizes=None, backward_reduces=False):
    return _tp_all_gather(x, dim % x.dim(), comm, sizes, backward_reduces)


def split(x, dim, comm, sizes=None):
    return _tp_split(x, dim % x.dim(), comm, sizes)


def reduce_scatter(x, dim, comm):
    return _tp_reduce_scatter(x, dim % x.dim(), comm)
