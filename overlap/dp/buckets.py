"""Bucket assignment, flat-buffer layout and bucket collectives for data-parallel gradient
reduction, and ``ReducerConfig`` (the knobs of both).

Flat buffer of one dtype, length ``sum(padded)``; each bucket is one contiguous slice::

    | bucket i: p_a | p_b | ... | pad | bucket j: p_c | ... | pad | ...
      offset_i                          offset_j = offset_i + padded_i

``padded = ceil(numel / pad_to) * pad_to``; with ``pad_to = dp`` a reduce-scatter gives rank
``r`` the slice ``[offset + r*padded/dp, offset + (r+1)*padded/dp)``. Bucket indices are the
issue order of the collectives. The collectives here are the only ``torch.distributed`` calls of
``overlap.dp``: asynchronous, each returns a handle with ``wait(timeout)``; sums only.

The narrative: docs/design/dp.md.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from overlap.comm import quant
from overlap.defaults import TIMEOUT_S, positive_seconds
from overlap.comm.quant.checks import comm_dtype_arg

__all__ = ["ReducerConfig", "Bucket", "Layout", "build_layout", "COMM_DTYPES", "BucketWork",
           "all_reduce_async", "reduce_scatter_async", "all_gather_async", "check_same_params",
           "broadcast_params"]

COMM_DTYPES = quant.COMM_DTYPES
MiB = 1 << 20


@dataclasses.dataclass(kw_only=True, slots=True)
class ReducerConfig:
    """``bucket_cap_mb`` / ``first_bucket_cap_mb``: bucket byte caps in MiB (torch DDP's
    defaults; 0 gives one parameter per bucket). ``bucket_cap_mb="auto"``: after the first
    synchronising backward, buckets are planned from DP rank 0's measured gradient-ready
    timeline and a measured all-reduce latency and bandwidth (``overlap.dp.autobucket``) to
    end the reduction as early as possible, then that plan and fixed caps (1 to 16 buckets, and
    25 MiB) take turns for a settling and ``auto_trials`` timed synchronising iterations each
    and the fastest (slowest rank's median) is kept (``overlap.dp.autobucket.BucketTuner``;
    ``auto_trials=0``: the plan alone); the first iteration uses ``first_bucket_cap_mb`` and
    25 MiB. ``comm_dtype``: "fp32" (no quantization: the
    gradient dtype), "bf16" or "int8" (through ``overlap.comm.quant``); None is a deprecated
    alias of "fp32", validated once by ``overlap.comm.quant.checks.comm_dtype_arg``. ``op``:
    "avg" or "sum" over the DP group.
    ``shard``: reduce-scatter for ``ShardedOptimizer``. ``rebuild_buckets``: re-order buckets
    after the first iteration. ``broadcast_params``: copy DP rank 0's parameters at
    construction (as DDP). ``error_feedback``: with a lossy ``comm_dtype``, carry each
    bucket's quantization residual into the next step (``overlap.comm.quant.ErrorFeedback``).
    ``timeout``: seconds, the bound on every wait.
    ``grad_dtype``: dtype of the flat gradient buffers (None: each parameter's own dtype). With
    ``torch.float32`` and bf16/fp16 parameters, gradients accumulate and are reduced in fp32
    "main grads" (Megatron's ``main_grad``): such a parameter's reduced gradient is
    ``p.main_grad`` (a view into the fp32 buffer) and ``p.grad`` stays None.
    ``overlap=False``: launch no bucket during the backward; ``finish()`` reduces them all after
    it (the no-overlap baseline of ``overlap-train --compare-no-overlap``)."""

    bucket_cap_mb: float | str = 25.0
    first_bucket_cap_mb: float = 1.0
    comm_dtype: str = "fp32"
    op: str = "avg"
    shard: bool = False
    rebuild_buckets: bool = True
    broadcast_params: bool = True
    error_feedback: bool = False
    timeout: float = TIMEOUT_S
    grad_dtype: torch.dtype | None = None
    overlap: bool = True
    auto_trials: int = 3

    def __post_init__(self) -> None:
        if self.grad_dtype is not None and (not isinstance(self.grad_dtype, torch.dtype)
                                            or not self.grad_dtype.is_floating_point):
            raise ValueError(f"GradReducer: grad_dtype must be a floating torch.dtype or None, "
                             f"got {self.grad_dtype!r}")
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            v = getattr(self, name)
            if name == "bucket_cap_mb" and v == "auto":
                if not self.rebuild_buckets:
                    raise ValueError("GradReducer: bucket_cap_mb='auto' plans the buckets at "
                                     "the rebuild; it needs rebuild_buckets=True")
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"GradReducer: {name} must be a number >= 0"
                                 + (" or 'auto'" if name == "bucket_cap_mb" else "")
                                 + f", got {v!r}")
        if isinstance(self.auto_trials, bool) or not isinstance(self.auto_trials, int) \
                or self.auto_trials < 0:
            raise ValueError(f"GradReducer: auto_trials must be an int >= 0, got "
                             f"{self.auto_trials!r}")
        self.comm_dtype = comm_dtype_arg(self.comm_dtype, where="GradReducer")
        if self.op not in ("avg", "sum"):
            raise ValueError(f"GradReducer: op must be 'avg' or 'sum', got {self.op!r}")
        if self.error_feedback and self.comm_dtype == "fp32":
            raise ValueError("GradReducer: error_feedback=True needs comm_dtype 'bf16' or 'int8'")
        positive_seconds(self.timeout, "GradReducer: timeout")


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
    tail: int = 0  # elements after ``padded`` that carry the call's stamp (summed with it)

    @property
    def span(self) -> int:
        """Elements the collective covers: the padded gradients and the stamp tail."""
        return self.padded + self.tail

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
                 first_cap_bytes: int, pad_to: int = 1,
                 dtypes: Sequence[torch.dtype] | None = None,
                 bucket_sizes: Sequence[int] | None = None,
                 tails: dict[torch.dtype, int] | None = None) -> Layout:
    """Assign ``params[i]`` for ``i`` in ``order`` to buckets and lay the buckets out flat.

    ``order`` must be a permutation of ``range(len(params))``. ``dtypes[i]``: the buffer dtype
    of parameter i's gradient (default: the parameter's dtype); byte caps count in it.
    ``bucket_sizes``: instead of the caps, consecutive runs of ``order`` with these many
    parameters each (one dtype per run), e.g. from ``overlap.dp.autobucket``. ``tails``:
    elements reserved after each bucket of a dtype for the stamp the bucket's all-reduce
    carries (``Bucket.tail``; the collective covers ``span``).
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

    dtype_of = (lambda i: params[i].dtype) if dtypes is None else (lambda i: dtypes[i])
    if bucket_sizes is not None:
        if sum(bucket_sizes) != len(order) or any(k <= 0 for k in bucket_sizes):
            raise ValueError(f"build_layout: bucket_sizes {list(bucket_sizes)} must be positive "
                             f"and sum to {len(order)}")
        start = 0
        for k in bucket_sizes:
            ids = list(order[start:start + k])
            if len({dtype_of(i) for i in ids}) != 1:
                raise ValueError(f"build_layout: bucket {ids} mixes dtypes")
            groups.append((start, dtype_of(ids[0]), ids))
            start += k
        order_iter = []
    else:
        order_iter = order
    for i in order_iter:
        p = params[i]
        dtype = dtype_of(i)
        open_.setdefault(dtype, []).append(i)
        open_bytes[dtype] = open_bytes.get(dtype, 0) + p.numel() * dtype.itemsize
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
        tail = (tails or {}).get(dtype, 0)
        buckets.append(Bucket(index=index, dtype=dtype, params=list(ids), offset=start,
                              numel=n, padded=padded, tail=tail))
        numel[dtype] = start + padded + tail
    return Layout(buckets=buckets, param_offset=param_offset, numel=numel,
                  param_bucket=param_bucket, order=list(order))


# ---- bucket collectives ------------------------------------------------------------------------

# torch >= 2.9 renamed the *_tensor collectives; both names reach the same backend op (gloo
# implements reduce-scatter and all-gather of a flat tensor natively, as NCCL does).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class BucketWork:
    """Handle of one bucket collective: ``wait(timeout, what=, group=)`` returns once the
    result is in place, or raises naming ``what``, the group, this rank, its peers and whether
    the collective failed at once (a peer died or aborted) or ran out of time. Wraps a
    ``torch.distributed`` Work (comm_dtype "fp32") or an ``overlap.comm.quant`` QuantWork, whose
    reduce-scatter returns a new tensor that is copied into ``out`` here."""

    __slots__ = ("_work", "_out", "_quant")

    def __init__(self, work, *, out: torch.Tensor | None = None, quant: bool = False):
        self._work, self._out, self._quant = work, out, quant

    def is_completed(self) -> bool:
        """Whether the collective has finished (a poll: no wait, no host sync)."""
        return self._work.is_completed()

    def wait(self, timeout: float, *, what: str = "", group=None) -> None:
        t0 = time.monotonic()
        try:
            if self._quant:
                result = self._work.wait(timeout)
                if self._out is not None:
                    self._out.copy_(result.view(-1))
            else:
                self._work.wait(timedelta(seconds=timeout))
        except (RuntimeError, TimeoutError) as exc:
            if not what:
                raise
            took = time.monotonic() - t0
            ranks = dist.get_process_group_ranks(group)
            rank = dist.get_rank()
            how = (f"did not finish within {timeout:g} s" if took >= 0.9 * timeout else
                   f"failed after {took:.2f} s (a peer died, aborted or closed its connection)")
            raise RuntimeError(f"{what} on DP group {ranks} (rank {rank}, peers "
                               f"{[r for r in ranks if r != rank]}) {how}: {exc}") from exc


def all_reduce_async(buf: torch.Tensor, *, group: dist.ProcessGroup, comm_dtype: str,
                     error_feedback=None, check_ranks: bool = False,
                     timeout: float = TIMEOUT_S, tag: int = 0) -> BucketWork:
    """In place ``buf = sum over group of buf``; "bf16"/"int8" go through overlap.comm.quant
    (whose error bound is documented there)."""
    if comm_dtype == "fp32":
        return BucketWork(dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True))
    work = quant.all_reduce(buf, group=group, comm_dtype=comm_dtype, op="sum",
                            error_feedback=error_feedback, check_ranks=check_ranks,
                            async_op=True, timeout=timeout, tag=tag)
    return BucketWork(work, quant=True)


def reduce_scatter_async(out: torch.Tensor, buf: torch.Tensor, *, group: dist.ProcessGroup,
                         comm_dtype: str, error_feedback=None, check_ranks: bool = False,
                         timeout: float = TIMEOUT_S, tag: int = 0) -> BucketWork:
    """``out (n/dp,) = sum over group of buf[r*n/dp : (r+1)*n/dp]`` for group rank ``r``."""
    if comm_dtype == "fp32":
        return BucketWork(_reduce_scatter(out, buf, op=dist.ReduceOp.SUM, group=group,
                                          async_op=True))
    work = quant.reduce_scatter(buf, group=group, comm_dtype=comm_dtype, op="sum",
                                error_feedback=error_feedback, check_ranks=check_ranks,
                                async_op=True, timeout=timeout, tag=tag)
    return BucketWork(work, out=out, quant=True)


def all_gather_async(out: torch.Tensor, shard: torch.Tensor, *,
                     group: dist.ProcessGroup) -> BucketWork:
    """``out (n,)[r*n/dp : (r+1)*n/dp] = shard`` of group rank ``r``, exact (parameters are
    never quantized)."""
    return BucketWork(_all_gather(out, shard, group=group, async_op=True))


# ---- replica checks at construction ------------------------------------------------------------

def check_same_params(params: Sequence[torch.Tensor], *, group: dist.ProcessGroup, where: str,
                      timeout: float) -> None:
    """Raise ValueError on every rank unless every rank of ``group`` holds parameters of the same
    count, shapes and dtypes (one small all-gather)."""
    sig = ";".join(f"{tuple(p.shape)}:{p.dtype}:{p.device.type}" for p in params)
    device = params[0].device  # NCCL needs device tensors, gloo takes either
    mine = torch.tensor([len(params), sum(p.numel() for p in params), zlib.crc32(sig.encode())],
                        dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    every = torch.zeros(size * 3, dtype=torch.int64, device=device)
    all_gather_async(every, mine, group=group).wait(timeout, what=f"{where}: parameter check",
                                                    group=group)
    every = every.view(size, 3)
    if not bool((every == mine).all()):
        ranks = dist.get_process_group_ranks(group)
        rows = {ranks[k]: every[k].tolist() for k in range(size)}
        raise ValueError(
            f"{where}: the DP replicas differ in their parameters (per rank [count, numel, crc32 "
            f"of shapes/dtypes]: {rows}); expected every rank of the DP group to hold the same "
            "module")


@torch.no_grad()
def broadcast_params(params: Sequence[torch.Tensor], *, src: int,
                     group: dist.ProcessGroup) -> None:
    """Copy global rank ``src``'s parameter values to every rank of ``group`` (one broadcast
    per dtype)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for ps in by_dtype.values():
        flat = torch.cat([p.detach().reshape(-1) for p in ps])
        dist.broadcast(flat, src=src, group=group)
        off = 0
        for p in ps:
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
