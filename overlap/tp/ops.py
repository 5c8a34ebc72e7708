"""Fused tensor-parallel collective matmuls: the collective runs chunk by chunk under the GEMM.

    all_gather_matmul(x_shard, w, *, comm)       y       = all_gather(x_shard) @ w
    matmul_reduce_scatter(x, w, *, comm)         y_shard = reduce_scatter(x @ w)
    matmul_all_reduce(x, w, *, comm)             y       = all_reduce(x @ w)

Shape legend (``world`` ranks; every rank passes the same shapes): M rows of the full
activation, m = M / world rows of a shard, K input features, N output features of this rank's
``w`` [K, N] (an nn.Linear passes ``weight.t()``). 3-D activations are sequence-first
[S, B, K] and are gathered/scattered along S (``seq_dim=1``: batch-first [B, S, K]).

Contract: local checks before any communication (ValueError/TypeError naming op, argument, rank);
every call carries a stamp compared by every peer (overlap.tp.stamps); any error fails the comm
(later calls raise TPCommFailed); fp32 results equal the unfused product within 1e-5 relative.
The narrative: docs/design/tp.md (the op's shape: docs/design/engine.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.symm.workspace import PeerDied, group_name
from overlap.tp import backends
from overlap.tp.checks import check_across_ranks, signature, validate
from overlap.tp.comm import TPComm, TPCommFailed, default_comm
from overlap.versions import HAVE_OPAQUE, compile_problem

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "call_op",
           "define_op"]


def _run(op: str, comm: TPComm, body, x: torch.Tensor | None = None,
         w: torch.Tensor | None = None, chunks: int = 0, flags: int = 0, *,
         start: tuple | None = None, layer_w: torch.Tensor | None = None):
    """Run ``body(backend, context, chunks)``; any error fails the communicator (peers blocked
    on us raise now). With ``x`` (the backend's 2-D input) and ``w`` the call picks its chunks
    (the call's own, the communicator's, or its ``"auto"`` race's; overlap.tp.autochunk) and
    is counted and stamped first (overlap.tp.stamps), so ranks that disagree on it raise
    before anything else. ``start`` = (check, x_shape, flags): a forward call, validated
    (once per signature: the local checks are a function of it) and, on the communicator's
    first call, compared across ranks by name. ``layer_w``: for a call with no GEMM (the
    backward's plain gather/scatter), the layer's weight whose shape its stamp carries, so
    two layers' backwards run in other orders on other ranks disagree there too."""
    if comm.closed or comm.failed is not None:
        comm.check_usable(op)
    try:
        if start is not None:
            _validate(op, comm, x, w, chunks, *start)
        race = timer = context = None
        backend = backends.backend_for(comm)
        if x is not None:
            if w is not None:
                chunks, race, timer = comm.pick_chunks(op, chunks, x, w)
            comm.stamp(op, x, w if w is not None else layer_w, chunks, flags)
            if w is not None:  # after the stamp: creating one settles it first (collective)
                context = backends.context_for(comm, backend, op, x, w, chunks)
        out = body(backend, context, chunks)
        comm.settle()  # a no-op once the backend has settled (before poisoning)
        if race is not None:
            comm.auto.finish(race, chunks, timer)
        return out
    except TPCommFailed:
        raise
    except BaseException as exc:
        _name_the_op(exc, op, comm)
        comm.fail(exc)
        raise


def _validate(op: str, comm: TPComm, x2: torch.Tensor, w: torch.Tensor, chunks: int,
              check: bool, x_shape: list[int], flags: int) -> None:
    """The local checks of a forward call (its original shape ``x_shape``, sequence-first),
    run once per signature; the named all-gather on the communicator's first call only: every
    rank reaches it alike, so no rank runs a collective its peers skip. Stamps compare every
    call after it."""
    key = (op, *x_shape, w.shape, x2.dtype, w.dtype, x2.device, w.device, chunks)
    if key not in comm.validated:
        xs = x2.view(x_shape)
        validate(op, xs, w, group=comm.group, backend=comm.backend, chunks=chunks or None)
        comm.remember_valid(key)
    if check and comm.world > 1 and comm.first_call():
        xs = x2.view(x_shape)
        check_across_ranks(op, signature(op, comm.backend, xs, w, chunks or None, flags),
                           group=comm.group, device=x2.device)


def _name_the_op(exc: BaseException, op: str, comm: TPComm) -> None:
    """Prefix a transport error (same type, so callers' handlers still match) with the op,
    the backend, this rank, the group and what kind of failure it was."""
    text = str(exc)
    if not exc.args or not isinstance(exc.args[0], str) or op in text:
        return
    kind = ("peer aborted" if "aborted" in text else
            "peer died" if isinstance(exc, PeerDied) or "exited" in text else
            "timed out" if isinstance(exc, TimeoutError) else "failed")
    exc.args = (f"{op} ({comm.backend}){comm.where} {kind}: {text}", *exc.args[1:])


def _empty(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(0)


# ---------------------------------------------------------------- the implementations

def _ag_forward(x2: torch.Tensor, w: torch.Tensor, comm: TPComm, chunks: int, check: bool,
                x_shape: list[int], flags: int, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``keep``: the gathered input is returned or saved for dw; otherwise the second output is
    empty and the backend skips assembling it (a copy of the own shard, per call)."""
    y, gathered = _ag_run(x2, w, comm, chunks, check, x_shape, flags, keep)
    return y, (gathered if keep else _empty(x2))


def _ag_run(x2: torch.Tensor, w: torch.Tensor, comm: TPComm, chunks: int, check: bool,
            x_shape: list[int], flags: int, keep: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_ag_forward, with None for a gathered input not kept: what the public function calls
    when autograd does not record the call and nothing reads that output."""
    op = "all_gather_matmul"
    y, gathered = _run(op, comm, lambda backend, context, n: backend.all_gather_matmul(
        comm, context, x2, w, chunks=n, return_gathered=keep), x2, w, chunks, 1,
        start=(check, x_shape, flags))
    if not keep:
        return y, None
    return y, (gathered.clone() if gathered is x2 else gathered)  # no output aliases an input


def _ag_backward(dy: torch.Tensor, gathered: torch.Tensor | None, w: torch.Tensor,
                 dgathered: torch.Tensor | None, comm: TPComm, chunks: int, need_dx: bool,
                 need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dx_shard = reduce_scatter(dy @ w.T) (+ reduce_scatter(dgathered)); dw = gathered.T @ dy,
    computed while the dgrad's last transfers are in flight (``gathered`` is saved only when
    w needs a gradient)."""
    dx = dw = None
    if need_dw and not need_dx:
        dw = gathered.t() @ dy
    if need_dx:
        def wgrad() -> None:
            nonlocal dw
            dw = gathered.t() @ dy
        op, wt = "matmul_reduce_scatter", w.t()
        dx = _run(op, comm, lambda backend, context, n: backend.matmul_reduce_scatter(
            comm, context, dy, wt, chunks=n, overlap_with=wgrad if need_dw else None),
            dy, wt, chunks)
        if need_dw and dw is None:  # a backend that ran its GEMMs without calling back
            wgrad()
        if dgathered is not None:
            extra = _run("reduce_scatter (tp backward)", comm,
                         lambda *_: backends.scatter(comm, dgathered), dgathered, None, chunks,
                         layer_w=wt)
            dx = dx + extra
    return (dx if dx is not None else _empty(dy)), (dw if dw is not None else _empty(w))


def _rs_forward(x2: torch.Tensor, w: torch.Tensor, comm: TPComm, chunks: int, check: bool,
                x_shape: list[int], flags: int) -> torch.Tensor:
    op = "matmul_reduce_scatter"
    return _run(op, comm, lambda backend, context, n: backend.matmul_reduce_scatter(
        comm, context, x2, w, chunks=n, overlap_with=None), x2, w, chunks,
        start=(check, x_shape, flags))


def _rs_backward(dy_shard: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, comm: TPComm,
                 chunks: int, need_dx: bool, need_dw: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = all_gather(dy_shard) @ w.T (fused); dw = x.T @ all_gather(dy_shard) (reused)."""
    dx = dy = None
    if need_dx:
        op, wt = "all_gather_matmul", w.t()
        dx, dy = _run(op, comm, lambda backend, context, n: backend.all_gather_matmul(
            comm, context, dy_shard, wt, chunks=n, return_gathered=need_dw),
            dy_shard, wt, chunks, int(need_dw))
    elif need_dw:
        dy = _run("all_gather (tp backward)", comm, lambda *_: backends.gather(comm, dy_shard),
                  dy_shard, None, chunks, layer_w=w)
    dw = x2.t() @ dy if need_dw else None
    return (dx if dx is not None else _empty(dy_shard)), (dw if dw is not None else _empty(w))


def _ar_forward(x2: torch.Tensor, w: torch.Tensor, comm: TPComm, chunks: int, check: bool,
                x_shape: list[int], flags: int) -> torch.Tensor:
    op = "matmul_all_reduce"
    return _run(op, comm, lambda backend, context, n: backend.matmul_all_reduce(
        comm, context, x2, w, chunks=n), x2, w, chunks, start=(check, x_shape, flags))


# ---------------------------------------------------------------- the same, as custom ops

def _grown(rows: int, comm: TPComm) -> int:
    return rows * comm.world


def define_op(name: str, fn, fake) -> None:
    if not HAVE_OPAQUE:  # the schema needs the communicator as an opaque type (torch >= 2.11)
        return
    op = torch.library.custom_op(f"overlap::{name}", fn, mutates_args=())
    op.register_fake(fake)


define_op("all_gather_matmul", _ag_forward,
          lambda x2, w, comm, chunks, check, x_shape, flags, keep: (
              x2.new_empty(_grown(x2.shape[0], comm), w.shape[1]),
              x2.new_empty(_grown(x2.shape[0], comm), x2.shape[1]) if keep else _empty(x2)))
define_op("all_gather_matmul_backward", _ag_backward,
          lambda dy, g, w, dg, comm, chunks, need_dx, need_dw: (
              dy.new_empty(dy.shape[0] // comm.world, w.shape[0]) if need_dx else dy.new_empty(0),
              w.new_empty(w.shape) if need_dw else w.new_empty(0)))
define_op("matmul_reduce_scatter", _rs_forward,
          lambda x2, w, comm, chunks, check, x_shape, flags:
          x2.new_empty(x2.shape[0] // comm.world, w.shape[1]))
define_op("matmul_reduce_scatter_backward", _rs_backward,
          lambda dy, x2, w, comm, chunks, need_dx, need_dw: (
              dy.new_empty(dy.shape[0] * comm.world, w.shape[0]) if need_dx
              else dy.new_empty(0), w.new_empty(w.shape) if need_dw else w.new_empty(0)))
define_op("matmul_all_reduce", _ar_forward, lambda x2, w, comm, chunks, check, x_shape, flags:
          x2.new_empty(x2.shape[0], w.shape[1]))


def call_op(name: str, fn, *args):
    """Run implementation ``fn``: directly in eager, through its custom op ``name`` (the
    same function behind the dispatcher, opaque to the tracer) while torch.compile traces.
    This picks an entry point, not an implementation: there is one of each op."""
    if torch.compiler.is_compiling():
        if not HAVE_OPAQUE:
            raise RuntimeError(compile_problem(name))
        return getattr(torch.ops.overlap, name)(*args)
    return fn(*args)


# ---------------------------------------------------------------- autograd: one backward each

class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, comm, chunks, check, x_shape, flags):
        ctx.set_materialize_grads(False)
        y, gathered = call_op("all_gather_matmul", _ag_forward, x2, w, comm, chunks, check,
                              x_shape, flags, bool(flags) or ctx.needs_input_grad[1])
        ctx.comm, ctx.chunks, ctx.used_gathered = comm, chunks, bool(flags)
        ctx.save_for_backward(gathered if ctx.needs_input_grad[1] else None, w)
        return y, gathered

    @staticmethod
    def backward(ctx, dy, dgathered):
        gathered, w = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if dy is None:  # only the gathered output was used
            dy = torch.zeros(dgathered.shape[0], w.shape[1], dtype=w.dtype, device=w.device)
        dx, dw = call_op("all_gather_matmul_backward", _ag_backward, dy.contiguous(), gathered, w,
                       dgathered if ctx.used_gathered else None, ctx.comm, ctx.chunks,
                       need_dx, need_dw)
        return ((dx if need_dx else None), (dw if need_dw else None),
                None, None, None, None, None)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, comm, chunks, check, x_shape, flags):
        ctx.comm, ctx.chunks = comm, chunks
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, w)
        return call_op("matmul_reduce_scatter", _rs_forward, x2, w, comm, chunks, check,
                       x_shape, flags)

    @staticmethod
    def backward(ctx, dy_shard):
        x2, w = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = call_op("matmul_reduce_scatter_backward", _rs_backward, dy_shard.contiguous(),
                         x2 if need_dw else w.new_empty(0), w, ctx.comm, ctx.chunks, need_dx,
                         need_dw)
        return ((dx if need_dx else None), (dw if need_dw else None),
                None, None, None, None, None)


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, comm, chunks, check, x_shape, flags):
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, w)
        return call_op("matmul_all_reduce", _ar_forward, x2, w, comm, chunks, check, x_shape, flags)

    @staticmethod
    def backward(ctx, dy):
        # No communication: dy is the same on every rank, as everything after y is replicated.
        x2, w = ctx.saved_tensors
        dx = dy @ w.t() if ctx.needs_input_grad[0] else None
        dw = x2.t() @ dy if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None


# ---------------------------------------------------------------- the public functions

def _dispatch(op: str, function, forward, x, w, comm, group, backend: str, chunks,
              check_inputs: bool, seq_dim: int, flags: int, *extra):
    """The public functions' common part: the communicator, ``x`` sequence-first and 2-D,
    then the op through its autograd Function, or, when autograd does not record the call
    (no grad mode, no input requiring grad), its forward alone (with ``extra``, the
    arguments the Function derives from what autograd needs): the same implementation, a
    few microseconds less. Returns (comm, x sequence-first, the op's outputs)."""
    if type(comm) is TPComm and group is None:  # the common case, checks and all
        c = comm
    else:
        c = _comm_for(op, comm, group, backend)
    if seq_dim == 0 and isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim():
        xs = x  # what _sequence_first passes unchanged
    else:
        xs = _sequence_first(op, c, x, w, seq_dim)
    n, check = _settings(c, comm is not None, chunks, check_inputs)
    x2 = xs if xs.dim() == 2 else xs.reshape(-1, xs.shape[-1])
    args = (x2, w, c, n, check, list(xs.shape), flags)
    if torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad):
        return c, xs, function.apply(*args)
    return c, xs, call_op(op, forward, *args, *extra)


def _comm_for(op: str, comm, group, backend: str) -> TPComm:
    if comm is not None:
        if not isinstance(comm, TPComm):
            raise TypeError(f"{op}: comm must be a TPComm, got {type(comm).__name__}")
        if group is not None and group is not comm.group:
            raise ValueError(f"{op}: pass comm= or group=, not both (comm is on group "
                             f"{group_name(comm.group)}, group= is {group_name(group)})")
        return comm
    if isinstance(group, dist.ProcessGroup) and torch.compiler.is_compiling():
        # torch.compile cannot make a communicator (an opaque object) while it traces: the
        # lookup runs once, outside the graph, and the graph keeps its result as a constant.
        return _default_comm_traced(group.group_name, backend, op)
    return default_comm(group, backend=backend, op=op)


def _default_comm_traced(group_name: str, backend: str, op: str) -> TPComm:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return default_comm(_resolve_process_group(group_name), backend=backend, op=op)


# What torch.compiler.assume_constant_result sets (calling it would import torch._dynamo,
# 1.5 s, on every ``import overlap``); tests/test_tp_compile.py fails if it stops working.
_default_comm_traced._dynamo_marked_constant = True


def _sequence_first(op: str, comm: TPComm, x, w, seq_dim: int) -> torch.Tensor:
    """``x`` sequence-first, after the checks a reshape needs (the rest run in _validate). A
    refused call fails the communicator, as every error of an op does."""
    try:
        _check_reshapable(op, comm, x, w, seq_dim)
    except (TypeError, ValueError) as exc:
        comm.fail(exc)
        raise
    return x.transpose(0, 1) if seq_dim == 1 else x


def _check_reshapable(op: str, comm: TPComm, x, w, seq_dim: int) -> None:
    xname = "x_shard" if op == "all_gather_matmul" else "x"
    for name, t in ((xname, x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got "
                            f"{type(t).__name__}{comm.where}")
    if seq_dim not in (0, 1) or (seq_dim == 1 and x.dim() != 3):
        raise ValueError(f"{op}: seq_dim must be 0, or 1 for a batch-first 3-D [B, S, K] input, "
                         f"got seq_dim={seq_dim!r} for shape {tuple(x.shape)}{comm.where}")
    if x.dim() == 0:
        raise ValueError(f"{op}: {xname} must be 2-D [M, K] or 3-D sequence-first [S, B, K], "
                         f"got a 0-d tensor{comm.where}")


def _settings(comm: TPComm, comm_given: bool, chunks, check_inputs: bool) -> tuple[int, bool]:
    # comm= carries the settings; the group= form's per-call knobs apply to this call.
    return (chunks if chunks is not None else 0), (comm.check_inputs if comm_given
                                                   else bool(check_inputs))


def all_gather_matmul(x_shard: torch.Tensor, w: torch.Tensor, *, comm: TPComm | None = None,
                      group: dist.ProcessGroup | None = None, backend: str = "auto",
                      chunks: int | None = None, return_gathered: bool = False,
                      check_inputs: bool = True, seq_dim: int = 0):
    """Sequence-parallel column-parallel GEMM with the all-gather hidden under it.

    x_shard [m, K] or [s, B, K], w [K, N] -> y [M, N] or [world*s, B, N]; with
    ``return_gathered`` also the gathered input [M, K] (its gradient flows back).

        forward  y        = all_gather(x_shard) @ w
        dgrad    dx_shard = reduce_scatter(dy @ w.T) (+ reduce_scatter(d_gathered))
        wgrad    dw       = gathered.T @ dy     (under dgrad's last transfers)

    ``chunks``: pieces along M, a multiple of world (default world). ``comm=`` a TPComm, or
    ``group=`` (with ``backend``, ``check_inputs``) for that group's default communicator.
    Returns y, or (y, gathered) with ``return_gathered``.
    """
    c, xs, (y2, g2) = _dispatch("all_gather_matmul", _AllGatherMatmul, _ag_run, x_shard, w,
                                comm, group, backend, chunks, check_inputs, seq_dim,
                                int(return_gathered), bool(return_gathered))
    if xs.dim() == 2 and not return_gathered:
        return y2
    lead = (c.world * xs.shape[0], *xs.shape[1:-1])
    y = y2.view(*lead, w.shape[-1])
    if seq_dim == 1:
        y = y.transpose(0, 1)
    if not return_gathered:
        return y
    g = g2.view(*lead, xs.shape[-1])
    return y, (g.transpose(0, 1) if seq_dim == 1 else g)


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, *, comm: TPComm | None = None,
                          group: dist.ProcessGroup | None = None, backend: str = "auto",
                          chunks: int | None = None, check_inputs: bool = True,
                          seq_dim: int = 0) -> torch.Tensor:
    """Row-parallel GEMM with sequence parallelism: the reduce-scatter hidden under the GEMM.

    x [M, K] or [S, B, K] (S divisible by world), w [K, N] -> y_shard [M/world, N] or
    [S/world, B, N]: rows r*m..(r+1)*m of the sum over ranks.

        forward  y_shard = reduce_scatter(x @ w)
        dgrad    dx      = all_gather(dy_shard) @ w.T     (all_gather_matmul, fused)
        wgrad    dw      = x.T @ all_gather(dy_shard)     (reuses dgrad's gathered dy)

    ``chunks``, ``comm``/``group``: as in all_gather_matmul.
    """
    c, xs, y2 = _dispatch("matmul_reduce_scatter", _MatmulReduceScatter, _rs_forward, x, w,
                          comm, group, backend, chunks, check_inputs, seq_dim, 0)
    if xs.dim() == 2:
        return y2
    y = y2.view(xs.shape[0] // c.world, *xs.shape[1:-1], w.shape[-1])
    return y.transpose(0, 1) if seq_dim == 1 else y


def matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, *, comm: TPComm | None = None,
                      group: dist.ProcessGroup | None = None, backend: str = "auto",
                      chunks: int | None = None, check_inputs: bool = True) -> torch.Tensor:
    """Row-parallel GEMM without sequence parallelism: the all-reduce hidden under the GEMM.

    x [M, K] or [S, B, K], w [K, N] -> y [M, N] or [S, B, N], identical on every rank.

        forward  y  = all_reduce(x @ w)
        dgrad    dx = dy @ w.T      (no communication: dy is replicated, as everything
        wgrad    dw = x.T @ dy       after y is)

    ``chunks``: row blocks of M (default world); any M works. ``comm``/``group``: as above.
    """
    _, xs, y2 = _dispatch("matmul_all_reduce", _MatmulAllReduce, _ar_forward, x, w, comm,
                          group, backend, chunks, check_inputs, 0, 0)
    if xs.dim() == 2:
        return y2
    return y2.view(*xs.shape[:-1], w.shape[-1])
