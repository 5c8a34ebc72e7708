"""Quantized collectives: all-reduce, reduce-scatter and all-gather with INT8 (blockwise) or BF16
on the wire, each taking an explicit ``group``.

    all_reduce(t, *, group, comm_dtype="fp32", op="sum", block_size=128, ...) -> t (in place)
    reduce_scatter(t, *, group, ...)   t [n*m0, *rest] -> this rank's reduced [m0, *rest]
    all_gather(t, *, group, ...)       t [m0, *rest]   -> [n*m0, *rest], rank-major

``comm_dtype``: "fp32" (the plain collective), "bf16" or "int8"; sums run in fp32; ``op``: "sum"
or "avg". The result has t's dtype, is identical on every rank and, for INT8, errs per element
by at most about S/127 (S = the sum of the ranks' block absmax). ``async_op=True`` returns a
``QuantWork``: do not modify ``t`` before ``wait()``; ``wait()`` or ``drain(group)`` before a
plain torch.distributed call on the group. Ranks that disagree on a call raise ``Disagreement``
(a ValueError) on every rank. Any error fails the group: later calls raise ``QuantCommFailed``;
waits raise ``QuantCommError`` naming a failed peer, or ``QuantTimeout`` after ``timeout`` (300 s).
The narrative: docs/design/quantized.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.comm.quant import checks, paths, stamps
from overlap.comm.quant.checks import COMM_DTYPES
from overlap.comm.quant.feedback import ErrorFeedback
from overlap.comm.quant.state import (GroupState, QuantCommError, QuantCommFailed, QuantTimeout,
                                      state_for)
from overlap.comm.quant.work import OpRun, QuantWork, drain, submit
from overlap.defaults import TIMEOUT_S
from overlap.dist.stamp import Disagreement

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "ErrorFeedback", "QuantWork", "drain",
           "DEFAULT_BLOCK_SIZE", "COMM_DTYPES", "wire_bytes",
           "QuantCommError", "QuantCommFailed", "QuantTimeout", "Disagreement"]

# 128: relative RMS error of a 4-rank INT8 all-reduce of N(0,1) data 0.9e-2 (64: 0.8e-2,
# 256: 1.0e-2) for 1 + 4/128 = 1.031 bytes per element (64: 1.062 -> 0.266x fp32, too close to
# the 0.27x budget once shards are padded; 256: 1.016). bench/results/quant.md has the sweep.
DEFAULT_BLOCK_SIZE = 128
wire_bytes = paths.wire_bytes


def _state(opname: str, group) -> GroupState:
    if group is None:
        raise TypeError(f"{opname}: group must be a ProcessGroup (pass dist.group.WORLD for "
                        "the default group explicitly), got None")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{opname}: this process (global rank {dist.get_rank()}) is not a "
                         "member of the group")
    return state_for(group)


def _launch(opname, state, group, t, body, *, async_op, check_ranks, comm_dtype, op, block_size,
            timeout, tag, feedback=None):
    device = t.device
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 2**62:
        raise TypeError(f"{opname}: tag must be an int in [0, 2**62), got {tag!r} (rank "
                        f"{state.rank})")
    key = (opname, t.numel(), t.dim(), t.shape[0] if t.dim() else 1, t.dtype, comm_dtype, op,
           block_size, tag)

    def checked_body():
        run = OpRun(state, group, opname, timeout, device)
        if state.world > 1:
            # Every call counts itself and carries its stamp in the data it exchanges (paths);
            # the layout is built once per key, a call only copies it and sets its number.
            agree = stamps.agreement(state, device)
            first = agree.calls == 0
            run.agree = agree
            run.stamp = agree.next(opname, key=key, make=lambda: stamps.values(
                t, comm_dtype, op, block_size, tag))
            # The named check: on the group's first call only, which every rank reaches in the
            # same state (a per-shape cache let one rank run it while its peer ran the op).
            if first and check_ranks:
                paths.exchange_stamps(run, what="the cross-rank check's all_gather",
                                      named=True)
            elif state.plain_gloo:
                # Sizes agreed before the data moves: gloo kills a process whose receive is
                # smaller than the message that lands (88 bytes per rank, one all-gather).
                paths.exchange_stamps(run, what="the sizes' agreement all_gather")
        return body(run)

    given = (t,) if feedback is None else (t, *(r for r in (
        feedback.residual, feedback.shard_residual) if r is not None))
    return submit(opname, state, checked_body, async_op=async_op, device=device, timeout=timeout,
                  tensors=given)


def all_reduce(t: torch.Tensor, *, group, comm_dtype: str = "fp32", op: str = "sum",
               block_size: int = DEFAULT_BLOCK_SIZE, stochastic: bool = False, seed: int = 0,
               error_feedback: ErrorFeedback | None = None, check_ranks: bool = True,
               async_op: bool = False, impl: str = "auto",
               timeout: float = TIMEOUT_S, tag: int = 0) -> torch.Tensor | QuantWork:
    """All-reduce ``t`` (contiguous, any shape) in place: t = sum_r t_r (or the mean).

    ``stochastic``/``seed``: stochastic rounding for INT8, with noise keyed by (seed, rank,
    phase): pass a new seed each step. ``error_feedback``: carries the quantization residual to
    the next call. ``check_ranks``: on the group's first call, compare every rank's call
    (numel, dim, rows, dtype, comm_dtype, op, block_size) with one small all-gather of stamps
    before the op runs, so a first call whose sizes differ raises naming both ranks' calls even
    on a transport that cannot refuse sizes (NCCL hangs on them). With or without it, every
    call carries a stamp of itself (op, the group's call number, the same fields) in the data
    it exchanges anyway (``stamps``, ``paths``) and compares its peers' before using the
    result: so ``check_ranks=False`` still guarantees that a call that differs between ranks in
    any of those fields, or a rank that skipped a call, raises ``Disagreement`` on every rank
    naming the op, the call and both ranks' values, and never returns numbers; sizes that
    differ are refused by the transport on every rank (nccl_twin; on NCCL they hang until its
    watchdog) and raise naming the op and the calls. It adds no collective, no host sync,
    except on plain gloo, which kills a process whose receive is too small: there every call
    all-gathers its stamp alone (88 bytes per rank) before the data moves.
    ``impl``: which INT8 kernels ("auto": C++ on CPU, Triton on GPU; "torch", "triton").
    ``timeout``: seconds each wait may take. ``tag``: an int in [0, 2**62) every rank must
    pass alike, carried in the stamp (a caller's own signature of the call: GradReducer passes
    one of the bucket's parameters, so a same-size bucket holding other parameters on one rank
    is caught). Returns ``t``, or with ``async_op`` a QuantWork
    whose ``wait()`` returns ``t``."""
    opname = "quant.all_reduce"
    state = _state(opname, group)
    with state.guard(opname):
        state.check_usable(opname)
        comm_dtype, op, timeout = _common(opname, state, comm_dtype, op, timeout)
        checks.validate(opname, state.rank, t, comm_dtype, op, block_size, error_feedback,
                        needs_contiguous=True, impl=impl)
        n = state.world
        divisor = float(n) if op == "avg" else 1.0

        def body(run):
            x = t.view(-1)
            if n == 1:
                return t
            if x.numel() == 0:
                paths.exchange_stamps(run)  # a peer with data must not wait for this rank
                return t
            if comm_dtype == "int8":
                paths.int8_all_reduce(x, run, state.rank, n, divisor, block_size, stochastic,
                                      seed, error_feedback, impl)
            elif comm_dtype == "bf16":
                paths.bf16_all_reduce(x, run, state.rank, n, divisor, error_feedback)
            else:
                paths.plain_all_reduce(t, run, op == "avg")
            return t

        return _launch(opname, state, group, t, body, async_op=async_op,
                       check_ranks=check_ranks, comm_dtype=comm_dtype, op=op,
                       block_size=block_size, timeout=timeout, tag=tag,
                       feedback=error_feedback)


def reduce_scatter(t: torch.Tensor, *, group, comm_dtype: str = "fp32", op: str = "sum",
                   block_size: int = DEFAULT_BLOCK_SIZE, stochastic: bool = False, seed: int = 0,
                   error_feedback: ErrorFeedback | None = None, check_ranks: bool = True,
                   async_op: bool = False, impl: str = "auto",
                   timeout: float = TIMEOUT_S, tag: int = 0) -> torch.Tensor | QuantWork:
    """Reduce ``t`` [n*m0, *rest] over the group and return this rank's slice [m0, *rest] of
    the sum (or mean): out_shard_r = sum_k t_k[r*m0 : (r+1)*m0]. Options as in ``all_reduce``."""
    opname = "quant.reduce_scatter"
    state = _state(opname, group)
    with state.guard(opname):
        state.check_usable(opname)
        comm_dtype, op, timeout = _common(opname, state, comm_dtype, op, timeout)
        checks.validate(opname, state.rank, t, comm_dtype, op, block_size, error_feedback,
                        needs_contiguous=False, impl=impl)
        n = state.world
        if t.dim() == 0 or t.shape[0] % n:
            raise ValueError(f"{opname}: rank {state.rank}: t.shape[0] must be divisible by "
                             f"the group size {n}, got shape {tuple(t.shape)}")
        divisor = float(n) if op == "avg" else 1.0
        out_shape = (t.shape[0] // n, *t.shape[1:])

        def body(run):
            x = t.reshape(-1).contiguous()
            if n == 1:
                return t.clone().view(out_shape)
            if x.numel() == 0:
                paths.exchange_stamps(run)  # a peer with data must not wait for this rank
                return t.clone().view(out_shape)
            if comm_dtype == "int8":
                out = paths.int8_reduce_scatter(x, run, state.rank, n, divisor, block_size,
                                                stochastic, seed, error_feedback, impl)
            elif comm_dtype == "bf16":
                out = paths.bf16_reduce_scatter(x, run, state.rank, n, divisor, error_feedback)
            else:
                out = paths.plain_reduce_scatter(x, run, n, op == "avg")
            return out.to(t.dtype).view(out_shape)

        return _launch(opname, state, group, t, body, async_op=async_op,
                       check_ranks=check_ranks, comm_dtype=comm_dtype, op=op,
                       block_size=block_size, timeout=timeout, tag=tag,
                       feedback=error_feedback)


def all_gather(t: torch.Tensor, *, group, comm_dtype: str = "fp32",
               block_size: int = DEFAULT_BLOCK_SIZE, stochastic: bool = False, seed: int = 0,
               check_ranks: bool = True, async_op: bool = False, impl: str = "auto",
               timeout: float = TIMEOUT_S, tag: int = 0) -> torch.Tensor | QuantWork:
    """Gather ``t`` [m0, *rest] from every rank into [n*m0, *rest] (rank r's at rows
    r*m0 : (r+1)*m0). With a lossy ``comm_dtype`` every rank's part, its own included, is the
    dequantized one, so all ranks hold the same result. Options as in ``all_reduce``."""
    opname = "quant.all_gather"
    state = _state(opname, group)
    with state.guard(opname):
        state.check_usable(opname)
        comm_dtype, _, timeout = _common(opname, state, comm_dtype, "sum", timeout)
        checks.validate(opname, state.rank, t, comm_dtype, "sum", block_size, None,
                        needs_contiguous=False, impl=impl)
        if t.dim() == 0:
            raise ValueError(f"{opname}: rank {state.rank}: t must have at least one dim "
                             "(gathered along dim 0)")
        n = state.world
        out_shape = (n * t.shape[0], *t.shape[1:])

        def body(run):
            x = t.reshape(-1).contiguous()
            if n == 1:
                return t.clone().view(out_shape)
            if x.numel() == 0:
                paths.exchange_stamps(run)  # a peer with data must not wait for this rank
                return t.clone().view(out_shape)
            if comm_dtype == "int8":
                out = paths.int8_all_gather(x, run, state.rank, n, block_size, stochastic, seed,
                                            impl)
            elif comm_dtype == "bf16":
                out = paths.bf16_all_gather(x, run, n)
            else:
                out = paths.plain_all_gather(x, run, n)
            return out.to(t.dtype).view(out_shape)

        return _launch(opname, state, group, t, body, async_op=async_op,
                       check_ranks=check_ranks, comm_dtype=comm_dtype, op="sum",
                       block_size=block_size, timeout=timeout, tag=tag)


def _common(opname: str, state: GroupState, comm_dtype, op, timeout) -> tuple[str, str, float]:
    # stacklevel 3: a deprecation warning points at the caller of all_reduce & co.
    return (checks.comm_dtype_arg(comm_dtype, where=opname, rank=state.rank),
            checks.op_name(op), checks.timeout_arg(timeout, where=opname, rank=state.rank))
