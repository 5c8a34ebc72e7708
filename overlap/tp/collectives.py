"""The plain (not autograd) collectives the fused-op engine and the nn layers share: every one
posted async and waited with a timeout (seconds), so a dead or stalled peer becomes a
RuntimeError naming the op and the group instead of a hang. A group of size 1 issues none."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from overlap.defaults import TIMEOUT_S
from overlap.profile.timers import comm_wait

__all__ = ["TIMEOUT", "wait", "all_reduce_async", "all_reduce", "split_dim", "all_gather_dim",
           "reduce_scatter_dim", "all_gather_single", "reduce_scatter_single"]

TIMEOUT = TIMEOUT_S  # overlap.defaults

# torch >= 2.12 renamed the tensor collectives; older torch only has the *_tensor names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)


def wait(work, *, op: str, group, timeout: float = TIMEOUT, axis: str = "tp") -> None:
    """Wait for an async collective, at most ``timeout`` s; name the op and group on failure.
    ``axis`` prefixes the op's name ("tp", "ep")."""
    try:
        with comm_wait(f"{axis}.{op}"):
            work.wait(timeout=timedelta(seconds=timeout))
    except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError
        ranks = dist.get_process_group_ranks(group)
        raise RuntimeError(f"{axis} {op}: collective on group {ranks} failed or timed out after "
                           f"at most {timeout:g}s (rank {dist.get_rank()}): {exc}") from exc


def all_reduce_async(t: torch.Tensor, *, group):
    """Start an in-place sum all-reduce of ``t``; returns the work handle (None if tp == 1)."""
    if dist.get_world_size(group) == 1:
        return None
    return dist.all_reduce(t, group=group, async_op=True)


def all_reduce(t: torch.Tensor, *, group, op: str, timeout: float = TIMEOUT) -> torch.Tensor:
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
    if dim:
        x = x.movedim(dim, 0)
    pad = 0 if sizes is None else max(sizes) - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    x = x.contiguous()
    out = x.new_empty((tp * x.shape[0], *x.shape[1:]))
    wait(all_gather_single(out, x, group=group, async_op=True), op=op, group=group,
         timeout=timeout)
    if sizes is not None:
        rows = out.shape[0] // tp
        out = torch.cat([out[r * rows: r * rows + s] for r, s in enumerate(sizes)])
    return out.movedim(0, dim) if dim else out


def reduce_scatter_dim(x: torch.Tensor, dim: int, *, group, op: str = "reduce_scatter",
                       timeout: float = TIMEOUT) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's 1/tp piece along ``dim``."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return x
    dim = dim % x.dim()
    x = (x.movedim(dim, 0) if dim else x).contiguous()
    out = x.new_empty((x.shape[0] // tp, *x.shape[1:]))
    wait(reduce_scatter_single(out, x, group=group, async_op=True), op=op, group=group,
         timeout=timeout)
    return out.movedim(0, dim) if dim else out
