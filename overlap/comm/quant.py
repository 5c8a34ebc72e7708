"""Quantized collectives: all-reduce, reduce-scatter and all-gather with INT8 (blockwise) or BF16
on the wire, each taking an explicit ``group``.

    all_reduce(t, *, group, comm_dtype=None, op="sum", block_size=128, ...)  -> t (in place)
    reduce_scatter(t, *, group, ...)   t [n*m0, *rest] -> this rank's reduced [m0, *rest]
    all_gather(t, *, group, ...)       t [m0, *rest]   -> [n*m0, *rest], rank-major

``comm_dtype``: None (the plain collective in t's dtype), "bf16" (cast for the wire, sum in
fp32) or "int8" (symmetric per-block scales in fp32, round-to-nearest-even or stochastic;
dequantize and sum in fp32, never in int8). Inputs fp32/bf16/fp16 (any dtype for None); the
result has the input's dtype and is identical on every rank. A group of one rank returns the
input exactly (nothing to send, so nothing is quantized). ``op``: "sum" or "avg" (or dist.ReduceOp.SUM / AVG). With
``async_op=True`` each returns a ``QuantWork`` whose ``wait()`` returns the result; ops on one
group run in call order, and a plain ``torch.distributed`` call on that group must wait for
them (``wait()`` or ``drain(group)``; see ``quant_work``). Do not modify ``t`` before ``wait()``. The phases
and wire sizes are in ``quant_paths``.

INT8 accuracy (derived in the README's "Quantized collectives" section). With M_r the absmax of
block b of rank r's input (as fp32), S = sum_r M_r, and Q(M) = M/254 + M*2^-21 + 2^-143 the
error of one quantization of a block with absmax M, every element i of block b satisfies

    all_gather:      |out_i - x_i|          <= Q(M_r)
    reduce_scatter:  |out_i - sum_r x_r,i|  <= sum_r Q(M_r) + n*2^-23*S
    all_reduce:      |out_i - sum_r x_r,i|  <= sum_r Q(M_r) + n*2^-23*S
                                                + Q(S*(1 + 2^-7) + n*2^-142)
                                             ~= S/127   (two quantizations of ~S/254 each)

divided by n for "avg" (plus 2^-23*S/n + 2^-142), plus the rounding of the result to t's dtype
(2^-8 relative for bf16, 2^-11 for fp16). Stochastic rounding: 2Q in place of Q. Non-finite inputs come back as NaN for those elements
only (code -128); a sum that overflows fp32 comes back NaN (all-reduce) or Inf (reduce-scatter).
An all-zero block is exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.comm import quant_kernels as qk
from overlap.comm import quant_paths as paths
from overlap.comm.quant_work import QuantWork, drain, submit

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "ErrorFeedback", "QuantWork", "drain",
           "DEFAULT_BLOCK_SIZE", "COMM_DTYPES", "wire_bytes"]

# 128: relative RMS error of a 4-rank INT8 all-reduce of N(0,1) data 0.9e-2 (64: 0.8e-2,
# 256: 1.0e-2) for 1 + 4/128 = 1.031 bytes per element (64: 1.062 -> 0.266x fp32, too close to
# the 0.27x budget once shards are padded; 256: 1.016). bench/results/quant.md has the sweep.
DEFAULT_BLOCK_SIZE = 128
COMM_DTYPES = (None, "bf16", "int8")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OPS = ("sum", "avg")
wire_bytes = paths.wire_bytes


class ErrorFeedback:
    """Error feedback for a gradient sent with a lossy ``comm_dtype`` ("int8" or "bf16").

    Each call sends p = g + e (e: this rank's residual) and keeps e' = p - deq(q(p)); the owner
    of an all-reduce shard likewise adds f to the reduced shard y before requantizing and keeps
    f' = (y + f) - deq(q(y + f)). Summed over steps the errors telescope:
    sum_t result_t = sum_t exact_t - (sum_r e_r + f)  (last residuals), so the accumulated sum
    stays within one quantization step of the exact accumulated sum instead of drifting.
    One instance per tensor (bucket) and per rank; ``numel`` is the tensor's element count.
    """

    def __init__(self, numel: int, *, device: torch.device | str = "cpu"):
        if numel < 0:
            raise ValueError(f"ErrorFeedback: numel must be >= 0, got {numel}")
        self.numel = numel
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        self.shard_residual: torch.Tensor | None = None

    def shard_residual_for(self, length: int) -> torch.Tensor:
        if self.shard_residual is None:
            self.shard_residual = torch.zeros(length, dtype=torch.float32,
                                              device=self.residual.device)
        elif self.shard_residual.numel() != length:
            raise ValueError(f"ErrorFeedback: this instance carries a shard residual of "
                             f"{self.shard_residual.numel()} elements, the call needs {length} "
                             "(same tensor with another group size or block size?)")
        return self.shard_residual

    def reset(self) -> None:
        self.residual.zero_()
        self.shard_residual = None


def _rank_and_size(opname: str, group) -> tuple[int, int]:
    if group is None:
        raise TypeError(f"{opname}: group must be a ProcessGroup (pass dist.group.WORLD for "
                        "the default group explicitly), got None")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{opname}: this process (global rank {dist.get_rank()}) is not a "
                         "member of the group")
    return rank, dist.get_world_size(group)


def _op_name(op) -> str:
    """"sum" / "avg", also accepting dist.ReduceOp.SUM / AVG."""
    if isinstance(op, str):
        return op
    for name, red in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        if op == red:
            return name
    return repr(op)


def _validate(opname, t, group, comm_dtype, op, block_size, error_feedback, needs_contiguous,
              backend):
    rank, n = _rank_and_size(opname, group)
    where = f"{opname}: rank {rank}:"
    if backend not in qk.BACKENDS:
        raise ValueError(f"{where} backend must be one of {qk.BACKENDS}, got {backend!r}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} argument 't' must be a torch.Tensor, got {type(t).__name__}")
    if comm_dtype not in COMM_DTYPES:
        raise ValueError(f"{where} comm_dtype must be one of {COMM_DTYPES}, got {comm_dtype!r}")
    if op not in _OPS:
        raise ValueError(f"{where} op must be one of {_OPS}, got {op!r}")
    if comm_dtype is not None and t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{where} comm_dtype={comm_dtype!r} needs t of dtype fp32, bf16 or fp16, "
                        f"got {t.dtype}")
    if comm_dtype == "int8" and (not 4 <= block_size <= 4096 or block_size & (block_size - 1)):
        raise ValueError(f"{where} block_size must be a power of two in [4, 4096], got "
                         f"{block_size}")
    if needs_contiguous and not t.is_contiguous():
        raise ValueError(f"{where} argument 't' must be contiguous (the op writes it in place)")
    if error_feedback is not None:
        if comm_dtype is None:
            raise ValueError(f"{where} error_feedback needs comm_dtype 'int8' or 'bf16'")
        if not isinstance(error_feedback, ErrorFeedback) or error_feedback.numel != t.numel() \
                or error_feedback.residual.device != t.device:
            raise ValueError(f"{where} error_feedback must be an ErrorFeedback({t.numel()}) on "
                             f"{t.device}, got {error_feedback!r} with numel "
                             f"{getattr(error_feedback, 'numel', None)}")
    return rank, n


def _check_across_ranks(opname, group, rank, n, t, comm_dtype, op, block_size) -> None:
    """One small all-gather so that a mismatch raises on every rank instead of hanging."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
              torch.int32, torch.int8, torch.uint8]
    fields = {"t.numel()": t.numel(), "t.dim()": t.dim(),
              "t.shape[0]": t.shape[0] if t.dim() else 1,
              "t.dtype": dtypes.index(t.dtype) if t.dtype in dtypes else 99,
              "comm_dtype": COMM_DTYPES.index(comm_dtype), "op": _OPS.index(op),
              "block_size": block_size}
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=t.device)
    table = torch.empty(n, len(fields), dtype=torch.int64, device=t.device)
    paths._all_gather(table.view(-1), mine, group=group)
    for col, name in enumerate(fields):
        values = table[:, col].tolist()
        if len(set(values)) > 1:
            shown = [dtypes[v] if name == "t.dtype" and v < len(dtypes) else
                     COMM_DTYPES[v] if name == "comm_dtype" else
                     _OPS[v] if name == "op" else v for v in values]
            raise ValueError(f"{opname}: rank {rank}: {name} differs across the ranks of the "
                             f"group (rank order): {shown}; every rank must pass the same")


def _run(opname, t, group, rank, body, *, async_op, check_ranks, comm_dtype, op, block_size):
    def checked_body():
        if check_ranks:
            _check_across_ranks(opname, group, rank, dist.get_world_size(group), t, comm_dtype,
                                op, block_size)
        return body()

    return submit(opname, group, rank, checked_body, async_op=async_op, device=t.device)


def all_reduce(t: torch.Tensor, *, group, comm_dtype: str | None = None, op: str = "sum",
               block_size: int = DEFAULT_BLOCK_SIZE, stochastic: bool = False, seed: int = 0,
               error_feedback: ErrorFeedback | None = None, check_ranks: bool = True,
               async_op: bool = False, backend: str = "auto") -> torch.Tensor | QuantWork:
    """All-reduce ``t`` (contiguous, any shape) in place: t = sum_r t_r (or the mean).

    ``stochastic``/``seed``: stochastic rounding for INT8, with noise keyed by (seed, rank,
    phase): pass a new seed each step. ``error_feedback``: carries the quantization residual to
    the next call. ``check_ranks``: first compare shape, dtype and options across the ranks
    (one small all-gather; the hot path may turn it off once a configuration is known good).
    ``backend``: kernel backend for INT8 ("auto": C++ on CPU, Triton on GPU; "torch", "triton").
    Returns ``t``, or with ``async_op`` a QuantWork whose ``wait()`` returns ``t``."""
    op = _op_name(op)
    rank, n = _validate("quant.all_reduce", t, group, comm_dtype, op, block_size,
                        error_feedback, needs_contiguous=True, backend=backend)
    divisor = float(n) if op == "avg" else 1.0

    def body():
        x = t.view(-1)
        if x.numel() == 0 or n == 1:
            return t
        if comm_dtype == "int8":
            paths.int8_all_reduce(x, group, rank, n, divisor, block_size, stochastic, seed,
                                  error_feedback, backend)
        elif comm_dtype == "bf16":
            paths.bf16_all_reduce(x, group, rank, n, divisor, error_feedback)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM,
                            group=group)
        return t

    return _run("quant.all_reduce", t, group, rank, body, async_op=async_op,
                check_ranks=check_ranks, comm_dtype=comm_dtype, op=op, block_size=block_size)


def reduce_scatter(t: torch.Tensor, *, group, comm_dtype: str | None = None, op: str = "sum",
                   block_size: int = DEFAULT_BLOCK_SIZE, stochastic: bool = False, seed: int = 0,
                   error_feedback: ErrorFeedback | None = None, check_ranks: bool = True,
                   async_op: bool = False, backend: str = "auto") -> torch.Tensor | QuantWork:
    """Reduce ``t`` [n*m0, *rest] over the group and return this rank's slice [m0, *rest] of
    the sum (or mean): out_shard_r = sum_k t_k[r*m0 : (r+1)*m0]. Options as in ``all_reduce``."""
    op = _op_name(op)
    rank, n = _validate("quant.reduce_scatter", t, group, comm_dtype, op, block_size,
                        error_feedback, needs_contiguous=False, backend=backend)
    if t.dim() == 0 or t.shape[0] % n:
        raise ValueError(f"quant.reduce_scatter: rank {rank}: t.shape[0] must be divisible by "
                         f"the group size {n}, got shape {tuple(t.shape)}")
    divisor = float(n) if op == "avg" else 1.0
    out_shape = (t.shape[0] // n, *t.shape[1:])

    def body():
        x = t.reshape(-1).contiguous()
        if x.numel() == 0 or n == 1:
            return t.clone().view(out_shape)
        if comm_dtype == "int8":
            out = paths.int8_reduce_scatter(x, group, rank, n, divisor, block_size, stochastic,
                                            seed, error_feedback, backend)
        elif comm_dtype == "bf16":
            out = paths.bf16_reduce_scatter(x, group, rank, n, divisor, error_feedback)
        else:
            out = paths.plain_reduce_scatter(x, group, n, op == "avg")
        return out.to(t.dtype).view(out_shape)

    return _run("quant.reduce_scatter", t, group, rank, body, async_op=async_op,
                check_ranks=check_ranks, comm_dtype=comm_dtype, op=op, block_size=block_size)


def all_gather(t: torch.Tensor, *, group, comm_dtype: str | None = None,
               block_size: int = DEFAULT_BLOCK_SIZE, stochastic: bool = False, seed: int = 0,
               check_ranks: bool = True, async_op: bool = False,
               backend: str = "auto") -> torch.Tensor | QuantWork:
    """Gather ``t`` [m0, *rest] from every rank into [n*m0, *rest] (rank r's at rows
    r*m0 : (r+1)*m0). With a lossy ``comm_dtype`` every rank's part, its own included, is the
    dequantized one, so all ranks hold the same result. Options as in ``all_reduce``."""
    rank, n = _validate("quant.all_gather", t, group, comm_dtype, "sum", block_size, None,
                        needs_contiguous=False, backend=backend)
    if t.dim() == 0:
        raise ValueError(f"quant.all_gather: rank {rank}: t must have at least one dim "
                         "(gathered along dim 0)")
    out_shape = (n * t.shape[0], *t.shape[1:])

    def body():
        x = t.reshape(-1).contiguous()
        if x.numel() == 0 or n == 1:
            return t.clone().view(out_shape)
        if comm_dtype == "int8":
            out = paths.int8_all_gather(x, group, rank, n, block_size, stochastic, seed, backend)
        elif comm_dtype == "bf16":
            out = paths.bf16_all_gather(x, group, n)
        else:
            out = paths.plain_all_gather(x, group, n)
        return out.to(t.dtype).view(out_shape)

    return _run("quant.all_gather", t, group, rank, body, async_op=async_op,
                check_ranks=check_ranks, comm_dtype=comm_dtype, op="sum", block_size=block_size)

