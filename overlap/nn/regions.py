"""Autograd-aware collectives at the edges of tensor- and sequence-parallel regions.

Each function is a pair of collectives that are each other's adjoint (forward / backward), the
conjugate operators of the Megatron-LM paper. ``tp`` below is the size of ``group``.

==========================  ==========================  ==========================
function                    forward                     backward
==========================  ==========================  ==========================
copy_to_tp                  identity                    all_reduce(dy)
reduce_from_tp              all_reduce(x)               identity
scatter_to_tp(dim)          x.chunk(tp, dim)[rank]      all_gather(dy, dim)
gather_from_tp(dim)         all_gather(x, dim)          dy.chunk(tp, dim)[rank]
reduce_scatter_to_sp(dim)   reduce_scatter(x, dim)      all_gather(dy, dim)
gather_from_sp(dim)         all_gather(x, dim)          reduce_scatter(dy, dim)
==========================  ==========================  ==========================

``gather_from_tp`` / ``scatter_to_tp`` accept ``sizes`` (one entry per rank) for uneven shards,
e.g. a vocabulary that tp does not divide. ``copy_to_tp`` is also how a replicated parameter
used on a sequence shard gets its full gradient (the sum of every rank's partial gradient).

Each takes the layer's TPComm as ``comm=`` (or ``group=`` and ``timeout=``); with ``comm=``,
under ``torch.compile`` each is one custom op (overlap.tp.custom_ops) instead of an autograd
Function. Every collective is posted async and waited with a timeout (``timeout=`` seconds, default
``TIMEOUT``; layers pass their TPComm's), so a dead or stalled peer turns into a RuntimeError
naming the op and the group instead of a hang. With a group of size 1 every function is the
identity and issues no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.tp.collectives import (TIMEOUT, all_gather_dim, all_reduce_async, reduce_scatter_dim,
                                    split_dim, wait)
from overlap.tp.collectives import all_reduce as _all_reduce
from overlap.tp import custom_ops

__all__ = ["TIMEOUT", "copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
           "reduce_scatter_to_sp", "gather_from_sp", "all_reduce_async", "wait",
           "all_gather_dim", "reduce_scatter_dim", "split_dim"]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timeout):
        ctx.group, ctx.timeout = group, timeout
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return (_all_reduce(dy.contiguous(), group=ctx.group, op="copy_to_tp backward",
                            timeout=ctx.timeout), None, None)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timeout):
        return _all_reduce(x.clone(memory_format=torch.contiguous_format), group=group,
                           op="reduce_from_tp", timeout=timeout)

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes, timeout):
        ctx.dim, ctx.group, ctx.sizes, ctx.timeout = dim, group, sizes, timeout
        return split_dim(x, dim, group=group, sizes=sizes)

    @staticmethod
    def backward(ctx, dy):
        return (all_gather_dim(dy, ctx.dim, group=ctx.group, sizes=ctx.sizes,
                               op="scatter_to_tp backward", timeout=ctx.timeout),
                None, None, None, None)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes, timeout):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return all_gather_dim(x, dim, group=group, sizes=sizes, op="gather_from_tp",
                              timeout=timeout)

    @staticmethod
    def backward(ctx, dy):
        return split_dim(dy, ctx.dim, group=ctx.group, sizes=ctx.sizes), None, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, timeout):
        ctx.dim, ctx.group, ctx.timeout = dim, group, timeout
        return reduce_scatter_dim(x, dim, group=group, op="reduce_scatter_to_sp",
                                  timeout=timeout)

    @staticmethod
    def backward(ctx, dy):
        return (all_gather_dim(dy, ctx.dim, group=ctx.group, op="reduce_scatter_to_sp backward",
                               timeout=ctx.timeout), None, None, None)


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, timeout):
        ctx.dim, ctx.group, ctx.timeout = dim, group, timeout
        return all_gather_dim(x, dim, group=group, op="gather_from_sp", timeout=timeout)

    @staticmethod
    def backward(ctx, dy):
        return (reduce_scatter_dim(dy, ctx.dim, group=ctx.group, op="gather_from_sp backward",
                                   timeout=ctx.timeout), None, None, None)


def _compiling(comm) -> bool:
    """Under torch.compile the regions are custom ops (overlap.tp.custom_ops), which need the
    layer's TPComm (``comm=``) to name the group."""
    if not torch.compiler.is_compiling():
        return False
    if comm is None:
        raise NotImplementedError(f"overlap region collectives under torch.compile need comm= "
                                  f"(the layer's TPComm); pass it instead of group= (rank "
                                  f"{dist.get_rank()})")
    return True


def copy_to_tp(x: torch.Tensor, *, group=None, timeout: float = TIMEOUT,
               comm=None) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``group`` (or ``comm.group``)."""
    if _compiling(comm):
        return x if comm.world == 1 else custom_ops.copy(x, comm)
    group, timeout = _group(group, timeout, comm)
    return x if dist.get_world_size(group) == 1 else _CopyToTP.apply(x, group, timeout)


def reduce_from_tp(x: torch.Tensor, *, group=None, timeout: float = TIMEOUT,
                   comm=None) -> torch.Tensor:
    """Forward sums ``x`` over ``group``; backward passes the (replicated) gradient through."""
    if _compiling(comm):
        return x if comm.world == 1 else custom_ops.all_reduce(x, comm)
    group, timeout = _group(group, timeout, comm)
    return x if dist.get_world_size(group) == 1 else _ReduceFromTP.apply(x, group, timeout)


def scatter_to_tp(x: torch.Tensor, dim: int, *, group=None, sizes: list[int] | None = None,
                  timeout: float = TIMEOUT, comm=None) -> torch.Tensor:
    """Keep this rank's piece along ``dim``; backward all-gathers the gradient."""
    if _compiling(comm):
        return x if comm.world == 1 else custom_ops.split(x, dim, comm, sizes)
    group, timeout = _group(group, timeout, comm)
    if dist.get_world_size(group) == 1:
        return x
    return _ScatterToTP.apply(x, dim, group, sizes, timeout)


def gather_from_tp(x: torch.Tensor, dim: int, *, group=None, sizes: list[int] | None = None,
                   timeout: float = TIMEOUT, comm=None) -> torch.Tensor:
    """All-gather along ``dim``; backward keeps this rank's piece of the gradient."""
    if _compiling(comm):
        return x if comm.world == 1 else custom_ops.all_gather(x, dim, comm, sizes)
    group, timeout = _group(group, timeout, comm)
    if dist.get_world_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, dim, group, sizes, timeout)


def reduce_scatter_to_sp(x: torch.Tensor, dim: int, *, group=None, timeout: float = TIMEOUT,
                         comm=None) -> torch.Tensor:
    """Sum partial activations and keep this rank's sequence shard; backward all-gathers."""
    if _compiling(comm):
        return x if comm.world == 1 else custom_ops.reduce_scatter(x, dim, comm)
    group, timeout = _group(group, timeout, comm)
    if dist.get_world_size(group) == 1:
        return x
    return _ReduceScatterToSP.apply(x, dim, group, timeout)


def gather_from_sp(x: torch.Tensor, dim: int, *, group=None, timeout: float = TIMEOUT,
                   comm=None) -> torch.Tensor:
    """All-gather sequence shards; backward reduce-scatters the gradient."""
    if _compiling(comm):
        return x if comm.world == 1 else custom_ops.all_gather(x, dim, comm,
                                                               backward_reduces=True)
    group, timeout = _group(group, timeout, comm)
    return x if dist.get_world_size(group) == 1 else _GatherFromSP.apply(x, dim, group, timeout)


def _group(group, timeout, comm):
    if comm is not None:
        return comm.group, comm.timeout
    if group is None:
        raise TypeError(f"overlap region collective: pass group= or comm= (rank "
                        f"{dist.get_rank()})")
    return group, timeout
