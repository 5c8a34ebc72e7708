"""GEMM-ReduceScatter in Triton: the GEMM's epilogue writes each output tile straight into the
owner rank's workspace; the owner waits for every source and reduces in a fixed order.

Shapes (per rank of a TP group of ``world`` ranks; M = world * m):

    x         [M, K]        this rank's activation (typically a column shard of the features)
    w         [K, N]        this rank's weight (typically a row shard of a Linear)
    y_shard   [m, N]        rows [rank*m, (rank+1)*m) of sum over ranks s of x_s @ w_s

Each partial is rounded to the input dtype, summed in fp32 in rank order and rounded once, so
every run gives the same bits. Signals (b = phase % 2): slot s < world on owner r: source s
wrote its partial of phase p into staging buffer b; slot world + o on source s: owner o
finished reducing phase p. Calls back to back need no barrier.
The narrative: docs/design/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overlap.kernels.triton.spec import FUSED_GEMM_TABLES, GEMM_DTYPES, CompileSpec, ints, ptr
from overlap.kernels.triton.tp_sync import (INTERPRET, GemmBlocks, Watchdog, align, arrive_last,
                                            begin_call, check_dtypes, check_operands,
                                            check_workspace, finish_call, gemm_blocks,
                                            gemm_tiles, half_buffer, new_status, publish,
                                            spin_wait, to_out_dtype, wait_budget)

__all__ = ["matmul_reduce_scatter", "matmul_reduce_scatter_workspace_bytes",
           "matmul_reduce_scatter_num_signals", "compile_specs"]

_OP = "matmul_reduce_scatter"
_SYNC_ARGS = ["rank", "phase", "ack_phase", "max_spins", "timeout_ns"]


@triton.jit(do_not_specialize=_SYNC_ARGS)
def _matmul_reduce_scatter_kernel(x_ptr, w_ptr, data_table, flag_table, counter_ptr, status_ptr,
                                  rank, world, m, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
                                  buf_off, phase, ack_phase, max_spins, timeout_ns,
                                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                  CAST_F32: tl.constexpr, SOFT_BF16: tl.constexpr,
                                  USE_CLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BM)
    tiles_n = tl.cdiv(N, BN)
    per_owner = tiles_m * tiles_n
    step = pid // per_owner
    tm = (pid % per_owner) // tiles_n
    tn = pid % tiles_n
    owner = (rank + 1 + step) % world
    rows = (tm * BM + tl.arange(0, BM)).to(tl.int64)  # rows of the owner's shard
    cols = (tn * BN + tl.arange(0, BN)).to(tl.int64)
    row_ok = rows < m
    col_ok = cols < N
    x_rows = owner * m + rows
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = (k0 + tl.arange(0, BK)).to(tl.int64)
        k_ok = ks < K
        a = tl.load(x_ptr + x_rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if CAST_F32:
            # The interpreter's tl.dot multiplies bf16 as raw uint16: widen first (exact).
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)
    out = to_out_dtype(acc, x_ptr.dtype.element_ty, SOFT_BF16)
    # The owner may still be reducing the previous phase that used this buffer: the tile was
    # computed meanwhile, now it must wait before overwriting our staging slot there.
    own_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int64))
    if spin_wait(own_flags + world + owner, ack_phase, world + owner, status_ptr, max_spins,
                 timeout_ns, USE_CLOCK):
        dst = tl.load(data_table + owner).to(tl.pointer_type(x_ptr.dtype.element_ty))
        # Alignment hint (buffers are 256-byte aligned) so the peer stores are vectorised.
        dst = tl.multiple_of(dst, 16) + buf_off + rank.to(tl.int64) * m * N
        tl.store(dst + rows[:, None] * N + cols[None, :], out,
                 mask=row_ok[:, None] & col_ok[None, :])
        if arrive_last(counter_ptr + owner, per_owner):
            owner_flags = tl.load(flag_table + owner).to(tl.pointer_type(tl.int64))
            publish(owner_flags + rank, phase)


@triton.jit(do_not_specialize=_SYNC_ARGS)
def _reduce_kernel(y_ptr, data_table, flag_table, counter_ptr, status_ptr, rank, world, numel,
                   buf_off, phase, max_spins, timeout_ns, BLOCK: tl.constexpr,
                   SOFT_BF16: tl.constexpr, USE_CLOCK: tl.constexpr):
    own_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int64))
    failed = 0
    for s in range(0, world):
        ok = spin_wait(own_flags + s, phase, s, status_ptr, max_spins, timeout_ns, USE_CLOCK)
        failed += 1 - ok.to(tl.int32)
    if failed == 0:
        base = tl.load(data_table + rank).to(tl.pointer_type(y_ptr.dtype.element_ty))
        base = tl.multiple_of(base, 16) + buf_off
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, world):  # fixed order: the same bits on every run
            acc += tl.load(base + s * numel + offs, mask=mask, other=0.0).to(tl.float32)
        if arrive_last(counter_ptr, tl.num_programs(0)):
            for s in range(0, world):
                src_flags = tl.load(flag_table + s).to(tl.pointer_type(tl.int64))
                publish(src_flags + world + rank, phase)
        tl.store(y_ptr + offs, to_out_dtype(acc, y_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


def _gemm_meta(blocks: GemmBlocks, dtype: torch.dtype, on_gpu: bool) -> dict:
    """The GEMM launch's constexprs and options (shared with compile_specs)."""
    return dict(BM=blocks.bm, BN=blocks.bn, BK=blocks.bk,
                CAST_F32=INTERPRET and dtype != torch.float32,
                SOFT_BF16=INTERPRET and dtype == torch.bfloat16, USE_CLOCK=on_gpu,
                num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _reduce_meta(blocks: GemmBlocks, dtype: torch.dtype, on_gpu: bool) -> dict:
    """The reduce launch's constexprs and options (shared with compile_specs)."""
    return dict(BLOCK=blocks.copy_block, SOFT_BF16=INTERPRET and dtype == torch.bfloat16,
                USE_CLOCK=on_gpu, num_warps=4)


def compile_specs(arch: int | None = None) -> list[CompileSpec]:
    """The GPU launches of both kernels for every dtype, the GEMM at each tile gemm_blocks may
    pick on ``arch`` (tp_sync.GEMM_TILES; overlap.kernels.compile_check compiles them for each
    arch it targets)."""
    tables = FUSED_GEMM_TABLES
    specs = []
    for dtype in GEMM_DTYPES:
        tiles = gemm_tiles(arch, dtype)
        for b in tiles:
            specs.append(CompileSpec(_matmul_reduce_scatter_kernel, {
                "x_ptr": ptr(dtype), "w_ptr": ptr(dtype), **tables,
                **ints("rank world m N K stride_xm stride_xk stride_wk stride_wn buf_off phase "
                       "ack_phase max_spins")}, _gemm_meta(b, dtype, True),
                f"{dtype}, {b.bm}x{b.bn}x{b.bk} w{b.num_warps} s{b.num_stages}"))
        specs.append(CompileSpec(_reduce_kernel, {
            "y_ptr": ptr(dtype), **tables, **ints("rank world numel buf_off phase max_spins")},
            _reduce_meta(tiles[0], dtype, True), str(dtype)))
    return specs


def matmul_reduce_scatter_workspace_bytes(m: int, n: int, world: int, dtype: torch.dtype) -> int:
    """Bytes per rank matmul_reduce_scatter needs for an output shard of [m, n] ``dtype``
    (m = M / world):
    two staging buffers (phase parity) of [world, m, n]."""
    return 2 * align(world * m * n * dtype.itemsize)


def matmul_reduce_scatter_num_signals(world: int) -> int:
    """Signal slots matmul_reduce_scatter needs: ready[world] then ack[world]."""
    return 2 * world


def _check_args(ws, x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
    rows, k, n = check_operands(_OP, ws, "x", x, w, "M")
    if rows % ws.world:
        raise ValueError(f"{_OP}: x has M={rows} rows, which the group of {ws.world} ranks "
                         f"cannot scatter evenly; M must be a multiple of {ws.world} "
                         f"(rank {ws.rank})")
    return rows // ws.world, k, n


def matmul_reduce_scatter(ws, x: torch.Tensor, w: torch.Tensor, *, phase: int,
            timeout: float | None = None, sync: bool = True) -> torch.Tensor:
    """y_shard = reduce_scatter(x @ w, dim 0) over the workspace's group, the scatter fused
    into the GEMM's epilogue (see the module docstring for shapes, design and signals).

    ``phase``: positive, strictly increasing per workspace, the same on every rank for the
    same call. ``timeout`` (default ``ws.timeout``) bounds every signal wait; a wait that runs
    out raises TimeoutError naming the op, rank, slot and phase, after which the workspace is
    out of step and must be closed. ``sync=False`` defers that check (no host-device sync on a
    GPU): the error is raised by a later call on ``ws`` or by ``check_pending(ws)``.
    Returns y_shard [M / world, N] in the input dtype.
    """
    m, k, n = _check_args(ws, x, w)
    dtype = check_dtypes(_OP, ws, x=x, w=w)
    world, rank, device = ws.world, ws.rank, ws.device
    check_workspace(_OP, ws, matmul_reduce_scatter_workspace_bytes(m, n, world, dtype),
                    matmul_reduce_scatter_num_signals(world),
                    f"an output shard of [{m}, {n}] {dtype}")
    timeout = ws.timeout if timeout is None else float(timeout)
    if timeout <= 0:
        raise ValueError(f"{_OP}: timeout must be > 0 seconds, got {timeout} (rank {rank})")
    state, buf, ack_phase = begin_call(_OP, ws, phase)

    blocks = gemm_blocks(m, n, k, dtype, device)
    max_spins, timeout_ns = wait_budget(timeout)
    status = new_status(device)
    counters = torch.zeros(world + 1, dtype=torch.int32, device=device)  # per owner, reduce
    buf_off = buf * half_buffer(ws) // dtype.itemsize
    on_gpu = device.type == "cuda"

    # The watchdog stops the kernels' waits when a peer dies or the wall-clock timeout
    # passes (interpreter; see tp_sync.Watchdog).
    with Watchdog(ws, status, timeout) as dog:
        grid = (world * triton.cdiv(m, blocks.bm) * triton.cdiv(n, blocks.bn),)
        _matmul_reduce_scatter_kernel[grid](
            x, w, state.data_table, state.flag_table, counters, status, rank, world, m, n, k,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), buf_off, phase, ack_phase,
            max_spins, timeout_ns, **_gemm_meta(blocks, dtype, on_gpu))

        y_shard = torch.empty(m, n, dtype=dtype, device=device)
        _reduce_kernel[(triton.cdiv(m * n, blocks.copy_block),)](
            y_shard, state.data_table, state.flag_table, counters[world:], status, rank, world,
            m * n, buf_off, phase, max_spins, timeout_ns, **_reduce_meta(blocks, dtype, on_gpu))

    def describe(slot: int) -> str:
        if slot < world:
            return f"ready flag of source rank {slot}: its partial for phase {phase}"
        return (f"ack of owner rank {slot - world}: it has not finished reducing buffer {buf} "
                f"from phase {ack_phase}")

    finish_call(state, status, ws=ws, phase=phase, timeout=timeout, describe=describe,
                sync=sync, dog=dog)
    return y_shard
