"""The fused TP ops and the TP region collectives as ``torch.library`` custom ops, for
``torch.compile``.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) the public functions
(``overlap.tp.ops.all_gather_matmul`` and friends, ``overlap.nn.regions.copy_to_tp`` and
friends, the column layer's linear) call these ops instead of their eager autograd Functions.
Each op is one opaque node in the graph: a fake (meta) implementation gives its output shapes,
its autograd is registered (its backward is another op of this module, so the backward graph
is opaque too), and its real implementation runs the eager code at run time: the same
validation (once per shape signature), the same backends, the same failure handling. Nothing
in a traced forward calls an ``*_object`` collective or a Python-side async collective, so a
decoder block compiles with ``fullgraph=True``.

Custom ops take tensors and numbers, not Python objects, so a layer refers to its TPComm by
an integer **handle** (``handle_for(comm)``, given when the layer is built): a process-wide
table of weak references to live communicators, numbered from a counter that never reuses a
number (not ``id()``), so a handle of a dead communicator raises instead of finding another.

Ops (``overlap::``): ``ag_mm`` / ``ag_mm_bwd`` (all_gather_matmul; the backward's dgrad
reduce-scatter runs while the wgrad GEMM is computed, as in eager), ``mm_rs`` / ``mm_rs_bwd``,
``mm_ar``, ``col_linear`` / ``col_linear_bwd`` (the non-sequence-parallel column linear, whose
dgrad all-reduce overlaps wgrad), and the region collectives ``tp_all_reduce``, ``tp_copy``
(identity, gradient all-reduced), ``tp_all_gather``, ``tp_split``, ``tp_reduce_scatter``.
Not supported under compile: ``return_gathered=True`` and explicit ``context=``.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F

__all__ = ["handle_for", "lookup", "all_gather_matmul", "matmul_reduce_scatter",
           "matmul_all_reduce", "column_linear", "all_reduce", "copy", "all_gather", "split",
           "reduce_scatter"]

_live: dict[int, weakref.ref] = {}
_numbers = itertools.count(1)


def handle_for(comm) -> int:
    """The integer handle of ``comm`` (assigned on first call)."""
    h = getattr(comm, "_op_handle", None)
    if h is None:
        h = next(_numbers)
        comm._op_handle = h
        _live[h] = weakref.ref(comm)
    return h


def lookup(handle: int):
    ref = _live.get(handle)
    comm = ref() if ref is not None else None
    if comm is None:
        raise RuntimeError(f"overlap custom op: TP communicator handle {handle} is not alive "
                           f"(the TPComm was garbage-collected) on rank {_rank()}; rebuild the "
                           "layers")
    return comm


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _seq_first(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    return t.transpose(0, 1) if seq_dim == 1 else t


def _grown(shape, dim: int, factor: float, last: int) -> list[int]:
    out = list(shape)
    out[dim] = int(out[dim] * factor)
    out[-1] = last
    return out


# ---------------------------------------------------------------- all_gather_matmul

@torch.library.custom_op("overlap::ag_mm", mutates_args=())
def _ag_mm(x_shard: torch.Tensor, w: torch.Tensor, handle: int, chunks: int,
           seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    from overlap.tp import ops

    with torch.no_grad():
        y, g = ops.all_gather_matmul(x_shard, w, comm=lookup(handle), chunks=chunks or None,
                                     seq_dim=seq_dim, return_gathered=True)
    return y.contiguous(), g.contiguous()


@_ag_mm.register_fake
def _(x_shard, w, handle, chunks, seq_dim):
    world = lookup(handle).world
    dim = seq_dim if x_shard.dim() == 3 else 0
    return (x_shard.new_empty(_grown(x_shard.shape, dim, world, w.shape[1])),
            x_shard.new_empty(_grown(x_shard.shape, dim, world, x_shard.shape[-1])))


@torch.library.custom_op("overlap::ag_mm_bwd", mutates_args=())
def _ag_mm_bwd(dy: torch.Tensor, gathered: torch.Tensor, w: torch.Tensor, handle: int,
               chunks: int, seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dx_shard = reduce_scatter(dy @ w.T) with dw = gathered.T @ dy computed meanwhile."""
    from overlap.tp import backends
    from overlap.tp.ops import _Run

    comm = lookup(handle)
    seq_dim = seq_dim if dy.dim() == 3 else 0
    dy_sf, g_sf = _seq_first(dy, seq_dim), _seq_first(gathered, seq_dim)
    dy2 = dy_sf.reshape(-1, dy.shape[-1]).contiguous()
    g2 = g_sf.reshape(-1, gathered.shape[-1]).contiguous()
    run = _Run(comm, backends.backend_for(comm, dy.dtype), chunks or comm.chunks or comm.world,
               None)
    dw = None

    def wgrad() -> None:
        nonlocal dw
        dw = g2.t() @ dy2

    wt = w.t()
    op = "matmul_reduce_scatter"
    dx2 = run.guarded(op, lambda: run.backend.rs(run.comm, run.ctx_for(op, dy2, wt), dy2, wt,
                                                 chunks=run.chunks, overlap_with=wgrad),
                      dy2, wt)
    if dw is None:  # a backend that ran the GEMM without calling back
        wgrad()
    lead = (g_sf.shape[0] // comm.world, *g_sf.shape[1:-1])
    dx = _seq_first(dx2.view(*lead, gathered.shape[-1]), seq_dim)
    return dx.contiguous(), dw


@_ag_mm_bwd.register_fake
def _(dy, gathered, w, handle, chunks, seq_dim):
    world = lookup(handle).world
    dim = seq_dim if dy.dim() == 3 else 0
    return (gathered.new_empty(_grown(gathered.shape, dim, 1 / world, gathered.shape[-1])),
            w.new_empty(w.shape))


def _ag_setup(ctx, inputs, output):
    _, w, handle, chunks, seq_dim = inputs
    ctx.save_for_backward(output[1], w)
    ctx.args = (handle, chunks, seq_dim)


def _ag_backward(ctx, dy, dgathered):
    gathered, w = ctx.saved_tensors
    dx, dw = _ag_mm_bwd(dy.contiguous(), gathered, w, *ctx.args)
    return dx, dw, None, None, None


_ag_mm.register_autograd(_ag_backward, setup_context=_ag_setup)


def all_gather_matmul(x_shard, w, comm, chunks, seq_dim):
    # The gathered input is saved for the backward but not differentiable here.
    return _ag_mm(x_shard, w, handle_for(comm), chunks or 0, seq_dim)[0]


# ---------------------------------------------------------------- matmul_reduce_scatter

@torch.library.custom_op("overlap::mm_rs", mutates_args=())
def _mm_rs(x: torch.Tensor, w: torch.Tensor, handle: int, chunks: int,
           seq_dim: int) -> torch.Tensor:
    from overlap.tp import ops

    with torch.no_grad():
        return ops.matmul_reduce_scatter(x, w, comm=lookup(handle), chunks=chunks or None,
                                         seq_dim=seq_dim).contiguous()


@_mm_rs.register_fake
def _(x, w, handle, chunks, seq_dim):
    world = lookup(handle).world
    dim = seq_dim if x.dim() == 3 else 0
    return x.new_empty(_grown(x.shape, dim, 1 / world, w.shape[1]))


@torch.library.custom_op("overlap::mm_rs_bwd", mutates_args=())
def _mm_rs_bwd(dy_shard: torch.Tensor, x: torch.Tensor, w: torch.Tensor, handle: int,
               chunks: int, seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = all_gather(dy_shard) @ w.T (fused), dw = x.T @ all_gather(dy_shard) (reused)."""
    from overlap.tp import ops

    with torch.no_grad():
        dx, dy = ops.all_gather_matmul(dy_shard, w.t(), comm=lookup(handle),
                                       chunks=chunks or None, seq_dim=seq_dim,
                                       return_gathered=True)
    seq_dim = seq_dim if x.dim() == 3 else 0
    x2 = _seq_first(x, seq_dim).reshape(-1, x.shape[-1])
    dy2 = _seq_first(dy, seq_dim).reshape(-1, dy.shape[-1])
    return dx.contiguous(), x2.t() @ dy2


@_mm_rs_bwd.register_fake
def _(dy_shard, x, w, handle, chunks, seq_dim):
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _rs_setup(ctx, inputs, output):
    x, w, handle, chunks, seq_dim = inputs
    ctx.save_for_backward(x, w)
    ctx.args = (handle, chunks, seq_dim)


def _rs_backward(ctx, dy_shard):
    x, w = ctx.saved_tensors
    dx, dw = _mm_rs_bwd(dy_shard.contiguous(), x, w, *ctx.args)
    return dx, dw, None, None, None


_mm_rs.register_autograd(_rs_backward, setup_context=_rs_setup)


def matmul_reduce_scatter(x, w, comm, chunks, seq_dim):
    return _mm_rs(x, w, handle_for(comm), chunks or 0, seq_dim)


# ---------------------------------------------------------------- matmul_all_reduce

@torch.library.custom_op("overlap::mm_ar", mutates_args=())
def _mm_ar(x: torch.Tensor, w: torch.Tensor, handle: int, chunks: int) -> torch.Tensor:
    from overlap.tp import ops

    with torch.no_grad():
        return ops.matmul_all_reduce(x, w, comm=lookup(handle), chunks=chunks or None)


@_mm_ar.register_fake
def _(x, w, handle, chunks):
    return x.new_empty((*x.shape[:-1], w.shape[1]))


def _ar_setup(ctx, inputs, output):
    x, w = inputs[0], inputs[1]
    ctx.save_for_backward(x, w)


def _ar_backward(ctx, dy):
    # No communication: dy is the same on every rank, as everything after y is replicated.
    x, w = ctx.saved_tensors
    dx = dy @ w.t()
    dw = x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])
    return dx, dw, None, None


_mm_ar.register_autograd(_ar_backward, setup_context=_ar_setup)


def matmul_all_reduce(x, w, comm, chunks):
    return _mm_ar(x, w, handle_for(comm), chunks or 0)


# ---------------------------------------------------------------- column linear (no SP)

@torch.library.custom_op("overlap::col_linear", mutates_args=())
def _col_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                handle: int) -> torch.Tensor:
    return F.linear(x, w, b)


@_col_linear.register_fake
def _(x, w, b, handle):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("overlap::col_linear_bwd", mutates_args=())
def _col_linear_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                    handle: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx = all_reduce(dy @ w) launched first; dw, db computed while it is in flight."""
    from overlap.tp.collectives import all_reduce_async, wait

    comm = lookup(handle)
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
def _(dy, x, w, handle):
    return x.new_empty(x.shape), w.new_empty(w.shape), w.new_empty(w.shape[0])


def _col_setup(ctx, inputs, output):
    x, w, b, handle = inputs
    ctx.save_for_backward(x, w)
    ctx.handle, ctx.has_bias = handle, b is not None


def _col_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw, db = _col_linear_bwd(dy.contiguous(), x, w, ctx.handle)
    return dx, dw, (db if ctx.has_bias else None), None


_col_linear.register_autograd(_col_backward, setup_context=_col_setup)


def column_linear(x, w, b, comm):
    return _col_linear(x, w, b, handle_for(comm))


# ---------------------------------------------------------------- region collectives

def _comm_and_args(handle):
    comm = lookup(handle)
    return comm, {"group": comm.group, "timeout": comm.timeout}


@torch.library.custom_op("overlap::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: torch.Tensor, handle: int) -> torch.Tensor:
    from overlap.tp.collectives import all_reduce as _ar

    comm, kw = _comm_and_args(handle)
    return _ar(x.clone(memory_format=torch.contiguous_format), op="reduce_from_tp", **kw)


@torch.library.custom_op("overlap::tp_copy", mutates_args=())
def _tp_copy(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("overlap::tp_all_gather", mutates_args=())
def _tp_all_gather(x: torch.Tensor, dim: int, handle: int, sizes: list[int] | None,
                   backward_reduces: bool) -> torch.Tensor:
    from overlap.tp.collectives import all_gather_dim

    comm, kw = _comm_and_args(handle)
    return all_gather_dim(x, dim, sizes=sizes, op="gather (compiled)", **kw).contiguous()


@torch.library.custom_op("overlap::tp_split", mutates_args=())
def _tp_split(x: torch.Tensor, dim: int, handle: int, sizes: list[int] | None) -> torch.Tensor:
    from overlap.tp.collectives import split_dim

    comm = lookup(handle)
    return split_dim(x, dim, group=comm.group, sizes=sizes).clone()


@torch.library.custom_op("overlap::tp_reduce_scatter", mutates_args=())
def _tp_reduce_scatter(x: torch.Tensor, dim: int, handle: int) -> torch.Tensor:
    from overlap.tp.collectives import reduce_scatter_dim

    comm, kw = _comm_and_args(handle)
    return reduce_scatter_dim(x, dim, op="reduce_scatter (compiled)", **kw).contiguous()


def _sizes(handle, n, sizes):
    world = lookup(handle).world
    return list(sizes) if sizes is not None else [n] * world


@_tp_all_reduce.register_fake
def _(x, handle):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_tp_copy.register_fake
def _(x, handle):
    return torch.empty_like(x)


@_tp_all_gather.register_fake
def _(x, dim, handle, sizes, backward_reduces):
    shape = list(x.shape)
    shape[dim] = sum(_sizes(handle, shape[dim], sizes))
    return x.new_empty(shape)


@_tp_split.register_fake
def _(x, dim, handle, sizes):
    comm = lookup(handle)
    shape = list(x.shape)
    shape[dim] = sizes[comm.rank] if sizes is not None else shape[dim] // comm.world
    return x.new_empty(shape)


@_tp_reduce_scatter.register_fake
def _(x, dim, handle):
    shape = list(x.shape)
    shape[dim] //= lookup(handle).world
    return x.new_empty(shape)


def _save_args(*names):
    def setup(ctx, inputs, output):
        for name, value in zip(names, inputs[1:]):
            setattr(ctx, name, value)
    return setup


_tp_all_reduce.register_autograd(lambda ctx, dy: (dy, None), setup_context=_save_args())
_tp_copy.register_autograd(lambda ctx, dy: (_tp_all_reduce(dy.contiguous(), ctx.handle), None),
                           setup_context=_save_args("handle"))
_tp_all_gather.register_autograd(
    lambda ctx, dy: ((_tp_reduce_scatter(dy.contiguous(), ctx.dim, ctx.handle)
                      if ctx.backward_reduces
                      else _tp_split(dy.contiguous(), ctx.dim, ctx.handle, ctx.sizes)),
                     None, None, None, None),
    setup_context=_save_args("dim", "handle", "sizes", "backward_reduces"))
_tp_split.register_autograd(
    lambda ctx, dy: (_tp_all_gather(dy.contiguous(), ctx.dim, ctx.handle, ctx.sizes, False),
                     None, None, None),
    setup_context=_save_args("dim", "handle", "sizes"))
_tp_reduce_scatter.register_autograd(
    lambda ctx, dy: (_tp_all_gather(dy.contiguous(), ctx.dim, ctx.handle, None, True),
                     None, None),
    setup_context=_save_args("dim", "handle"))


def all_reduce(x, comm):
    return _tp_all_reduce(x, handle_for(comm))


def copy(x, comm):
    return _tp_copy(x, handle_for(comm))


def all_gather(x, dim, comm, sizes=None, backward_reduces=False):
    return _tp_all_gather(x, dim % x.dim(), handle_for(comm), sizes, backward_reduces)


def split(x, dim, comm, sizes=None):
    return _tp_split(x, dim % x.dim(), handle_for(comm), sizes)


def reduce_scatter(x, dim, comm):
    return _tp_reduce_scatter(x, dim % x.dim(), handle_for(comm))
