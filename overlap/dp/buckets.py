"""Bucket assignment and flat-buffer layout for data-parallel gradient reduction.

A *layout* places every parameter of a module in one flat buffer per dtype. The buffer is split
into buckets; each bucket is one contiguous slice, so one collective reduces it. Buckets are
filled in a given parameter order (the order gradients are expected to become ready) and
closed once they hold at least their byte cap, like torch DDP: the first bucket of each dtype
uses ``first_cap_bytes`` (small, so the first collective starts early in the backward), the
others ``cap_bytes``. A cap of 0 puts one parameter in each bucket.

Flat buffer of one dtype, length ``sum(padded)``::

    | bucket i: p_a | p_b | ... | pad | bucket j: p_c | ... | pad | ...
      offset_i                          offset_j = offset_i + padded_i

``padded = ceil(numel / pad_to) * pad_to``: a sharded optimizer pads to a multiple of the DP
size so that a reduce-scatter gives rank ``r`` the slice ``[offset + r*padded/dp, offset +
(r+1)*padded/dp)`` of every bucket. Bucket indices follow the order of each bucket's first
parameter in the given order, which is the order the collectives are issued in.

The bucket collectives at the end of this file are the only place where ``overlap.dp`` talks
to ``torch.distributed``; every one is asynchronous and returns a handle with
``wait(timeout)``. Sums only: averaging is a pre-division by the caller.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["Bucket", "Layout", "build_layout", "COMM_DTYPES", "all_reduce_async",
           "reduce_scatter_async", "all_gather_async"]

COMM_DTYPES = (None, "bf16", "int8")


@dataclasses.dataclass(slots=True)
class Bucket:
    """One collective's worth of gradients: ``params`` (indices into the parameter list, in
    buffer order) occupy ``flat[dtype][offset : offset + numel]``; the collective covers
    ``flat[dtype][offset : offset + padded]``."""

    index: int
    dtype: torch.dtype
    params: list[int]
    offset: int
    numel: int
    padded: int

    def shard(self, num_shards: int, shard: int) -> tuple[int, int]:
        """(offset, length) of shard ``shard`` of ``num_shards`` inside the dtype's flat buffer."""
        size = self.padded // num_shards
        return self.offset + shard * size, size


@dataclasses.dataclass(slots=True)
class Layout:
    """Buckets in issue order, every parameter's ``(dtype, offset)`` and each dtype's buffer
    length."""

    buckets: list[Bucket]
    param_offset: dict[int, tuple[torch.dtype, int]]
    numel: dict[torch.dtype, int]
    param_bucket: dict[int, int]
    order: list[int]


def build_layout(order: Sequence[int], params: Sequence[torch.Tensor], *, cap_bytes: int,
                 first_cap_bytes: int, pad_to: int = 1) -> Layout:
    """Assign ``params[i]`` for ``i`` in ``order`` to buckets and lay the buckets out flat.

    ``order`` must be a permutation of ``range(len(params))``.
    """
    if sorted(order) != list(range(len(params))):
        raise ValueError(f"build_layout: order must be a permutation of range({len(params)}), "
                         f"got {list(order)}")
    if pad_to < 1:
        raise ValueError(f"build_layout: pad_to must be >= 1, got {pad_to}")
    open_: dict[torch.dtype, list[int]] = {}
    open_bytes: dict[torch.dtype, int] = {}
    closed_per_dtype: dict[torch.dtype, int] = {}
    groups: list[tuple[int, torch.dtype, list[int]]] = []  # (position of first param, dtype, ids)
    position = {p: k for k, p in enumerate(order)}

    def close(dtype: torch.dtype) -> None:
        ids = open_.pop(dtype)
        open_bytes.pop(dtype)
        closed_per_dtype[dtype] = closed_per_dtype.get(dtype, 0) + 1
        groups.append((position[ids[0]], dtype, ids))

    for i in order:
        p = params[i]
        dtype = p.dtype
        open_.setdefault(dtype, []).append(i)
        open_bytes[dtype] = open_bytes.get(dtype, 0) + p.numel() * p.element_size()
        cap = first_cap_bytes if closed_per_dtype.get(dtype, 0) == 0 else cap_bytes
        if open_bytes[dtype] >= cap:
            close(dtype)
    for dtype in list(open_):
        close(dtype)
    groups.sort(key=lambda g: g[0])

    buckets: list[Bucket] = []
    param_offset: dict[int, tuple[torch.dtype, int]] = {}
    param_bucket: dict[int, int] = {}
    numel: dict[torch.dtype, int] = {}
    for index, (_, dtype, ids) in enumerate(groups):
        start = numel.get(dtype, 0)
        cursor = start
        for i in ids:
            param_offset[i] = (dtype, cursor)
            param_bucket[i] = index
            cursor += params[i].numel()
        n = cursor - start
        padded = -(-n // pad_to) * pad_to if n else pad_to
        buckets.append(Bucket(index=index, dtype=dtype, params=list(ids), offset=start,
                              numel=n, padded=padded))
        numel[dtype] = start + padded
    return Layout(buckets=buckets, param_offset=param_offset, numel=numel,
                  param_bucket=param_bucket, order=list(order))


# ---- bucket collectives ------------------------------------------------------------------------

# torch >= 2.9 renamed the *_tensor collectives; both names reach the same backend op (gloo
# implements reduce-scatter and all-gather of a flat tensor natively, as NCCL does).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_async(buf: torch.Tensor, *, group: dist.ProcessGroup, comm_dtype: str | None):
    """In place ``buf = sum over group of buf``."""
    if comm_dtype is None:
        return dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
    raise NotImplementedError(f"bucket all-reduce: comm_dtype={comm_dtype!r} needs "
                              "overlap.comm.quant")


def reduce_scatter_async(out: torch.Tensor, buf: torch.Tensor, *, group: dist.ProcessGroup,
                         comm_dtype: str | None):
    """``out (n/dp,) = sum over group of buf[r*n/dp : (r+1)*n/dp]`` for group rank ``r``."""
    if comm_dtype is None:
        return _reduce_scatter(out, buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
    raise NotImplementedError(f"bucket reduce-scatter: comm_dtype={comm_dtype!r} needs "
                              "overlap.comm.quant")


def all_gather_async(out: torch.Tensor, shard: torch.Tensor, *, group: dist.ProcessGroup):
    """``out (n,)[r*n/dp : (r+1)*n/dp] = shard`` of group rank ``r``, exact (parameters are
    never quantized)."""
    return _all_gather(out, shard, group=group, async_op=True)
