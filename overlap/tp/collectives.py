"""The plain (not autograd) collectives the fused-op engine and the nn layers share: every one
posted async and waited with a timeout (seconds), so a dead or stalled peer becomes a
RuntimeError naming the op and the group instead of a hang. A group of size 1 issues none."""

from __future__ import annotations

import functools
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (AllgatherOptions, AllreduceOptions,
                                               ReduceScatterOptions)

from overlap.defaults import TIMEOUT_S
from overlap.profile.timers import comm_wait

__all__ = ["wait", "all_reduce_async", "all_reduce", "split_dim", "all_gather_dim",
           "reduce_scatter_dim", "all_gather_single", "reduce_scatter_single",
           "post_all_reduce", "post_all_gather", "post_reduce_scatter", "wait_limit"]


# torch >= 2.12 renamed the tensor collectives; older torch only has the *_tensor names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)

# The hot path posts its collectives on the process group itself: torch.distributed's wrappers
# re-check what the op's validation already holds (one plain tensor, a group this rank is in,
# no coalescing) and cost ~15 us of host time per call. Same ops, same order, same backend
# (nccl_twin overrides these methods). Anything else takes the public API.
_AG_METHOD = ("all_gather_single" if hasattr(dist.ProcessGroup, "all_gather_single")
              else "_allgather_base")
_RS_METHOD = ("reduce_scatter_single" if hasattr(dist.ProcessGroup, "reduce_scatter_single")
              else "_reduce_scatter_base")


def _options(kind, reduce: bool):
    opts = kind()
    if reduce:
        opts.reduceOp = dist.ReduceOp.SUM
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    return opts


_AR_OPTS = _options(AllreduceOptions, True)
_AG_OPTS = _options(AllgatherOptions, False)
_RS_OPTS = _options(ReduceScatterOptions, True)


_Tensor = torch.Tensor  # a plain tensor (not a subclass such as DTensor or a fake tensor)


def post_all_reduce(t: torch.Tensor, group):
    """Start a sum all-reduce of ``t`` in place on ``group``; returns its work."""
    if group is not None and type(t) is _Tensor:
        return group.allreduce([t], _AR_OPTS)
    return dist.all_reduce(t, group=group, async_op=True)


def post_all_gather(out: torch.Tensor, x: torch.Tensor, group):
    """Start gathering every rank's ``x`` into ``out`` (dim 0, rank order); returns its work."""
    if group is not None and type(out) is _Tensor and type(x) is _Tensor:
        return getattr(group, _AG_METHOD)(out, x, _AG_OPTS)
    return all_gather_single(out, x, group=group, async_op=True)


def post_reduce_scatter(out: torch.Tensor, x: torch.Tensor, group):
    """Start summing ``x`` over ranks into this rank's dim-0 piece ``out``; returns its work."""
    if group is not None and type(out) is _Tensor and type(x) is _Tensor:
        return getattr(group, _RS_METHOD)(out, x, _RS_OPTS)
    return reduce_scatter_single(out, x, group=group, async_op=True)


@functools.lru_cache(maxsize=64)
def wait_limit(timeout: float) -> timedelta:
    """``timeout`` seconds as the timedelta a work's ``wait`` takes (made once per value)."""
    return timedelta(seconds=timeout)


def wait(work, *, op: str, group, timeout: float = TIMEOUT_S, axis: str = "tp") -> None:
    """Wait for an async collective, at most ``timeout`` s; name the op and group on failure.
    ``axis`` prefixes the op's name ("tp", "ep")."""
    try:
        with comm_wait(f"{axis}.{op}"):
            work.wait(timeout=wait_limit(timeout))
    except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError
        ranks = dist.get_process_group_ranks(group)
        raise RuntimeError(f"{axis} {op}: collective on group {ranks} failed or timed out after "
                           f"at most {timeout:g}s (rank {dist.get_rank()}): {exc}") from exc


def all_reduce_async(t: torch.Tensor, *, group):
    """Start an in-place sum all-reduce of ``t``; returns the work handle (None if tp == 1)."""
    if _size(group) == 1:
        return None
    return post_all_reduce(t, group)


def all_reduce(t: torch.Tensor, *, group, op: str, timeout: float = TIMEOUT_S) -> torch.Tensor:
    work = all_reduce_async(t, group=group)
    if work is not None:
        wait(work, op=op, group=group, timeout=timeout)
    return t


def _size(group) -> int:
    return dist.get_world_size(group) if group is None else group.size()


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
                   op: str = "all_gather", timeout: float = TIMEOUT_S) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; uneven ``sizes`` are padded for the wire."""
    tp = _size(group)
    if tp == 1:
        return x
    dim = dim % x.dim()
    if dim:
        x = x.movedim(dim, 0)
    pad = 0 if sizes is None else max(sizes) - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    x = x.contiguous()
    out = x.new_empty((tp * x.shape[0], *x.shape[1:]))
    wait(post_all_gather(out, x, group), op=op, group=group, timeout=timeout)
    if sizes is not None:
        rows = out.shape[0] // tp
        out = torch.cat([out[r * rows: r * rows + s] for r, s in enumerate(sizes)])
    return out.movedim(0, dim) if dim else out


def reduce_scatter_dim(x: torch.Tensor, dim: int, *, group, op: str = "reduce_scatter",
                       timeout: float = TIMEOUT_S) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's 1/tp piece along ``dim``."""
    tp = _size(group)
    if tp == 1:
        return x
    dim = dim % x.dim()
    x = (x.movedim(dim, 0) if dim else x).contiguous()
    out = x.new_empty((x.shape[0] // tp, *x.shape[1:]))
    wait(post_reduce_scatter(out, x, group), op=op, group=group, timeout=timeout)
    return out.movedim(0, dim) if dim else out
