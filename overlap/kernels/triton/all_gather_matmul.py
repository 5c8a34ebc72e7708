"""AllGather-GEMM in Triton: the GEMM's tiles wait on the signal of the shard they need and read
it straight out of the peer's symmetric buffer.

Shapes (per rank of a TP group of ``world`` ranks; ``m`` rows per shard, M = world * m):

    x_shard   [m, K]        this rank's rows of the activation
    w         [K, N]        this rank's weight (typically a column shard of a Linear)
    y         [M, N]        y = all_gather(x_shard, dim 0) @ w
    gathered  [M, K]        all_gather(x_shard, dim 0), for the backward (if asked)

Signals (b = phase % 2 picks one of the workspace's two buffers): slot s < world on consumer r:
source s published phase p into its buffer b; slot world + c on producer s: consumer c finished
reading s's buffer at phase p. Calls back to back need no barrier.
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

__all__ = ["all_gather_matmul", "all_gather_matmul_workspace_bytes",
           "all_gather_matmul_num_signals", "compile_specs"]

_OP = "all_gather_matmul"
_SYNC_ARGS = ["rank", "phase", "ack_phase", "max_spins", "timeout_ns"]


@triton.jit(do_not_specialize=_SYNC_ARGS)
def _ag_publish_kernel(x_ptr, data_table, flag_table, counter_ptr, status_ptr, rank, world, numel,
                       buf_off, phase, ack_phase, max_spins, timeout_ns, BLOCK: tl.constexpr,
                       USE_CLOCK: tl.constexpr):
    own_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int64))
    failed = 0
    # Buffer b was last read at ack_phase: every consumer must be done with it.
    for c in range(0, world):
        ok = spin_wait(own_flags + world + c, ack_phase, world + c, status_ptr, max_spins,
                       timeout_ns, USE_CLOCK)
        failed += 1 - ok.to(tl.int32)
    if failed == 0:
        dst = tl.load(data_table + rank).to(tl.pointer_type(x_ptr.dtype.element_ty))
        dst = tl.multiple_of(dst, 16) + buf_off  # workspace buffers are 256-byte aligned
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(dst + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
        if arrive_last(counter_ptr, tl.num_programs(0)):
            for r in range(0, world):
                peer_flags = tl.load(flag_table + r).to(tl.pointer_type(tl.int64))
                publish(peer_flags + rank, phase)


@triton.jit(do_not_specialize=_SYNC_ARGS)
def _all_gather_matmul_kernel(w_ptr, y_ptr, g_ptr, data_table, flag_table, counter_ptr, status_ptr,
                              rank, world, m, N, K, stride_wk, stride_wn, buf_off, phase,
                              max_spins, timeout_ns, BM: tl.constexpr, BN: tl.constexpr,
                              BK: tl.constexpr, RETURN_GATHERED: tl.constexpr,
                              CAST_F32: tl.constexpr, SOFT_BF16: tl.constexpr,
                              USE_CLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BM)
    tiles_n = tl.cdiv(N, BN)
    per_src = tiles_m * tiles_n
    step = pid // per_src
    tm = (pid % per_src) // tiles_n
    tn = pid % tiles_n  # column blocks fastest: neighbouring programs reuse the same remote A
    src = (rank + step) % world
    own_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int64))
    if spin_wait(own_flags + src, phase, src, status_ptr, max_spins, timeout_ns, USE_CLOCK):
        a_base = tl.load(data_table + src).to(tl.pointer_type(y_ptr.dtype.element_ty))
        # The hint lets the compiler vectorise and pipeline (cp.async) the peer loads; a raw
        # address carries no alignment, and workspace buffers are 256-byte aligned.
        a_base = tl.multiple_of(a_base, 16) + buf_off
        rows = (tm * BM + tl.arange(0, BM)).to(tl.int64)
        cols = (tn * BN + tl.arange(0, BN)).to(tl.int64)
        row_ok = rows < m
        col_ok = cols < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = (k0 + tl.arange(0, BK)).to(tl.int64)
            k_ok = ks < K
            a_mask = row_ok[:, None] & k_ok[None, :]
            a = tl.load(a_base + rows[:, None] * K + ks[None, :], mask=a_mask, other=0.0)
            b = tl.load(w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if RETURN_GATHERED:
                if tn == 0:
                    tl.store(g_ptr + (src * m + rows)[:, None] * K + ks[None, :], a, mask=a_mask)
            if CAST_F32:
                # The interpreter's tl.dot multiplies bf16 as raw uint16: widen first. Products
                # of bf16/fp16 are exact in fp32, so this is the tensor-core math.
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)
        # Every load of src's buffer is done: let src reuse it (before our own stores of y).
        if arrive_last(counter_ptr + src, per_src):
            src_flags = tl.load(flag_table + src).to(tl.pointer_type(tl.int64))
            publish(src_flags + world + rank, phase)
        out = to_out_dtype(acc, y_ptr.dtype.element_ty, SOFT_BF16)
        y_rows = src * m + rows
        tl.store(y_ptr + y_rows[:, None] * N + cols[None, :], out,
                 mask=row_ok[:, None] & col_ok[None, :])


def _publish_meta(blocks: GemmBlocks, on_gpu: bool) -> dict:
    """The publish launch's constexprs and options (shared with compile_specs)."""
    return dict(BLOCK=blocks.copy_block, USE_CLOCK=on_gpu, num_warps=4)


def _gemm_meta(blocks: GemmBlocks, dtype: torch.dtype, return_gathered: bool,
               on_gpu: bool) -> dict:
    """The GEMM launch's constexprs and options (shared with compile_specs)."""
    return dict(BM=blocks.bm, BN=blocks.bn, BK=blocks.bk, RETURN_GATHERED=return_gathered,
                CAST_F32=INTERPRET and dtype != torch.float32,
                SOFT_BF16=INTERPRET and dtype == torch.bfloat16, USE_CLOCK=on_gpu,
                num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def compile_specs(arch: int | None = None) -> list[CompileSpec]:
    """The GPU launches of both kernels: every dtype, with and without the gathered x, at each
    tile gemm_blocks may pick on ``arch`` (tp_sync.GEMM_TILES; overlap.kernels.compile_check
    compiles them for each arch it targets)."""
    tables = FUSED_GEMM_TABLES
    specs = []
    for dtype in GEMM_DTYPES:
        tiles = gemm_tiles(arch, dtype)
        specs.append(CompileSpec(_ag_publish_kernel, {
            "x_ptr": ptr(dtype), **tables,
            **ints("rank world numel buf_off phase ack_phase max_spins")},
            _publish_meta(tiles[0], True), str(dtype)))
        for blocks in tiles:
            for gathered in (False, True):
                specs.append(CompileSpec(_all_gather_matmul_kernel, {
                    "w_ptr": ptr(dtype), "y_ptr": ptr(dtype), "g_ptr": ptr(dtype), **tables,
                    **ints("rank world m N K stride_wk stride_wn buf_off phase max_spins")},
                    _gemm_meta(blocks, dtype, gathered, True),
                    f"{dtype}, return_gathered={gathered}, {blocks.bm}x{blocks.bn}x{blocks.bk} "
                    f"w{blocks.num_warps} s{blocks.num_stages}"))
    return specs


def all_gather_matmul_workspace_bytes(m: int, k: int, world: int, dtype: torch.dtype) -> int:
    """Bytes per rank all_gather_matmul needs for shards of [m, k] ``dtype``: two buffers
    (phase parity).
    (``world`` does not change it: every rank keeps only its own shard.)"""
    return 2 * align(m * k * dtype.itemsize)


def all_gather_matmul_num_signals(world: int) -> int:
    """Signal slots all_gather_matmul needs: ready[world] then ack[world]."""
    return 2 * world


def _check_args(ws, x_shard: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
    return check_operands(_OP, ws, "x_shard", x_shard, w, "m")


def all_gather_matmul(ws, x_shard: torch.Tensor, w: torch.Tensor, *, phase: int,
            return_gathered: bool = False, timeout: float | None = None,
            sync: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = all_gather(x_shard, dim 0) @ w over the workspace's group, the gather fused into the
    GEMM (see the module docstring for shapes, design and signals).

    ``phase``: positive, strictly increasing per workspace, the same on every rank for the
    same call. ``timeout`` (default ``ws.timeout``) bounds every signal wait; a wait that runs
    out raises TimeoutError naming the op, rank, slot and phase, after which the workspace is
    out of step and must be closed. ``sync=False`` defers that check (no host-device sync on a
    GPU): the error is raised by a later call on ``ws`` or by ``check_pending(ws)``.
    Returns (y [world*m, N], gathered [world*m, K] or None).
    fp32 inputs are multiplied in IEEE fp32 (no TF32); bf16/fp16 accumulate in fp32 and round
    once to the input dtype.
    """
    m, k, n = _check_args(ws, x_shard, w)
    dtype = check_dtypes(_OP, ws, x_shard=x_shard, w=w)
    world, rank, device = ws.world, ws.rank, ws.device
    check_workspace(_OP, ws, all_gather_matmul_workspace_bytes(m, k, world, dtype),
                    all_gather_matmul_num_signals(world), f"a shard of [{m}, {k}] {dtype}")
    timeout = ws.timeout if timeout is None else float(timeout)
    if timeout <= 0:
        raise ValueError(f"{_OP}: timeout must be > 0 seconds, got {timeout} (rank {rank})")
    state, buf, ack_phase = begin_call(_OP, ws, phase)

    x = x_shard.contiguous()
    blocks = gemm_blocks(m, n, k, dtype, device)
    max_spins, timeout_ns = wait_budget(timeout)
    status = new_status(device)
    counters = torch.zeros(1 + world, dtype=torch.int32, device=device)  # publish, per source
    buf_off = buf * half_buffer(ws) // dtype.itemsize
    on_gpu = device.type == "cuda"

    # The watchdog stops the kernels' waits when a peer dies or the wall-clock timeout
    # passes (interpreter; see tp_sync.Watchdog).
    with Watchdog(ws, status, timeout) as dog:
        _ag_publish_kernel[(triton.cdiv(m * k, blocks.copy_block),)](
            x, state.data_table, state.flag_table, counters, status, rank, world, m * k, buf_off,
            phase, ack_phase, max_spins, timeout_ns, **_publish_meta(blocks, on_gpu))

        y = torch.empty(world * m, n, dtype=dtype, device=device)
        gathered = (torch.empty(world * m, k, dtype=dtype, device=device) if return_gathered
                    else None)
        grid = (world * triton.cdiv(m, blocks.bm) * triton.cdiv(n, blocks.bn),)
        _all_gather_matmul_kernel[grid](
            w, y, gathered if return_gathered else y, state.data_table, state.flag_table,
            counters[1:], status, rank, world, m, n, k, w.stride(0), w.stride(1), buf_off, phase,
            max_spins, timeout_ns, **_gemm_meta(blocks, dtype, return_gathered, on_gpu))

    def describe(slot: int) -> str:
        if slot < world:
            return f"ready flag of source rank {slot}: its shard for phase {phase}"
        return (f"ack of consumer rank {slot - world}: it has not finished reading this rank's "
                f"buffer {buf} from phase {ack_phase}")

    finish_call(state, status, ws=ws, phase=phase, timeout=timeout, describe=describe,
                sync=sync, dog=dog)
    return y, gathered
