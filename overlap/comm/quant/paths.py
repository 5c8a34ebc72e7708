"""The bodies of the quantized collectives, one per (op, comm dtype), and their wire sizes.

Called by ``overlap.comm.quant`` after validation, inline or on a worker thread, with an
``OpRun`` (``work``) that issues every collective with a bounded wait and hands out the group's
scratch. Notation: n = group size, N = elements of the input, B = block size, m = elements per
shard, L = ceil(m / B) * B (a shard padded to whole blocks), C = L + 4 L / B (bytes of one
quantized shard on the wire: L int8 codes then L / B fp32 scales).

INT8 all-reduce (two-shot; reduction in fp32, never in int8), m = ceil(N / n):
    1. quantize x into n rows, row j = x[j*m : (j+1)*m]          send [n, C] bytes
    2. all_to_all: row j goes to rank j                          recv [n, C]: my shard, from all
    3. y = sum_r deq(recv[r]) in fp32 in rank order (/ n for avg); requantize y -> [C]
    4. all_gather the requantized shards                        [n, C]
    5. dequantize into x (cast to x's dtype)
INT8 reduce-scatter: steps 1-3 with m = N / n, and y (cast) is the result.
INT8 all-gather: quantize the local tensor (one row, m = N), all_gather, dequantize.
BF16 (comm_dtype="bf16"): the same shapes with a bf16 cast (RNE) instead of quantize; sums in
fp32 in rank order. "fp32": the plain torch.distributed collective in the input's own dtype.

Wire buffers are the group's scratch (``state.GroupState.buffer``), reused across calls. That
is safe because the ops of this package on one group never overlap (``work`` keeps them in
order) and a failed group drops its scratch; results handed back to the caller are always fresh
tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.comm.quant import kernels as qk
from overlap.comm.quant.checks import comm_dtype_arg

__all__ = ["int8_geometry", "wire_bytes", "stochastic_key", "int8_all_reduce",
           "int8_reduce_scatter", "int8_all_gather", "bf16_all_reduce", "bf16_reduce_scatter",
           "bf16_all_gather", "plain_all_reduce", "plain_reduce_scatter", "plain_all_gather"]

def int8_geometry(m: int, block: int) -> tuple[int, int]:
    """(L, C) for a shard of m elements: padded length and bytes on the wire."""
    L = -(-m // block) * block
    return L, L + 4 * (L // block)


def wire_bytes(op: str, numel: int, element_size: int, comm_dtype: str, world_size: int,
               block_size: int) -> int:
    """Bytes one rank sends to its peers for ``op`` on a tensor of ``numel`` elements.

    INT8 and BF16 count what this module hands to all_to_all / all_gather (each peer's share);
    "fp32" counts what a ring algorithm sends (nccl-tests' convention): 2(n-1)/n * bytes for
    all-reduce, (n-1)/n * bytes of the full tensor for reduce-scatter and all-gather."""
    n = world_size
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"quant.wire_bytes: argument 'op' must be 'all_reduce', "
                         f"'reduce_scatter' or 'all_gather', got {op!r}")
    comm_dtype = comm_dtype_arg(comm_dtype, where="quant.wire_bytes")
    m = {"all_reduce": -(-numel // n), "reduce_scatter": numel // n, "all_gather": numel}[op]
    phases = 2 if op == "all_reduce" else 1
    if comm_dtype == "int8":
        return phases * (n - 1) * int8_geometry(m, block_size)[1]
    if comm_dtype == "bf16":
        return phases * (n - 1) * m * 2
    if op == "all_reduce":
        return 2 * (n - 1) * numel * element_size // n
    full = numel if op == "reduce_scatter" else numel * n
    return (n - 1) * full * element_size // n


def stochastic_key(seed: int, rank: int, phase: int) -> int:
    """Noise key of one quantization: distinct per seed, rank and phase, so ranks round
    independently and the two quantizations of an all-reduce do too."""
    return ((seed * 0x9E3779B1) ^ (rank * 0x85EBCA77) ^ (phase * 0xC2B2AE3D)) & 0x7FFFFFFF


def _views(buf: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [rows, L] and fp32 scales [rows, L/B] inside a [rows, C] byte buffer."""
    return buf[:, :L].view(torch.int8), buf[:, L:].view(torch.float32)


def _quantize_rows(p, run, n, m, block, stochastic, key, impl):
    L, C = int8_geometry(m, block)
    send = run.buffer("send", (n, C), torch.uint8)
    q, s = _views(send, L)
    qk.quantize_into(p, q, s, block=block, flat_row=m, stochastic=stochastic, key=key,
                     impl=impl)
    return send


def _local_residual(ef, p, send, m, block, impl):
    # e' = p - deq(q(p)): what this rank's quantization dropped.
    q, s = _views(send, int8_geometry(m, block)[0])
    deq = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
    qk.dequantize_into(q, s, deq, block=block, flat_row=m, impl=impl)
    torch.sub(p, deq, out=ef.residual)


def _compensated(x, ef):
    return x.to(torch.float32) if ef is None else x.to(torch.float32) + ef.residual


def _exchange_int8(x, run, rank, n, m, block, stochastic, seed, ef, impl):
    p = x if ef is None else _compensated(x, ef)
    send = _quantize_rows(p, run, n, m, block, stochastic, stochastic_key(seed, rank, 0),
                          impl)
    if ef is not None:
        _local_residual(ef, p, send, m, block, impl)
    recv = run.buffer("recv", tuple(send.shape), torch.uint8)
    run.all_to_all(recv, send)
    return recv


def int8_all_reduce(x, run, rank, n, divisor, block, stochastic, seed, ef, impl):
    """In place on the flat contiguous ``x``; see the module docstring for the phases."""
    N = x.numel()
    m = -(-N // n)
    L, C = int8_geometry(m, block)
    recv = _exchange_int8(x, run, rank, n, m, block, stochastic, seed, ef, impl)
    q, s = _views(recv, L)
    mine = run.buffer("mine", (1, C), torch.uint8)
    q_out, s_out = _views(mine, L)
    key = stochastic_key(seed, rank, 1)
    if ef is None:
        qk.dequant_reduce_into(q, s, block=block, divisor=divisor, q_out=q_out.view(-1),
                               s_out=s_out.view(-1), stochastic=stochastic, key=key,
                               index_base=rank * m, impl=impl)
    else:
        # The owner of a shard also carries the error of requantizing the reduced shard.
        y = torch.empty(L, dtype=torch.float32, device=x.device)
        qk.dequant_reduce_into(q, s, block=block, divisor=divisor, out=y, impl=impl)
        y += ef.shard_residual_for(L)
        qk.quantize_into(y, q_out, s_out, block=block, stochastic=stochastic, key=key,
                         index_base=rank * m, impl=impl)
        deq = torch.empty(L, dtype=torch.float32, device=x.device)
        qk.dequantize_into(q_out, s_out, deq, block=block, impl=impl)
        torch.sub(y, deq, out=ef.shard_residual)
    gathered = run.buffer("gathered", (n, C), torch.uint8)
    run.all_gather(gathered.view(-1), mine.view(-1))
    q, s = _views(gathered, L)
    out = x if x.dtype == torch.float32 else torch.empty(N, dtype=torch.float32, device=x.device)
    qk.dequantize_into(q, s, out, block=block, flat_row=m, impl=impl)
    if out is not x:
        x.copy_(out)


def int8_reduce_scatter(x, run, rank, n, divisor, block, stochastic, seed, ef, impl):
    """Flat ``x`` of n*m elements -> this rank's reduced shard, fp32 [m]."""
    m = x.numel() // n
    L, _ = int8_geometry(m, block)
    recv = _exchange_int8(x, run, rank, n, m, block, stochastic, seed, ef, impl)
    q, s = _views(recv, L)
    y = torch.empty(L, dtype=torch.float32, device=x.device)
    qk.dequant_reduce_into(q, s, block=block, divisor=divisor, out=y, impl=impl)
    return y[:m]


def int8_all_gather(x, run, rank, n, block, stochastic, seed, impl):
    """Flat ``x`` of m elements -> every rank's x, dequantized, fp32 [n * m]."""
    m = x.numel()
    L, _ = int8_geometry(m, block)
    send = _quantize_rows(x, run, 1, m, block, stochastic, stochastic_key(seed, rank, 0),
                          impl)
    gathered = run.buffer("gathered", (n, send.shape[1]), torch.uint8)
    run.all_gather(gathered.view(-1), send.view(-1))
    q, s = _views(gathered, L)
    out = torch.empty(n * m, dtype=torch.float32, device=x.device)
    qk.dequantize_into(q, s, out, block=block, flat_row=m, impl=impl)
    return out


def _bf16_exchange(x, run, n, m, ef):
    p = x if ef is None else _compensated(x, ef)
    send = run.buffer("send", (n * m,), torch.bfloat16)
    send[: x.numel()] = p
    send[x.numel():] = 0
    if ef is not None:
        torch.sub(p, send[: x.numel()].to(torch.float32), out=ef.residual)
    recv = run.buffer("recv", (n * m,), torch.bfloat16)
    run.all_to_all(recv, send)
    return recv.view(n, m)


def _sum_rows_fp32(rows: torch.Tensor, divisor: float) -> torch.Tensor:
    acc = rows[0].to(torch.float32)
    for r in range(1, rows.shape[0]):  # rank order, one rounding per add (bf16 -> fp32 exact)
        acc.add_(rows[r])
    if divisor != 1:
        acc.div_(float(divisor))
    return acc


def bf16_all_reduce(x, run, rank, n, divisor, ef):
    """In place on the flat contiguous ``x``: bf16 on the wire, fp32 sums."""
    N = x.numel()
    m = -(-N // n)
    acc = _sum_rows_fp32(_bf16_exchange(x, run, n, m, ef), divisor)
    if ef is not None:
        acc += ef.shard_residual_for(m)
    mine = acc.to(torch.bfloat16)
    if ef is not None:
        torch.sub(acc, mine.to(torch.float32), out=ef.shard_residual)
    gathered = run.buffer("gathered", (n * m,), torch.bfloat16)
    run.all_gather(gathered, mine)
    x.copy_(gathered[:N])


def bf16_reduce_scatter(x, run, rank, n, divisor, ef):
    return _sum_rows_fp32(_bf16_exchange(x, run, n, x.numel() // n, ef), divisor)


def bf16_all_gather(x, run, n):
    gathered = torch.empty(n * x.numel(), dtype=torch.bfloat16, device=x.device)
    run.all_gather(gathered, x.to(torch.bfloat16))
    return gathered


def plain_reduce_scatter(x, run, n, avg):
    out = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
    run.reduce_scatter(out, x, dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM)
    return out


def plain_all_gather(x, run, n):
    out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    run.all_gather(out, x)
    return out


def plain_all_reduce(x, run, avg):
    run.all_reduce(x, dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM)
