"""Argument checks of the quantized collectives: the one place ``comm_dtype`` is validated.

``comm_dtype`` is "fp32" | "bf16" | "int8" across the library (these ops, ``GradReducer``,
``--comm-dtype``). "fp32" means no quantization: the plain collective in the input's own dtype.

Local checks raise before any collective. What must agree between ranks is compared by the
stamps every call carries (``stamps``), and on the group's first call by the named check.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from overlap.comm.quant.feedback import ErrorFeedback
from overlap.comm.quant import kernels as qk

__all__ = ["COMM_DTYPES", "OPS", "comm_dtype_arg", "timeout_arg", "op_name", "validate"]

COMM_DTYPES = ("fp32", "bf16", "int8")
OPS = ("sum", "avg")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _at(where: str, rank: int | None) -> str:
    return f"{where}: rank {rank}:" if rank is not None else f"{where}:"


def comm_dtype_arg(value, *, where: str, rank: int | None = None) -> str:
    """``value`` if it is one of COMM_DTYPES, else a ValueError naming the argument, ``where``
    and the rank."""
    if not isinstance(value, str) or value not in COMM_DTYPES:
        raise ValueError(f"{_at(where, rank)} argument 'comm_dtype' must be one of "
                         f"{', '.join(map(repr, COMM_DTYPES))}, got {value!r}")
    return value


def timeout_arg(value, *, where: str, rank: int | None = None) -> float:
    """Seconds every wait of an op may take: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < math.inf:
        raise ValueError(f"{_at(where, rank)} argument 'timeout' must be a finite number of "
                         f"seconds > 0, got {value!r}")
    return float(value)


def op_name(op) -> str:
    """"sum" / "avg", also accepting dist.ReduceOp.SUM / AVG."""
    if isinstance(op, str):
        return op
    for name, red in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        if op == red:
            return name
    return repr(op)


def validate(opname: str, rank: int, t, comm_dtype: str, op: str, block_size: int,
             error_feedback, needs_contiguous: bool, impl: str) -> None:
    """The local checks of one call (``comm_dtype`` already normalised)."""
    where = _at(opname, rank)
    if impl not in qk.IMPLS:
        raise ValueError(f"{where} argument 'impl' must be one of {qk.IMPLS}, got {impl!r}")
    try:  # an impl that cannot run on this device is refused before any collective
        qk.resolve_impl(impl, t.device)
    except ValueError as exc:
        raise ValueError(f"{where} argument 'impl': {exc}") from None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} argument 't' must be a torch.Tensor, got {type(t).__name__}")
    if op not in OPS:
        raise ValueError(f"{where} argument 'op' must be one of {OPS}, got {op!r}")
    if comm_dtype != "fp32" and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where} comm_dtype={comm_dtype!r} needs t of dtype fp32, bf16 or fp16, "
                        f"got {t.dtype}")
    if comm_dtype == "int8" and (not 4 <= block_size <= 4096 or block_size & (block_size - 1)):
        raise ValueError(f"{where} argument 'block_size' must be a power of two in [4, 4096], "
                         f"got {block_size}")
    if needs_contiguous and not t.is_contiguous():
        raise ValueError(f"{where} argument 't' must be contiguous (the op writes it in place)")
    if error_feedback is not None:
        if comm_dtype == "fp32":
            raise ValueError(f"{where} argument 'error_feedback' needs comm_dtype 'int8' or "
                             "'bf16'")
        if not isinstance(error_feedback, ErrorFeedback) or error_feedback.numel != t.numel() \
                or error_feedback.residual.device != t.device:
            raise ValueError(f"{where} argument 'error_feedback' must be an "
                             f"ErrorFeedback({t.numel()}) on {t.device}, got {error_feedback!r} "
                             f"with numel {getattr(error_feedback, 'numel', None)}")
