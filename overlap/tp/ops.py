"""Fused tensor-parallel collective matmuls: the collective runs chunk by chunk under the GEMM.

    all_gather_matmul(x_shard, w, *, group)      y       = all_gather(x_shard) @ w
    matmul_reduce_scatter(x, w, *, group)        y_shard = reduce_scatter(x @ w)
    matmul_all_reduce(x, w, *, group)            y       = all_reduce(x @ w)

Shape legend (``world`` = size of ``group``; every rank passes the same shapes):
    M = rows of the full (gathered / unscattered) activation, m = M / world = rows of a shard,
    K = input features (the GEMM reduction dim), N = output features of this rank's w.
    2-D activations are [rows, features]. 3-D activations are *sequence-first* [S, B, features]
    (Megatron's layout): they are flattened to [S*B, features], so gathering/scattering rows is
    gathering/scattering along dim 0 (S), and the 3-D result is [S_out, B, N]. Batch-first
    [B, S, H] tensors: pass ``seq_dim=1`` (all_gather_matmul, matmul_reduce_scatter), which
    transposes to [S, B, H] around the op (one copy each way; autograd follows).
    ``w`` is [K, N]: an nn.Linear keeps weight as [N, K], so layers pass ``weight.t()``.

Backends (``backend=``): "chunked" (async torch.distributed, any transport), "symmetric"
(userbuffers over a SymmetricWorkspace, one host), "triton" (fused kernels over the same
workspace), "auto" (see overlap.tp.backends for the rule and the default ``chunks``).
Accuracy: the result equals the unfused reference up to summation order: fp32 within 1e-5
relative; bf16/fp16 reduce-scatter sums are rounded to the input dtype at every ring hop
(chunked, like NCCL) or summed in fp32 then rounded once (symmetric, triton).

``check_inputs`` (default True): local checks always run before any communication (shapes,
K, dtypes, divisibility; overlap.tp.checks). On top, ranks compare their shapes with one small
all_gather of int64 metadata: on every call for "chunked"; for "symmetric"/"triton" only when a
cached context is created (so steady-state calls cost no collective). A disagreement raises
ValueError on every rank naming the ranks. After a context exists, a rank that diverges
surfaces as a SignalTimeout within the context's timeout instead. Pass False to skip the
collective (it synchronises the stream on NCCL).

``context=``: an explicit TPContext from :func:`make_context` (see overlap.tp.context);
otherwise contexts are cached per (op, backend, group, shapes, dtype, device).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.symm.workspace import group_name
from overlap.tp import backends
from overlap.tp.backends import Call
from overlap.tp.checks import check_across_ranks, signature, validate, where
from overlap.tp.context import TPContext, close_all_contexts

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "make_context",
           "close_all_contexts", "resolve_backend"]


def _prepare(op: str, x: torch.Tensor, w: torch.Tensor, *, group, backend: str, chunks,
             check_inputs: bool, context: TPContext | None, flags: int = 0) -> Call:
    validate(op, x, w, group=group, backend=backend, chunks=chunks)
    if context is not None:
        if not isinstance(context, TPContext):
            raise TypeError(f"{op}: context must be a TPContext from make_context, got "
                            f"{type(context).__name__}{where(group)}")
        if context.op != op:
            raise ValueError(f"{op}: context= was made for {context.op}, not {op}{where(group)}")
        if context.group is not group or backend not in ("auto", context.backend):
            raise ValueError(f"{op}: context= belongs to group {group_name(context.group)} "
                             f"and backend {context.backend!r}, but the call passes group "
                             f"{group_name(group)} and backend {backend!r}{where(group)}")
        backend = context.backend
    resolved = backends.resolve(op, backend, group=group, device=x.device, dtype=x.dtype)
    world = dist.get_world_size(group)
    sig = signature(op, resolved, x, w, chunks, flags) if check_inputs else None
    if sig is not None and (resolved == "chunked" or world == 1):
        check_across_ranks(op, sig, group=group, device=x.device)
        sig = None
    if sig is not None and context is not None:
        check_across_ranks(op, sig, group=group, device=x.device)
        sig = None
    return Call(op=op, group=group, backend=resolved, chunks=chunks or world, context=context,
                check_sig=sig)


def _check_seq_dim(op: str, x, seq_dim: int, group) -> None:
    if seq_dim not in (0, 1) or (seq_dim == 1 and getattr(x, "dim", lambda: 0)() != 3):
        raise ValueError(f"{op}: seq_dim must be 0, or 1 for a batch-first 3-D [B, S, K] input, "
                         f"got seq_dim={seq_dim!r} for shape "
                         f"{tuple(getattr(x, 'shape', ()))}{where(group)}")


def _backward_call(call: Call, op: str) -> Call:
    return Call(op=op, group=call.group, backend=call.backend, chunks=call.chunks)


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, w, call: Call):
        ctx.set_materialize_grads(False)
        y, gathered = backends.run_ag(call, x_shard, w, return_gathered=True)
        if gathered is x_shard:  # one rank: an output must not alias an input
            gathered = gathered.clone()
        ctx.call = call
        ctx.save_for_backward(gathered if ctx.needs_input_grad[1] else None, w)
        return y, gathered

    @staticmethod
    def backward(ctx, dy, dgathered):
        gathered, w = ctx.saved_tensors
        call = _backward_call(ctx.call, "matmul_reduce_scatter")
        dx_shard = dw = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if dy is not None:
            dy = dy.contiguous()
            if need_dw and not need_dx:
                dw = gathered.t() @ dy
            if need_dx:
                def wgrad() -> None:
                    nonlocal dw
                    dw = gathered.t() @ dy
                # dgrad's reduce-scatter is launched first; the wgrad GEMM runs while its last
                # transfers are in flight, then the op waits for them.
                dx_shard = backends.run_rs(call, dy, w.t(), overlap_with=wgrad if need_dw else None)
        if need_dx and dgathered is not None:
            extra = backends.scatter(call, dgathered)
            dx_shard = extra if dx_shard is None else dx_shard + extra
        return dx_shard, dw, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, call: Call):
        ctx.call = call
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        return backends.run_rs(call, x, w)

    @staticmethod
    def backward(ctx, dy_shard):
        x, w = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        call = _backward_call(ctx.call, "all_gather_matmul")
        dy_shard = dy_shard.contiguous()
        dx = dw = None
        if need_dx:
            dx, dy = backends.run_ag(call, dy_shard, w.t(), return_gathered=need_dw)
        else:
            dy = backends.gather(call, dy_shard)
        if need_dw:
            dw = x.t() @ dy
        return dx, dw, None


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, call: Call):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        return backends.run_ar(call, x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w.t() if ctx.needs_input_grad[0] else None
        dw = x.t() @ dy if ctx.needs_input_grad[1] else None
        return dx, dw, None


def all_gather_matmul(x_shard: torch.Tensor, w: torch.Tensor, *, group: dist.ProcessGroup,
                      backend: str = "auto", chunks: int | None = None,
                      return_gathered: bool = False, check_inputs: bool = True,
                      context: TPContext | None = None, seq_dim: int = 0):
    """Sequence-parallel column-parallel GEMM with the all-gather hidden under it.

    Shapes: x_shard [m, K] or [s, B, K] (this rank's rows), w [K, N] -> y [M, N] or
    [world*s, B, N]; with ``return_gathered`` also x [M, K] (or [world*s, B, K]), the gathered
    input, e.g. to feed more GEMMs without gathering again.

        forward  y       = all_gather(x_shard) @ w
        dgrad    dx_shard = reduce_scatter(dy @ w.T)       (matmul_reduce_scatter, fused)
                          (+ reduce_scatter(d_gathered) if the gathered output is used)
        wgrad    dw      = all_gather(x_shard).T @ dy      (runs while dgrad's last transfers
                                                            are in flight; reuses the forward's
                                                            gathered x)

    ``chunks``: pieces along M, a multiple of world (default world: one per rank's shard).
    ``seq_dim=1``: x_shard is batch-first [B, s, K], gathered along dim 1 (outputs likewise).
    ``check_inputs`` and ``context``: see the module docstring.
    Returns y, or (y, gathered) when ``return_gathered``.
    """
    op = "all_gather_matmul"
    _check_seq_dim(op, x_shard, seq_dim, group)
    if seq_dim == 1:  # batch-first [B, s, K]: gather along s via the sequence-first layout
        out = all_gather_matmul(x_shard.transpose(0, 1), w, group=group, backend=backend,
                                chunks=chunks, return_gathered=return_gathered,
                                check_inputs=check_inputs, context=context)
        if return_gathered:
            return out[0].transpose(0, 1), out[1].transpose(0, 1)
        return out.transpose(0, 1)
    call = _prepare(op, x_shard, w, group=group, backend=backend, chunks=chunks,
                    check_inputs=check_inputs, context=context, flags=int(return_gathered))
    world = dist.get_world_size(group)
    x2 = x_shard.reshape(-1, x_shard.shape[-1])
    y2, g2 = _AllGatherMatmul.apply(x2, w, call)
    lead = (world * x_shard.shape[0], *x_shard.shape[1:-1])
    y = y2.view(*lead, w.shape[1])
    if return_gathered:
        return y, g2.view(*lead, x_shard.shape[-1])
    return y


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, *, group: dist.ProcessGroup,
                          backend: str = "auto", chunks: int | None = None,
                          check_inputs: bool = True, context: TPContext | None = None,
                          seq_dim: int = 0) -> torch.Tensor:
    """Row-parallel GEMM with sequence parallelism: the reduce-scatter hidden under the GEMM.

    Shapes: x [M, K] or [S, B, K] (M = S*B; S divisible by world), w [K, N] ->
    y_shard [M/world, N] or [S/world, B, N]: rows r*m..(r+1)*m of the sum over ranks.

        forward  y_shard = reduce_scatter(x @ w)           (summed over ranks, dim 0)
        dgrad    dx      = all_gather(dy_shard) @ w.T      (all_gather_matmul, fused)
        wgrad    dw      = x.T @ all_gather(dy_shard)      (reuses dgrad's gathered dy)

    ``chunks``: pieces along M, a multiple of world (default world: one per destination rank).
    ``seq_dim=1``: x is batch-first [B, S, K], scattered along dim 1 -> [B, S/world, N].
    ``check_inputs`` and ``context``: see the module docstring.
    """
    op = "matmul_reduce_scatter"
    _check_seq_dim(op, x, seq_dim, group)
    if seq_dim == 1:  # batch-first [B, S, K]: scatter along S via the sequence-first layout
        return matmul_reduce_scatter(x.transpose(0, 1), w, group=group, backend=backend,
                                     chunks=chunks, check_inputs=check_inputs,
                                     context=context).transpose(0, 1)
    call = _prepare(op, x, w, group=group, backend=backend, chunks=chunks,
                    check_inputs=check_inputs, context=context)
    world = dist.get_world_size(group)
    y2 = _MatmulReduceScatter.apply(x.reshape(-1, x.shape[-1]), w, call)
    return y2.view(x.shape[0] // world, *x.shape[1:-1], w.shape[1])


def matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, *, group: dist.ProcessGroup,
                      backend: str = "auto", chunks: int | None = None,
                      check_inputs: bool = True, context: TPContext | None = None,
                      ) -> torch.Tensor:
    """Row-parallel GEMM without sequence parallelism: the all-reduce hidden under the GEMM.

    Shapes: x [M, K] or [S, B, K] (K = this rank's input features), w [K, N] -> y [M, N] or
    [S, B, N], identical on every rank.

        forward  y  = all_reduce(x @ w)
        dgrad    dx = dy @ w.T           (no communication: dy is the same on every rank, as
        wgrad    dw = x.T @ dy            it is when everything after y is replicated)

    ``chunks``: row blocks of M (default world). Any M works (symmetric/triton pad M to a
    multiple of world internally). ``check_inputs`` and ``context``: see the module docstring.
    """
    op = "matmul_all_reduce"
    call = _prepare(op, x, w, group=group, backend=backend, chunks=chunks,
                    check_inputs=check_inputs, context=context)
    y2 = _MatmulAllReduce.apply(x.reshape(-1, x.shape[-1]), w, call)
    return y2.view(*x.shape[:-1], w.shape[1])


def resolve_backend(x: torch.Tensor, *, group: dist.ProcessGroup, backend: str = "auto",
                    op: str = "all_gather_matmul") -> str:
    """What ``backend`` means for tensors like ``x`` on ``group`` (collective on first use)."""
    return backends.resolve(op, backend, group=group, device=x.device, dtype=x.dtype)


def make_context(op: str, x: torch.Tensor, w: torch.Tensor, *, group: dist.ProcessGroup,
                 backend: str = "auto", nbytes: int | None = None,
                 timeout: float = 30.0) -> TPContext:
    """An uncached context for ``op`` (collective over ``group``), sized for ``x`` and ``w``
    (shapes as the op takes them) or ``nbytes`` per rank. Pass it as ``context=``; close() it.
    """
    validate(op, x, w, group=group, backend=backend, chunks=None)
    resolved = backends.resolve(op, backend, group=group, device=x.device, dtype=x.dtype)
    if resolved == "chunked":
        raise ValueError(f"{op}: make_context needs a workspace backend ('symmetric' or "
                         f"'triton'), got {backend!r} -> 'chunked'{where(group)}")
    world = dist.get_world_size(group)
    x2 = x.reshape(-1, x.shape[-1])
    rows, k, n = x2.shape[0], x2.shape[1], w.shape[1]
    if resolved == "triton":
        need, nsig = backends.triton_backend.sizes(op, rows, k, n, world, x.dtype)
    else:
        from overlap.tp import symmetric as sym

        need = {"all_gather_matmul": lambda: sym.ag_bytes(rows, k, x.dtype),
                "matmul_reduce_scatter": lambda: sym.rs_bytes(rows // world, n, world, x.dtype),
                "matmul_all_reduce": lambda: sym.ar_bytes(rows, n, world, x.dtype)}[op]()
        nsig = sym.num_signals(op, world)
    return TPContext(op=op, backend=resolved, group=group, nbytes=nbytes or need,
                     num_signals=nsig, device=x.device, timeout=timeout)
