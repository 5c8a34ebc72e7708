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

Every collective is posted async and waited with a timeout (``timeout=`` seconds, default
``TIMEOUT``; layers pass their TPComm's), so a dead or stalled peer turns into a RuntimeError
naming the op and the group instead of a hang. With a group of size 1 every function is the
identity and issues no collective.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from overlap.profile.timers import comm_wait

__all__ = ["TIMEOUT", "copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
           "reduce_scatter_to_sp", "gather_from_sp", "all_reduce_async", "wait",
           "all_gather_dim", "reduce_scatter_dim", "split_dim"]

TIMEOUT = 300.0

# torch >= 2.12 renamed the tensor collectives; older torch only has the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def wait(work, *, op: str, group, timeout: float = TIMEOUT) -> None:
    """Wait for an async collective, at most ``timeout`` s; name the op and group on failure."""
    try:
        with comm_wait(f"tp.{op}"):
            work.wait(timeout=timedelta(seconds=timeout))
    except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError
        ranks = dist.get_process_group_ranks(group)
        raise RuntimeError(f"tp {op}: collective on group {ranks} failed or timed out after "
                           f"at most {timeout:g}s (rank {dist.get_rank()}): {exc}") from exc


def all_reduce_async(t: torch.Tensor, *, group):
    """Start an in-place sum all-reduce of ``t``; returns the work handle (None if tp == 1)."""
    if dist.get_world_size(group) == 1:
        return None
    return dist.all_reduce(t, group=group, async_op=True)


def _all_reduce(t: torch.Tensor, *, group, op: str, timeout: float = TIMEOUT) -> torch.Tensor:
    work = all_reduce_async(t, group=group)
    if work is not None:
        wait(work, op=op, group=group, timeout=timeout)
    return t


def split_dim(x: torch.Tensor, dim: int, *, group, sizes: list[int] | None = None
              ) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (contiguous copy)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if tp == 1:
        return x
    if sizes is None:
        return x.chunk(tp, dim)[rank].contiguous()
    start = sum(sizes[:rank])
    return x.narrow(dim, start, sizes[rank]).contiguous()


def all_gather_dim(x: torch.Tensor, dim: int, *, group, sizes: list[int] | None = None,
                   op: str = "all_gather", timeout: float = TIMEOUT) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; uneven ``sizes`` are padded for the wire."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return x
    dim = dim % x.dim()
    x = x.movedim(dim, 0)
    pad = 0 if sizes is None else max(sizes) - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    x = x.contiguous()
    out = x.new_empty((tp * x.shape[0], *x.shape[1:]))
    wait(_all_gather_single(out, x, group=group, async_op=True), op=op, group=group,
         timeout=timeout)
    if sizes is not None:
        rows = out.shape[0] // tp
        out = torch.cat([out[r * rows: r * rows + s] for r, s in enumerate(sizes)])
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, *, group, op: str = "reduce_scatter",
                       timeout: float = TIMEOUT) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's 1/tp piece along ``dim``."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return x
    dim = dim % x.dim()
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // tp, *x.shape[1:]))
    wait(_reduce_scatter_single(out, x, group=group, async_op=True), op=op, group=group,
         timeout=timeout)
    return out.movedim(0, dim)


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


def copy_to_tp(x: torch.Tensor, *, group, timeout: float = TIMEOUT) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``group``."""
    return x if dist.get_world_size(group) == 1 else _CopyToTP.apply(x, group, timeout)


def reduce_from_tp(x: torch.Tensor, *, group, timeout: float = TIMEOUT) -> torch.Tensor:
    """Forward sums ``x`` over ``group``; backward passes the (replicated) gradient through."""
    return x if dist.get_world_size(group) == 1 else _ReduceFromTP.apply(x, group, timeout)


def scatter_to_tp(x: torch.Tensor, dim: int, *, group, sizes: list[int] | None = None,
                  timeout: float = TIMEOUT) -> torch.Tensor:
    """Keep this rank's piece along ``dim``; backward all-gathers the gradient."""
    if dist.get_world_size(group) == 1:
        return x
    return _ScatterToTP.apply(x, dim, group, sizes, timeout)


def gather_from_tp(x: torch.Tensor, dim: int, *, group, sizes: list[int] | None = None,
                   timeout: float = TIMEOUT) -> torch.Tensor:
    """All-gather along ``dim``; backward keeps this rank's piece of the gradient."""
    if dist.get_world_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, dim, group, sizes, timeout)


def reduce_scatter_to_sp(x: torch.Tensor, dim: int, *, group,
                         timeout: float = TIMEOUT) -> torch.Tensor:
    """Sum partial activations and keep this rank's sequence shard; backward all-gathers."""
    if dist.get_world_size(group) == 1:
        return x
    return _ReduceScatterToSP.apply(x, dim, group, timeout)


def gather_from_sp(x: torch.Tensor, dim: int, *, group, timeout: float = TIMEOUT) -> torch.Tensor:
    """All-gather sequence shards; backward reduce-scatters the gradient."""
    return x if dist.get_world_size(group) == 1 else _GatherFromSP.apply(x, dim, group, timeout)
