"""The bodies of the quantized collectives, one per (op, comm dtype), and their wire sizes.

Called by ``overlap.comm.quant`` after validation, inline or on a worker thread, with an
``OpRun`` (``work``) that issues every collective with a bounded wait and hands out the group's
scratch. Every call carries its stamp (``stamps``) in its first exchange, compared before the
received data is used, at no extra collective, message or host sync. Wire buffers are the
group's scratch, reused across calls; results handed back to the caller are fresh tensors.

Notation: n = group size, N = elements of the input, B = block size, m = elements per shard,
L = ceil(m / B) * B (a shard padded to whole blocks), C = L + 4 L / B (bytes of one quantized
shard on the wire: L int8 codes then L / B fp32 scales), S = ceil(C / 8) * 8 + 88 (a stamped
row: the payload padded to 8 bytes, then the STAMP_BYTES = 88 bytes of the stamp).
The narrative: docs/design/quantized.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.comm.quant import kernels as qk
from overlap.comm.quant.checks import comm_dtype_arg
from overlap.comm.quant.stamps import STAMP_BYTES, WORDS, check_table
from overlap.dist.stamp import pack_sum_tail, sum_tail_bits, sum_tail_chunks, unpack_sum_tail

__all__ = ["int8_geometry", "stamped_row", "sum_tail", "STAMP_BYTES", "exchange_stamps",
           "wire_bytes", "stochastic_key", "int8_all_reduce",
           "int8_reduce_scatter", "int8_all_gather", "bf16_all_reduce", "bf16_reduce_scatter",
           "bf16_all_gather", "plain_all_reduce", "plain_reduce_scatter", "plain_all_gather"]

def int8_geometry(m: int, block: int) -> tuple[int, int]:
    """(L, C) for a shard of m elements: padded length and bytes on the wire."""
    L = -(-m // block) * block
    return L, L + 4 * (L // block)


def stamped_row(payload_bytes: int) -> tuple[int, int]:
    """(offset of the stamp, row bytes) of a byte row carrying ``payload_bytes`` and a stamp:
    the payload padded to 8 bytes (so the stamp reads as int64), then STAMP_BYTES."""
    off = -(-payload_bytes // 8) * 8
    return off, off + STAMP_BYTES


def sum_tail(dtype: torch.dtype, n: int) -> tuple[int, int]:
    """(bits per chunk, tail elements) of the stamp tail of a SUM in ``dtype`` on n ranks."""
    bits = sum_tail_bits(dtype)
    return bits, (n * WORDS * sum_tail_chunks(bits) if bits else 0)


_TAIL_DTYPE = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16, 1: torch.uint8}


def wire_bytes(op: str, numel: int, element_size: int, comm_dtype: str, world_size: int,
               block_size: int) -> int:
    """Bytes one rank sends to its peers for ``op`` on a tensor of ``numel`` elements.

    INT8 and BF16 count what this module hands to all_to_all / all_gather (each peer's share);
    "fp32" counts what a ring algorithm sends (nccl-tests' convention): 2(n-1)/n * bytes for
    all-reduce, (n-1)/n * bytes of the full tensor for reduce-scatter and all-gather. Both
    include the stamp (``stamps``): STAMP_BYTES per row of the call's first exchange (padded to
    8 bytes), or for the "fp32" all-reduce / reduce-scatter the SUM tail of n * 10 * 64/bits
    elements (per shard for reduce-scatter), bits as ``sum_tail`` gives it for the float dtype
    of that element size (fp32 16, bf16 / fp16 8, fp64 32)."""
    n = world_size
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"quant.wire_bytes: argument 'op' must be 'all_reduce', "
                         f"'reduce_scatter' or 'all_gather', got {op!r}")
    comm_dtype = comm_dtype_arg(comm_dtype, where="quant.wire_bytes")
    if n == 1:
        return 0
    m = {"all_reduce": -(-numel // n), "reduce_scatter": numel // n, "all_gather": numel}[op]
    if comm_dtype == "int8":
        C = int8_geometry(m, block_size)[1]
        return (n - 1) * (stamped_row(C)[1] + (C if op == "all_reduce" else 0))
    if comm_dtype == "bf16":
        return (n - 1) * (stamped_row(2 * m)[1] + (2 * m if op == "all_reduce" else 0))
    tail = sum_tail(_TAIL_DTYPE.get(element_size, torch.uint8), n)[1]
    if op == "all_reduce":
        return 2 * (n - 1) * (numel + tail) * element_size // n
    if op == "reduce_scatter":
        return (n - 1) * (m + tail) * element_size
    return (n - 1) * stamped_row(m * element_size)[1]


def stochastic_key(seed: int, rank: int, phase: int) -> int:
    """Noise key of one quantization: distinct per seed, rank and phase, so ranks round
    independently and the two quantizations of an all-reduce do too."""
    return ((seed * 0x9E3779B1) ^ (rank * 0x85EBCA77) ^ (phase * 0xC2B2AE3D)) & 0x7FFFFFFF


# ---- stamps (``stamps``): written into the rows a call sends, compared where they land ---------

def _write_stamps(run, rows: torch.Tensor, off: int) -> None:
    """This call's stamp into bytes [off, off + STAMP_BYTES) of every row of ``rows``."""
    rows[:, off:off + STAMP_BYTES].view(torch.int64).copy_(
        run.agree.send[:WORDS].expand(rows.shape[0], WORDS))


def _verify_rows(run, rows: torch.Tensor, off: int) -> None:
    """Compare the stamps in received byte rows (row r from rank r) with this call's; raises
    Disagreement (CPU) or records it and poisons (GPU) before anything reads the payload."""
    agree = run.agree
    agree.recv[:, :WORDS].copy_(rows[:, off:off + STAMP_BYTES].view(torch.int64))
    agree.verify(run.op, run.peers)


def exchange_stamps(run, what: str = "all_gather", *, named: bool = False) -> None:
    """The stamps alone, all-gathered and compared: the named first-call check (``named``:
    a ValueError listing every rank's value of the first field that differs; it reads the
    table on the host, once per group), and the exchange of a call with nothing to send (so a
    peer with data never waits for it)."""
    if run.stamps_agreed:
        return  # already exchanged and compared before the data (plain gloo)
    n = run.state.world
    send = run.buffer("stamp", (1, STAMP_BYTES), torch.uint8)
    _write_stamps(run, send, 0)
    table = run.buffer("stamps", (n, STAMP_BYTES), torch.uint8)
    run.all_gather(table.view(-1), send.view(-1), what=what)
    if named:
        check_table(run.op, run.state.rank, table.view(torch.int64).tolist())
    _verify_rows(run, table, 0)
    run.stamps_agreed = True


def _views(buf: torch.Tensor, L: int, C: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [rows, L] and fp32 scales [rows, L/B] inside a [rows, >= C] byte buffer."""
    return buf[:, :L].view(torch.int8), buf[:, L:C].view(torch.float32)


def _quantize_rows(p, run, n, m, block, stochastic, key, impl):
    """Quantize into n stamped rows [codes | scales | pad | stamp]: (send, stamp offset)."""
    L, C = int8_geometry(m, block)
    off, R = stamped_row(C)
    send = run.buffer("send", (n, R), torch.uint8)
    q, s = _views(send, L, C)
    qk.quantize_into(p, q, s, block=block, flat_row=m, stochastic=stochastic, key=key,
                     impl=impl)
    _write_stamps(run, send, off)
    return send, off


def _local_residual(ef, p, send, m, block, impl):
    # e' = p - deq(q(p)): what this rank's quantization dropped.
    L, C = int8_geometry(m, block)
    q, s = _views(send, L, C)
    deq = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
    qk.dequantize_into(q, s, deq, block=block, flat_row=m, impl=impl)
    torch.sub(p, deq, out=ef.residual)


def _compensated(x, ef):
    return x.to(torch.float32) if ef is None else x.to(torch.float32) + ef.residual


def _exchange_int8(x, run, rank, n, m, block, stochastic, seed, ef, impl):
    # The stamp rides at the end of each all-to-all row: every rank receives every rank's in
    # the call's first exchange (the second, an all-gather of equal shards, needs none).
    p = x if ef is None else _compensated(x, ef)
    send, off = _quantize_rows(p, run, n, m, block, stochastic, stochastic_key(seed, rank, 0),
                               impl)
    if ef is not None:
        _local_residual(ef, p, send, m, block, impl)
    recv = run.buffer("recv", tuple(send.shape), torch.uint8)
    run.all_to_all(recv, send)
    _verify_rows(run, recv, off)
    return recv


def int8_all_reduce(x, run, rank, n, divisor, block, stochastic, seed, ef, impl):
    """In place on the flat contiguous ``x``; see the module docstring for the phases."""
    N = x.numel()
    m = -(-N // n)
    L, C = int8_geometry(m, block)
    recv = _exchange_int8(x, run, rank, n, m, block, stochastic, seed, ef, impl)
    q, s = _views(recv, L, C)
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
    run.agree.poison(out)
    if out is not x:
        x.copy_(out)


def int8_reduce_scatter(x, run, rank, n, divisor, block, stochastic, seed, ef, impl):
    """Flat ``x`` of n*m elements -> this rank's reduced shard, fp32 [m]."""
    m = x.numel() // n
    L, C = int8_geometry(m, block)
    recv = _exchange_int8(x, run, rank, n, m, block, stochastic, seed, ef, impl)
    q, s = _views(recv, L, C)
    y = torch.empty(L, dtype=torch.float32, device=x.device)
    qk.dequant_reduce_into(q, s, block=block, divisor=divisor, out=y, impl=impl)
    run.agree.poison(y)
    return y[:m]


def int8_all_gather(x, run, rank, n, block, stochastic, seed, impl):
    """Flat ``x`` of m elements -> every rank's x, dequantized, fp32 [n * m]."""
    m = x.numel()
    L, C = int8_geometry(m, block)
    send, off = _quantize_rows(x, run, 1, m, block, stochastic, stochastic_key(seed, rank, 0),
                               impl)
    gathered = run.buffer("gathered", (n, send.shape[1]), torch.uint8)
    run.all_gather(gathered.view(-1), send.view(-1))
    _verify_rows(run, gathered, off)
    q, s = _views(gathered, L, C)
    out = torch.empty(n * m, dtype=torch.float32, device=x.device)
    qk.dequantize_into(q, s, out, block=block, flat_row=m, impl=impl)
    run.agree.poison(out)
    return out


def _bf16_rows(run, slot: str, rows: int, m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A scratch [rows, R] byte buffer of stamped bf16 rows: (buffer, bf16 view [rows, m],
    stamp offset)."""
    off, R = stamped_row(2 * m)
    buf = run.buffer(slot, (rows, R), torch.uint8)
    return buf, buf[:, :2 * m].view(torch.bfloat16), off


def _fill_rows(rows: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy (and cast) ``flat`` into consecutive ``rows`` [r, m], zero-padding the rest."""
    r, m = rows.shape
    N = flat.numel()
    full = N // m
    if full:
        rows[:full].copy_(flat[:full * m].view(full, m))
    if full < r:
        rest = N - full * m
        if rest:
            rows[full, :rest].copy_(flat[full * m:])
        rows[full, rest:].zero_()
        rows[full + 1:].zero_()


def _bf16_exchange(x, run, n, m, ef):
    # bf16 rows with the stamp at their end, as the int8 rows (see _exchange_int8).
    p = x if ef is None else _compensated(x, ef)
    send, payload, off = _bf16_rows(run, "send", n, m)
    _fill_rows(payload, p)
    if ef is not None:
        torch.sub(p, p.to(torch.bfloat16).to(torch.float32), out=ef.residual)
    _write_stamps(run, send, off)
    recv = run.buffer("recv", tuple(send.shape), torch.uint8)
    run.all_to_all(recv, send)
    _verify_rows(run, recv, off)
    return recv[:, :2 * m].view(torch.bfloat16)


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
    run.agree.poison(gathered)
    x.copy_(gathered[:N])


def bf16_reduce_scatter(x, run, rank, n, divisor, ef):
    out = _sum_rows_fp32(_bf16_exchange(x, run, n, x.numel() // n, ef), divisor)
    run.agree.poison(out)
    return out


def bf16_all_gather(x, run, n):
    m = x.numel()
    send, payload, off = _bf16_rows(run, "send", 1, m)
    payload.copy_(x.view(1, m))
    _write_stamps(run, send, off)
    gathered = run.buffer("gathered", (n, send.shape[1]), torch.uint8)
    run.all_gather(gathered.view(-1), send.view(-1))
    _verify_rows(run, gathered, off)
    out = torch.empty(n, m, dtype=torch.bfloat16, device=x.device)
    out.copy_(gathered[:, :2 * m].view(torch.bfloat16))
    run.agree.poison(out)
    return out.view(-1)


# ---- "fp32": the plain collectives in the input's dtype, with the stamp -----------------------
# A SUM cannot carry bytes, so the all-reduce and the reduce-scatter carry the stamp as small
# integers in a tail of the buffer they reduce (overlap.dist.stamp.pack_sum_tail: each rank's
# chunks in its own row, zeros elsewhere, exact in the dtype). That is the cheapest carrier: no
# extra message, n * 44 fp32 elements (n * 88 bf16) per all-reduce, which costs one copy of the
# input into the scratch and one back (a plain collective cannot be lengthened in place); a
# separate stamp collective would cost a launch and a latency per call, a hash would not name
# the values. "avg" reduces as SUM and divides afterwards (gloo's AVG is that very sum and
# division), so the tail is exact whatever the op. The all-gather is a byte copy: stamped rows.

def _tail_bits(run, dtype: torch.dtype) -> tuple[int, int]:
    bits, tail = sum_tail(dtype, run.state.world)
    if not bits:
        raise TypeError(f"{run.op}: {run.state.place}: comm_dtype='fp32' cannot carry the call's "
                        f"stamp in a reduction of dtype {dtype}")
    return bits, tail


def _pack_tail(run, tail: torch.Tensor, bits: int) -> None:
    """``tail`` [n, WORDS * chunks] (in the buffer's dtype): this rank's row = its stamp."""
    tail.zero_()
    tail[run.state.rank].copy_(pack_sum_tail(run.agree.send[:WORDS], bits))


def _verify_tail(run, tail: torch.Tensor, bits: int) -> None:
    run.agree.recv[:, :WORDS].copy_(unpack_sum_tail(tail, bits))
    run.agree.verify(run.op, run.peers)


def plain_reduce_scatter(x, run, n, avg):
    m = x.numel() // n
    bits, T = _tail_bits(run, x.dtype)
    # Every shard carries the whole [n, words] tail, so each rank receives every rank's stamp.
    send = run.buffer("sum", (n, m + T), x.dtype)
    send[:, :m].copy_(x.view(n, m))
    tails = send[:, m:].view(n, n, -1)
    tails.zero_()
    tails[:, run.state.rank].copy_(pack_sum_tail(run.agree.send[:WORDS], bits))
    out = torch.empty(m + T, dtype=x.dtype, device=x.device)
    run.reduce_scatter(out, send.view(-1), dist.ReduceOp.SUM)
    _verify_tail(run, out[m:].view(n, -1), bits)
    res = out[:m]
    if avg:
        res.div_(n)
    run.agree.poison(res)
    return res


def plain_all_gather(x, run, n):
    m = x.numel()
    P = m * x.element_size()
    off, R = stamped_row(P)
    send = run.buffer("send", (1, R), torch.uint8)
    send[0, :P].copy_(x.view(torch.uint8))
    _write_stamps(run, send, off)
    gathered = run.buffer("gathered", (n, R), torch.uint8)
    run.all_gather(gathered.view(-1), send.view(-1))
    _verify_rows(run, gathered, off)
    out = torch.empty(n * m, dtype=x.dtype, device=x.device)
    out.view(torch.uint8).view(n, P).copy_(gathered[:, :P])
    run.agree.poison(out)
    return out


def plain_all_reduce(x, run, avg):
    """In place on the contiguous ``x`` (any shape)."""
    flat = x.view(-1)
    N = flat.numel()
    bits, T = _tail_bits(run, x.dtype)
    buf = run.buffer("sum", (N + T,), x.dtype)
    buf[:N].copy_(flat)
    tail = buf[N:].view(run.state.world, -1)
    _pack_tail(run, tail, bits)
    run.all_reduce(buf, dist.ReduceOp.SUM)
    _verify_tail(run, tail, bits)
    res = buf[:N]
    if avg:
        res.div_(run.state.world)
    run.agree.poison(res)
    flat.copy_(res)
