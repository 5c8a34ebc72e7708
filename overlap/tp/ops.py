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

Every op runs on a TP communicator (overlap.tp.comm.TPComm): ``comm=`` passes one; the
``group=`` form (with ``backend=``, ``chunks=``, ``check_inputs=``) is a thin wrapper that uses
the default communicator of that group and settings. Backends: "chunked" (async
torch.distributed, any transport), "symmetric" (userbuffers over a SymmetricWorkspace, one
host), "triton" (fused kernels over the same workspace), "auto" (resolved once by the comm; see
overlap.tp.comm and overlap.tp.backends for the rule and the default ``chunks``).
Accuracy: the result equals the unfused reference up to summation order: fp32 within 1e-5
relative; bf16/fp16 reduce-scatter sums are rounded to the input dtype at every ring hop
(chunked, like NCCL) or summed in fp32 then rounded once (symmetric, triton).

``check_inputs`` (default True): local checks always run before any communication (shapes,
K, dtypes, divisibility; overlap.tp.checks). On top, the communicator's first call compares
every rank's shapes with one small all_gather of int64 metadata. Every call, the first and
every later one and also with ``check_inputs=False``, carries a stamp (op, call number,
shapes, dtype, options) in the data it exchanges (overlap.tp.stamps): ranks that disagree on
any call raise ``Disagreement`` (a ValueError) on every rank at once, naming the op, the call
number and both ranks' values, at no extra collective and no host sync.

Failures stay failures: any error inside an op (a refused input, a timeout, a dead peer) fails
its communicator, and every later call on it raises TPCommFailed with the first error.

``context=``: an explicit TPContext from :func:`make_context` (see overlap.tp.context);
otherwise the communicator keeps one per (op, backend, shapes, dtype, device).

``torch.compile``: while compiling, each op is one ``torch.library`` custom op
(overlap.tp.custom_ops: fake implementation, registered autograd) whose real implementation
is the eager path below, so ``fullgraph=True`` works and the checks and failure handling run
at run time; it needs ``comm=``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.symm.workspace import PeerDied, group_name
from overlap.tp import backends, custom_ops
from overlap.tp.checks import check_across_ranks, signature, validate
from overlap.tp.comm import TPComm, TPCommFailed, close_default_comms, default_comm
from overlap.tp.context import TPContext

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "make_context",
           "close_all_contexts", "resolve_backend"]


class _Run:
    """One call's communicator, backend, chunks and (explicit) context; kept on the autograd
    ctx for the backward."""

    __slots__ = ("comm", "backend", "chunks", "context")

    def __init__(self, comm: TPComm, backend, chunks: int, context: TPContext | None):
        self.comm, self.backend, self.chunks, self.context = comm, backend, chunks, context

    def ctx_for(self, op: str, x: torch.Tensor, w: torch.Tensor, on_create=lambda: None):
        if self.context is not None and self.context.op == op:
            return self.context
        return backends.context_for(self.comm, self.backend, op, x, w, on_create)

    def guarded(self, op: str, fn, x: torch.Tensor | None = None, w: torch.Tensor | None = None,
                flags: int = 0):
        """Run ``fn``; any error fails the communicator (peers blocked on us raise now).
        With ``x`` (the backend's 2-D input) the call is counted and stamped first
        (overlap.tp.stamps), so ranks that disagree on it raise before anything else."""
        self.comm.ensure_usable(op)
        try:
            if x is not None:
                self.comm.stamp(op, x, w, self.chunks, flags,
                                None if self.context is None else self.context.timeout)
            return fn()
        except TPCommFailed:
            raise
        except BaseException as exc:
            _name_the_op(exc, op, self.comm)
            self.comm.fail(exc)
            if self.context is not None:  # an explicit context fails with its op too
                self.context.fail(exc)
            raise


def _name_the_op(exc: BaseException, op: str, comm: TPComm) -> None:
    """Prefix a transport error (same type, so callers' handlers still match) with the op,
    the backend, this rank, the group and what kind of failure it was."""
    text = str(exc)
    if not exc.args or not isinstance(exc.args[0], str) or op in text:
        return
    kind = ("peer aborted" if "aborted" in text else
            "peer died" if isinstance(exc, PeerDied) or "exited" in text else
            "timed out" if isinstance(exc, TimeoutError) else "failed")
    exc.args = (f"{op} ({comm.backend}){comm.where()} {kind}: {text}", *exc.args[1:])


def _comm_for(op: str, comm, group, backend: str, chunks, check_inputs: bool,
              context) -> TPComm:
    if comm is not None:
        if not isinstance(comm, TPComm):
            raise TypeError(f"{op}: comm must be a TPComm, got {type(comm).__name__}")
        if group is not None and group is not comm.group:
            raise ValueError(f"{op}: pass comm= or group=, not both (comm is on group "
                             f"{group_name(comm.group)}, group= is {group_name(group)})")
        return comm
    if context is not None:
        if not isinstance(context, TPContext):
            raise TypeError(f"{op}: context must be a TPContext from make_context, got "
                            f"{type(context).__name__}")
        if group is not None and context.group is not group:
            raise ValueError(f"{op}: context= belongs to group {group_name(context.group)}, "
                             f"but the call passes group {group_name(group)}")
        if backend not in ("auto", context.backend):
            raise ValueError(f"{op}: context= belongs to backend {context.backend!r}, but the "
                             f"call passes backend {backend!r}")
        backend, group = context.backend, context.group
    return default_comm(group, backend=backend, op=op)


def _prepare(op: str, x, w, *, comm, group, backend: str, chunks, check_inputs: bool,
             context, flags: int = 0, seq_dim: int = 0) -> _Run:
    c = _comm_for(op, comm, group, backend, chunks, check_inputs, context)
    c.ensure_usable(op)
    if context is not None and context.op != op:
        err = ValueError(f"{op}: context= was made for {context.op}, not {op}{c.where()}")
        c.fail(err)
        raise err
    run = _Run(c, None, 0, context)
    # comm= carries the settings; the group= form's per-call knobs apply to this call.
    check = c.check_inputs if comm is not None else check_inputs

    def setup() -> _Run:
        _check_seq_dim(op, x, seq_dim, c.where())
        xs = x.transpose(0, 1) if seq_dim == 1 else x
        validate(op, xs, w, group=c.group, backend=c.backend, chunks=chunks)
        run.backend = backends.backend_for(c, x.dtype)
        run.chunks = chunks or c.chunks or c.world
        # The named all-gather check runs on the communicator's first call only: every rank
        # reaches that call alike, so no rank can run a collective its peers skip. Every call
        # (this one included) is then compared through its stamp (overlap.tp.stamps).
        if check and c.world > 1 and c.first_call():
            check_across_ranks(op, signature(op, c.backend, xs, w, chunks, flags),
                               group=c.group, device=x.device)
        return run

    return run.guarded(op, setup)


def _compile_args(op: str, comm, context, return_gathered: bool) -> None:
    """Under torch.compile each op is one custom op (overlap.tp.custom_ops) on a TPComm."""
    if comm is None or context is not None or return_gathered:
        raise NotImplementedError(
            f"{op} under torch.compile needs comm= (a TPComm) and supports neither context= nor "
            f"return_gathered=True (rank {dist.get_rank()}; got comm={type(comm).__name__}, "
            f"context={'given' if context is not None else None}, return_gathered="
            f"{return_gathered}); call it outside the compiled region for those")


def _check_seq_dim(op: str, x, seq_dim: int, at: str) -> None:
    if seq_dim not in (0, 1) or (seq_dim == 1 and getattr(x, "dim", lambda: 0)() != 3):
        raise ValueError(f"{op}: seq_dim must be 0, or 1 for a batch-first 3-D [B, S, K] input, "
                         f"got seq_dim={seq_dim!r} for shape {tuple(getattr(x, 'shape', ()))}{at}")


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, w, run: _Run):
        ctx.set_materialize_grads(False)
        op = "all_gather_matmul"
        y, gathered = run.guarded(op, lambda: run.backend.ag(
            run.comm, run.ctx_for(op, x_shard, w), x_shard, w, chunks=run.chunks,
            return_gathered=True), x_shard, w, flags=1)
        if gathered is x_shard:  # one rank: an output must not alias an input
            gathered = gathered.clone()
        ctx.run = run
        ctx.save_for_backward(gathered if ctx.needs_input_grad[1] else None, w)
        return y, gathered

    @staticmethod
    def backward(ctx, dy, dgathered):
        gathered, w = ctx.saved_tensors
        run = _Run(ctx.run.comm, ctx.run.backend, ctx.run.chunks, None)
        op = "matmul_reduce_scatter"
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
                wt = w.t()
                dx_shard = run.guarded(op, lambda: run.backend.rs(
                    run.comm, run.ctx_for(op, dy, wt), dy, wt, chunks=run.chunks,
                    overlap_with=wgrad if need_dw else None), dy, wt)
        if need_dx and dgathered is not None:
            extra = run.guarded("reduce_scatter (tp backward)",
                                lambda: backends.scatter(run.comm, dgathered), dgathered)
            dx_shard = extra if dx_shard is None else dx_shard + extra
        return dx_shard, dw, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, run: _Run):
        ctx.run = run
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        op = "matmul_reduce_scatter"
        return run.guarded(op, lambda: run.backend.rs(
            run.comm, run.ctx_for(op, x, w), x, w, chunks=run.chunks, overlap_with=None), x, w)

    @staticmethod
    def backward(ctx, dy_shard):
        x, w = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        run = _Run(ctx.run.comm, ctx.run.backend, ctx.run.chunks, None)
        op = "all_gather_matmul"
        dy_shard = dy_shard.contiguous()
        dx = dw = None
        if need_dx:
            wt = w.t()
            dx, dy = run.guarded(op, lambda: run.backend.ag(
                run.comm, run.ctx_for(op, dy_shard, wt), dy_shard, wt, chunks=run.chunks,
                return_gathered=need_dw), dy_shard, wt, flags=int(need_dw))
        else:
            dy = run.guarded("all_gather (tp backward)",
                             lambda: backends.gather(run.comm, dy_shard), dy_shard)
        if need_dw:
            dw = x.t() @ dy
        return dx, dw, None


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, run: _Run):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        op = "matmul_all_reduce"
        return run.guarded(op, lambda: run.backend.ar(
            run.comm, run.ctx_for(op, x, w), x, w, chunks=run.chunks), x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w.t() if ctx.needs_input_grad[0] else None
        dw = x.t() @ dy if ctx.needs_input_grad[1] else None
        return dx, dw, None


def all_gather_matmul(x_shard: torch.Tensor, w: torch.Tensor, *, comm: TPComm | None = None,
                      group: dist.ProcessGroup | None = None, backend: str = "auto",
                      chunks: int | None = None, return_gathered: bool = False,
                      check_inputs: bool = True, context: TPContext | None = None,
                      seq_dim: int = 0):
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
    ``comm``, ``group``/``backend``/``check_inputs`` and ``context``: see the module docstring.
    Returns y, or (y, gathered) when ``return_gathered``.
    """
    op = "all_gather_matmul"
    if torch.compiler.is_compiling():
        _compile_args(op, comm, context, return_gathered)
        return custom_ops.all_gather_matmul(x_shard, w, comm, chunks, seq_dim)
    run = _prepare(op, x_shard, w, comm=comm, group=group, backend=backend, chunks=chunks,
                   check_inputs=check_inputs, context=context, flags=int(return_gathered),
                   seq_dim=seq_dim)
    if seq_dim == 1:  # batch-first [B, s, K]: gather along s via the sequence-first layout
        x_shard = x_shard.transpose(0, 1)
    world = run.comm.world
    x2 = x_shard.reshape(-1, x_shard.shape[-1])
    y2, g2 = _AllGatherMatmul.apply(x2, w, run)
    lead = (world * x_shard.shape[0], *x_shard.shape[1:-1])
    y = y2.view(*lead, w.shape[1])
    g = g2.view(*lead, x_shard.shape[-1]) if return_gathered else None
    if seq_dim == 1:
        y = y.transpose(0, 1)
        g = None if g is None else g.transpose(0, 1)
    return (y, g) if return_gathered else y


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, *, comm: TPComm | None = None,
                          group: dist.ProcessGroup | None = None, backend: str = "auto",
                          chunks: int | None = None, check_inputs: bool = True,
                          context: TPContext | None = None, seq_dim: int = 0) -> torch.Tensor:
    """Row-parallel GEMM with sequence parallelism: the reduce-scatter hidden under the GEMM.

    Shapes: x [M, K] or [S, B, K] (M = S*B; S divisible by world), w [K, N] ->
    y_shard [M/world, N] or [S/world, B, N]: rows r*m..(r+1)*m of the sum over ranks.

        forward  y_shard = reduce_scatter(x @ w)           (summed over ranks, dim 0)
        dgrad    dx      = all_gather(dy_shard) @ w.T      (all_gather_matmul, fused)
        wgrad    dw      = x.T @ all_gather(dy_shard)      (reuses dgrad's gathered dy)

    ``chunks``: pieces along M, a multiple of world (default world: one per destination rank).
    ``seq_dim=1``: x is batch-first [B, S, K], scattered along dim 1 -> [B, S/world, N].
    ``comm``, ``group``/``backend``/``check_inputs`` and ``context``: see the module docstring.
    """
    op = "matmul_reduce_scatter"
    if torch.compiler.is_compiling():
        _compile_args(op, comm, context, False)
        return custom_ops.matmul_reduce_scatter(x, w, comm, chunks, seq_dim)
    run = _prepare(op, x, w, comm=comm, group=group, backend=backend, chunks=chunks,
                   check_inputs=check_inputs, context=context, seq_dim=seq_dim)
    if seq_dim == 1:  # batch-first [B, S, K]: scatter along S via the sequence-first layout
        x = x.transpose(0, 1)
    world = run.comm.world
    y2 = _MatmulReduceScatter.apply(x.reshape(-1, x.shape[-1]), w, run)
    y = y2.view(x.shape[0] // world, *x.shape[1:-1], w.shape[1])
    return y.transpose(0, 1) if seq_dim == 1 else y


def matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, *, comm: TPComm | None = None,
                      group: dist.ProcessGroup | None = None, backend: str = "auto",
                      chunks: int | None = None, check_inputs: bool = True,
                      context: TPContext | None = None) -> torch.Tensor:
    """Row-parallel GEMM without sequence parallelism: the all-reduce hidden under the GEMM.

    Shapes: x [M, K] or [S, B, K] (K = this rank's input features), w [K, N] -> y [M, N] or
    [S, B, N], identical on every rank.

        forward  y  = all_reduce(x @ w)
        dgrad    dx = dy @ w.T           (no communication: dy is the same on every rank, as
        wgrad    dw = x.T @ dy            it is when everything after y is replicated)

    ``chunks``: row blocks of M (default world). Any M works (symmetric/triton pad M to a
    multiple of world internally). ``comm``, ``group``/``backend``/``check_inputs`` and ``context``:
    see the module docstring.
    """
    op = "matmul_all_reduce"
    if torch.compiler.is_compiling():
        _compile_args(op, comm, context, False)
        return custom_ops.matmul_all_reduce(x, w, comm, chunks)
    run = _prepare(op, x, w, comm=comm, group=group, backend=backend, chunks=chunks,
                   check_inputs=check_inputs, context=context)
    y2 = _MatmulAllReduce.apply(x.reshape(-1, x.shape[-1]), w, run)
    return y2.view(*x.shape[:-1], w.shape[1])


def resolve_backend(x: torch.Tensor | None = None, *, group: dist.ProcessGroup,
                    backend: str = "auto", op: str = "all_gather_matmul") -> str:
    """What ``backend`` resolves to on ``group`` (the default communicator's choice; collective
    on first use). ``TPComm(group, backend=...).backend`` is the same answer."""
    return default_comm(group, backend=backend, op=op).backend


def make_context(op: str, x: torch.Tensor, w: torch.Tensor, *, group: dist.ProcessGroup,
                 backend: str = "auto", nbytes: int | None = None,
                 timeout: float = 30.0) -> TPContext:
    """An explicit context for ``op`` (collective over ``group``), sized for ``x`` and ``w``
    (shapes as the op takes them) or ``nbytes`` per rank. Pass it as ``context=``; close() it.
    """
    comm = default_comm(group, backend=backend, op=op)
    validate(op, x, w, group=group, backend=comm.backend, chunks=None)
    be = backends.backend_for(comm, x.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    need = be.workspace(op, x2.shape[0], x2.shape[1], w.shape[1], comm.world, x.dtype)
    if need is None:
        raise ValueError(f"{op}: make_context needs a workspace backend ('symmetric' or "
                         f"'triton') on more than one rank, got {backend!r} -> "
                         f"{comm.backend!r}{comm.where()}")
    return TPContext(op=op, backend=be.name, group=group, nbytes=nbytes or need[0],
                     num_signals=need[1], device=x.device, timeout=timeout)


def close_all_contexts() -> None:
    """Close and forget every default communicator (the ``group=`` form's workspaces) of this
    process; call it on every rank at teardown. Explicit TPComm objects are closed by their
    owners."""
    close_default_comms()
