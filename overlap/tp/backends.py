"""Backend choice and dispatch for the fused TP ops (the autograd layer is overlap.tp.ops).

``backend="auto"`` resolves, identically on every rank, to

1. ``"triton"`` for CUDA tensors when overlap.kernels.triton.tp_gemm is installed (the wait is
   fused into the GEMM tiles: no copy stream, no chunk-sized GEMM launches);
2. else ``"symmetric"`` when every rank of the group is on one host (userbuffers: peer copies
   at memory bandwidth by a copy engine or thread, no collective library in the loop);
3. else ``"chunked"`` (async torch.distributed collectives / ring P2P; works across hosts).

With one rank every backend is a plain matmul; "auto" then says "chunked". The host check is one
``all_gather_object`` per group, on the first "auto" call; the answer is cached.
The triton backend is never chosen automatically on CPU: its interpreter is a correctness
twin, orders of magnitude slower than a CPU GEMM.

Default ``chunks`` = world for every op: for the two ring/pull ops a rank's shard is the natural
message (one signal and one transfer per peer); finer pieces add a per-message latency and
smaller, less efficient GEMMs, and with world pieces only about 1/world of the communication is
left exposed. For matmul_all_reduce it splits M into world row blocks, so the reduction of all
but the last block runs under the GEMMs.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Callable

import torch
import torch.distributed as dist

from overlap.tp import chunked, symmetric, triton_backend
from overlap.tp.checks import check_across_ranks, where
from overlap.tp.context import TPContext, cached_context
from overlap.tp.regions import all_gather_dim, reduce_scatter_dim

__all__ = ["Call", "resolve", "run_ag", "run_rs", "run_ar", "gather", "scatter",
           "have_triton_tp"]

_same_host: dict[int, bool] = {}
_have_triton: bool | None = None


def have_triton_tp() -> bool:
    global _have_triton
    if _have_triton is None:
        _have_triton = triton_backend.available()
    return _have_triton


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Call:
    """One op call's resolved settings; kept on the autograd ctx for the backward."""

    op: str
    group: dist.ProcessGroup
    backend: str
    chunks: int
    context: TPContext | None = None
    check_sig: list[int] | None = None  # compare across ranks when a context is created


def _host_id() -> tuple[str, str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def same_host(group: dist.ProcessGroup) -> bool:
    if id(group) not in _same_host:
        ids: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(ids, _host_id(), group=group)
        _same_host[id(group)] = len(set(ids)) == 1
    return _same_host[id(group)]


def resolve(op: str, backend: str, *, group: dist.ProcessGroup, device: torch.device,
            dtype: torch.dtype) -> str:
    if backend == "triton" and not have_triton_tp():
        raise ValueError(f"{op}: backend='triton' needs overlap.kernels.triton.tp_gemm, which "
                         f"this build lacks; use 'auto', 'symmetric' or 'chunked'{where(group)}")
    if backend != "auto":
        return backend
    if dist.get_world_size(group) == 1:
        return "chunked"
    if device.type == "cuda" and dtype != torch.float64 and have_triton_tp():
        return "triton"
    return "symmetric" if same_host(group) else "chunked"


def _context(call: Call, x: torch.Tensor, w: torch.Tensor) -> TPContext:
    if call.context is not None and call.context.op == call.op:
        return call.context
    world = dist.get_world_size(call.group)
    rows, k, n = x.shape[0], x.shape[1], w.shape[1]
    if call.backend == "triton":
        nbytes, nsig = triton_backend.sizes(call.op, rows, k, n, world, x.dtype)
    elif call.op == "all_gather_matmul":
        nbytes, nsig = symmetric.ag_bytes(rows, k, x.dtype), symmetric.num_signals(call.op, world)
    elif call.op == "matmul_reduce_scatter":
        nbytes = symmetric.rs_bytes(rows // world, n, world, x.dtype)
        nsig = symmetric.num_signals(call.op, world)
    else:
        nbytes = symmetric.ar_bytes(rows, n, world, x.dtype)
        nsig = symmetric.num_signals(call.op, world)
    def on_create() -> None:  # ranks compare shapes when (and only when) they create it
        if call.check_sig is not None:
            check_across_ranks(call.op, call.check_sig, group=call.group, device=x.device)

    key = (call.op, call.backend, rows, k, n, x.dtype, x.device)
    return cached_context(key, op=call.op, backend=call.backend, group=call.group,
                          nbytes=nbytes, num_signals=nsig, device=x.device, on_create=on_create)


def _guarded(ctx: TPContext, fn: Callable):
    start = ctx.phase
    try:
        return fn()
    except BaseException as exc:
        if ctx.phase != start:  # failed mid-protocol (not a refused input): peers must know
            ctx.fail(exc)
        raise


def run_ag(call: Call, x_shard: torch.Tensor, w: torch.Tensor, *, return_gathered: bool,
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if call.backend == "chunked" or (call.backend == "symmetric" and
                                     dist.get_world_size(call.group) == 1):
        return chunked.all_gather_matmul(x_shard, w, group=call.group, chunks=call.chunks,
                                         return_gathered=return_gathered)
    ctx = _context(call, x_shard, w)
    if call.backend == "symmetric":
        return _guarded(ctx, lambda: symmetric.all_gather_matmul(
            ctx, x_shard, w, chunks=call.chunks, return_gathered=return_gathered))
    return _guarded(ctx, lambda: triton_backend.all_gather_matmul(
        ctx, x_shard, w, return_gathered=return_gathered))


def run_rs(call: Call, x: torch.Tensor, w: torch.Tensor, *,
           overlap_with: Callable[[], None] | None = None) -> torch.Tensor:
    if call.backend == "chunked" or (call.backend == "symmetric" and
                                     dist.get_world_size(call.group) == 1):
        return chunked.matmul_reduce_scatter(x, w, group=call.group, chunks=call.chunks,
                                             overlap_with=overlap_with)
    ctx = _context(call, x, w)
    if call.backend == "symmetric":
        return _guarded(ctx, lambda: symmetric.matmul_reduce_scatter(
            ctx, x, w, chunks=call.chunks, overlap_with=overlap_with))
    return _guarded(ctx, lambda: triton_backend.matmul_reduce_scatter(
        ctx, x, w, overlap_with=overlap_with))


def run_ar(call: Call, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if call.backend == "chunked" or (call.backend == "symmetric" and
                                     dist.get_world_size(call.group) == 1):
        return chunked.matmul_all_reduce(x, w, group=call.group, chunks=call.chunks)
    ctx = _context(call, x, w)
    if call.backend == "symmetric":
        return _guarded(ctx, lambda: symmetric.matmul_all_reduce(ctx, x, w, chunks=call.chunks))
    return _guarded(ctx, lambda: triton_backend.matmul_all_reduce(ctx, x, w, group=call.group))


def gather(call: Call, x_shard: torch.Tensor) -> torch.Tensor:
    """all_gather along dim 0 with no GEMM (a backward that needs only the gathered tensor)."""
    return all_gather_dim(x_shard, 0, group=call.group, op="all_gather (tp backward)")


def scatter(call: Call, x: torch.Tensor) -> torch.Tensor:
    """reduce_scatter along dim 0 with no GEMM."""
    return reduce_scatter_dim(x, 0, group=call.group, op="reduce_scatter (tp backward)")
