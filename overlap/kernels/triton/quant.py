"""Blockwise INT8 quantize, dequantize and fused dequantize-reduce(-requantize) in Triton.

The arithmetic is csrc/quant.cuh's, step for step, so these kernels write the same bytes as the
C++ and CUDA kernels and the torch reference (overlap/comm/quant/kernels.py). Outputs are fp32;
callers cast to bf16/fp16 with torch.

Layout: ``rows`` rows of ``row_len`` codes, row r at ``q + r * q_stride`` with its scales at
``s + r * s_stride``. Row r stands for ``flat[r * flat_row : (r + 1) * flat_row]`` of a flat
tensor of ``numel`` elements, zero-padded to ``row_len``. Each program handles GROUP
quantization blocks as a [GROUP, BLOCK] tile: in the dense launch (rows back to back in the flat
tensor) a tile of one row, whose accesses Triton vectorises; else any GROUP blocks in order.
The narrative: docs/design/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overlap.kernels.triton import INTERPRET
from overlap.kernels.triton.spec import CompileSpec, ints, ptr

__all__ = ["quantize_into", "dequantize_into", "dequant_reduce_into", "compile_specs"]

# constexpr: compiled kernels may read module globals only when they are tl.constexpr.
_FLOAT_MAX = tl.constexpr(3.4028234663852886e38)
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + M) - M rounds v to nearest-even, |v| < 2^22
_TINY = tl.constexpr(2.350988701644575e-38)  # 2^-125, the tiny-to-zero cut of csrc/quant.cuh
_TILE = 4096  # elements per program (GROUP * BLOCK)
# Compiled, Triton's fp32 '/' is an approximate division, so the GPU path uses div_rn. Under the
# interpreter '/' is numpy's IEEE division (the same correctly rounded result), and
# tl.math.div_rn stops working there once torch._inductor's Triton helpers have been imported
# (torch.distributed.pipelining does that), so the interpreter uses '/'.
_SLASH_IS_IEEE = tl.constexpr(INTERPRET)


@triton.jit
def _div_rn(a, b):
    if _SLASH_IS_IEEE:
        return a / b
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def _tz(v):
    return tl.where(tl.abs(v) < _TINY, 0.0, v)


@triton.jit
def _noise_u01(key, idx):
    # Same mix as csrc/quant.cuh noise_u01: u = (mix32(idx ^ key) >> 8) * 2^-24.
    h = idx.to(tl.uint32) ^ key.to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * 0x7feb352d
    h = h ^ (h >> 15)
    h = h * 0x846ca68b
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _quantize_tile(x, scale, idx, key, STOCHASTIC: tl.constexpr):
    # x [G, BLOCK] fp32, scale [G] fp32 -> int8 codes [G, BLOCK].
    fin = tl.abs(x) <= _FLOAT_MAX
    safe_scale = tl.where(scale > 0.0, scale, 1.0)
    v = _tz(_div_rn(_tz(tl.where(fin, x, 0.0)), safe_scale[:, None]))
    if STOCHASTIC:
        r = tl.floor(v + _noise_u01(key, idx))
    else:
        r = (v + _MAGIC) - _MAGIC
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where((scale > 0.0)[:, None], r, 0.0)
    r = tl.where(fin, r, -128.0)
    return r.to(tl.int8)


@triton.jit
def _absmax_scale(x):
    fin = tl.abs(x) <= _FLOAT_MAX
    absmax = tl.max(tl.where(fin, tl.abs(x), 0.0), axis=1)
    return _tz(_div_rn(absmax, 127.0))


@triton.jit
def _dequant_tile(q, scale):
    d = q.to(tl.float32) * _tz(scale)[:, None]
    d = tl.minimum(tl.maximum(d, -_FLOAT_MAX), _FLOAT_MAX)
    return tl.where(q == -128, float("nan"), d)


@triton.jit
def _dense_tile(blocks_per_row, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """This program's tile of a dense launch: (row, first block, blocks [GROUP], their mask,
    offsets [GROUP, BLOCK] from the tile's first element). One scalar division per program;
    the offsets are i32 aranges, so Triton sees BLOCK contiguous, BLOCK-aligned elements."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(blocks_per_row, GROUP)
    row = (pid // tiles).to(tl.int64)
    b0 = (pid % tiles) * GROUP
    b = b0 + tl.arange(0, GROUP)
    local = tl.arange(0, GROUP)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return row, b0, b, b < blocks_per_row, local


@triton.jit
def _row_offset(row, stride, Q_ALIGN: tl.constexpr):
    # The host passes a stride divisible by Q_ALIGN (0 for a single row).
    off = row * stride
    if Q_ALIGN > 1:
        off = tl.multiple_of(off, Q_ALIGN)
    return off


@triton.jit
def _load_x(ptrs, mask, BF16_BITS: tl.constexpr):
    if BF16_BITS:
        # bf16 arrives as int16 bits and widens by a shift, as in quant.cuh: the interpreter's
        # own bf16 -> fp32 cast gets subnormals wrong.
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.uint16).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["numel", "flat_row", "key", "index_base"])
def _quantize_kernel(x_ptr, numel, flat_row, total_blocks, blocks_per_row, q_ptr, q_stride,
                     s_ptr, s_stride, key, index_base, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                     STOCHASTIC: tl.constexpr, BF16_BITS: tl.constexpr, DENSE: tl.constexpr,
                     Q_ALIGN: tl.constexpr):
    if DENSE:
        # flat_row == row_len: block b of row r is x[(r * blocks_per_row + b) * BLOCK + t].
        r, b0, b, bmask, local = _dense_tile(blocks_per_row, BLOCK, GROUP)
        first = (r * blocks_per_row + b0) * BLOCK  # int64: the tile's first element
        end = (r * blocks_per_row + tl.minimum(b0 + GROUP, blocks_per_row)) * BLOCK
        if end <= numel:  # every program but the one at numel and the zero padding after it
            x = _load_x(x_ptr + first + local, bmask[:, None], BF16_BITS)
        else:
            x = _load_x(x_ptr + first + local, bmask[:, None] & (first + local < numel),
                        BF16_BITS)
        scale = _absmax_scale(x)
        tl.store(s_ptr + r * s_stride + b, scale, mask=bmask)
        # The noise reads the index's low 32 bits: wrapping u32 arithmetic gives the same.
        idx = (index_base + first).to(tl.uint32) + local.to(tl.uint32)
        q = _quantize_tile(x, scale, idx, key, STOCHASTIC)
        q_tile = q_ptr + _row_offset(r, q_stride, Q_ALIGN) + b0.to(tl.int64) * BLOCK
        tl.store(q_tile + local, q, mask=bmask[:, None])
    else:
        gb = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
        t = tl.arange(0, BLOCK)
        gmask = gb < total_blocks
        r = gb // blocks_per_row
        b = gb % blocks_per_row
        j = (b * BLOCK)[:, None] + t[None, :]
        e = (r * flat_row)[:, None] + j
        x = _load_x(x_ptr + e, gmask[:, None] & (j < flat_row) & (e < numel), BF16_BITS)
        scale = _absmax_scale(x)
        tl.store(s_ptr + r * s_stride + b, scale, mask=gmask)
        q = _quantize_tile(x, scale, index_base + e, key, STOCHASTIC)
        tl.store(q_ptr + (r * q_stride + b * BLOCK)[:, None] + t[None, :], q,
                 mask=gmask[:, None])


@triton.jit(do_not_specialize=["numel", "flat_row"])
def _dequantize_kernel(q_ptr, q_stride, s_ptr, s_stride, total_blocks, blocks_per_row, out_ptr,
                       numel, flat_row, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                       DENSE: tl.constexpr, Q_ALIGN: tl.constexpr):
    if DENSE:
        # flat_row == blocks_per_row * BLOCK: block b of row r is out[(r * bpr + b) * BLOCK].
        r, b0, b, bmask, local = _dense_tile(blocks_per_row, BLOCK, GROUP)
        q_tile = q_ptr + _row_offset(r, q_stride, Q_ALIGN) + b0.to(tl.int64) * BLOCK
        q = tl.load(q_tile + local, mask=bmask[:, None], other=0)
        scale = tl.load(s_ptr + r * s_stride + b, mask=bmask, other=0.0)
        d = _dequant_tile(q, scale)
        first = (r * blocks_per_row + b0) * BLOCK
        end = (r * blocks_per_row + tl.minimum(b0 + GROUP, blocks_per_row)) * BLOCK
        if end <= numel:  # every program but the one at out's end and those after it
            tl.store(out_ptr + first + local, d, mask=bmask[:, None])
        else:
            tl.store(out_ptr + first + local, d, mask=bmask[:, None] & (first + local < numel))
    else:
        gb = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
        t = tl.arange(0, BLOCK)
        r = gb // blocks_per_row
        b = gb % blocks_per_row
        j = (b * BLOCK)[:, None] + t[None, :]
        e = (r * flat_row)[:, None] + j
        mask = (gb < total_blocks)[:, None] & (j < flat_row) & (e < numel)
        q = tl.load(q_ptr + (r * q_stride)[:, None] + j, mask=mask, other=0)
        scale = tl.load(s_ptr + r * s_stride + b, mask=gb < total_blocks, other=0.0)
        tl.store(out_ptr + e, _dequant_tile(q, scale), mask=mask)


@triton.jit(do_not_specialize=["divisor", "key", "index_base"])
def _dequant_reduce_kernel(q_ptr, q_stride, s_ptr, s_stride, num_src, num_blocks, divisor,
                           out_ptr, q_out_ptr, s_out_ptr, key, index_base, BLOCK: tl.constexpr,
                           GROUP: tl.constexpr, HAS_DIV: tl.constexpr, REQUANT: tl.constexpr,
                           STOCHASTIC: tl.constexpr, Q_ALIGN: tl.constexpr):
    # One row of num_blocks blocks: _dense_tile's row is 0, its first block the tile's.
    _, b0, b, bmask, local = _dense_tile(num_blocks, BLOCK, GROUP)
    first = b0.to(tl.int64) * BLOCK
    acc = tl.zeros([GROUP, BLOCK], dtype=tl.float32)
    # Sources in rank order, one rounding per add: the order every implementation uses.
    for r in range(num_src):
        row = tl.cast(r, tl.int64)  # rows * stride may pass 2^31 bytes
        q_tile = q_ptr + _row_offset(row, q_stride, Q_ALIGN) + first
        q = tl.load(q_tile + local, mask=bmask[:, None], other=0)
        scale = tl.load(s_ptr + row * s_stride + b, mask=bmask, other=0.0)
        acc = _tz(acc + _dequant_tile(q, scale))
    if HAS_DIV:
        acc = _tz(_div_rn(acc, divisor))
    if REQUANT:
        scale = _absmax_scale(acc)
        tl.store(s_out_ptr + b, scale, mask=bmask)
        idx = (index_base + first).to(tl.uint32) + local.to(tl.uint32)
        tl.store(q_out_ptr + first + local, _quantize_tile(acc, scale, idx, key, STOCHASTIC),
                 mask=bmask[:, None])
    else:
        tl.store(out_ptr + first + local, acc, mask=bmask[:, None])


def _group(block: int) -> int:
    return max(1, _TILE // block)


def _meta(block: int, **constexprs) -> dict:
    """A launch's constexprs and options (shared with compile_specs). No FMA contraction:
    the bytes must match csrc/quant.cuh's."""
    return dict(BLOCK=block, GROUP=_group(block), **constexprs, enable_fp_fusion=False)


def _quantize_meta(block: int, stochastic: bool, bf16: bool, dense: bool = False,
                   q_align: int = 1) -> dict:
    return _meta(block, STOCHASTIC=stochastic, BF16_BITS=bf16, DENSE=dense, Q_ALIGN=q_align)


_ALIGNS = (1, 8, 16)  # Q_ALIGN: the codes' row stride's divisibility, as _codes_stride picks it


def _codes_stride(stride: int, rows: int) -> tuple[int, int]:
    """(the codes' row stride to pass, Q_ALIGN): a single row passes 0, which every alignment
    divides; 8 is what a stamped wire row guarantees (overlap/comm/quant/paths.py)."""
    stride = stride if rows > 1 else 0
    return stride, next(a for a in reversed(_ALIGNS) if stride % a == 0)


def _dense(blocks_per_row: int, rows: int, block: int) -> bool:
    """The dense launch walks each row in tiles of GROUP blocks; rows much shorter than a tile
    would leave most of each program idle, so they take the general one."""
    return rows == 1 or blocks_per_row >= _group(block)


def compile_specs(block: int = 128) -> list[CompileSpec]:
    """The GPU launches at the default block size: each input dtype (bf16 as its int16
    bits), rounding to nearest or stochastic, each reduce variant; the general launch and the
    dense one at each codes alignment."""
    codes = {"q_ptr": "*i8", "s_ptr": "*fp32", **ints("q_stride s_stride")}
    layouts = [(False, 1)] + [(True, a) for a in _ALIGNS]
    specs = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        bf16 = dtype == torch.bfloat16
        for stochastic in (False, True):
            for dense, align in layouts:
                specs.append(CompileSpec(_quantize_kernel, {
                    "x_ptr": ptr(torch.int16 if bf16 else dtype), **codes,
                    **ints("numel flat_row total_blocks blocks_per_row key index_base")},
                    _quantize_meta(block, stochastic, bf16, dense, align),
                    f"{dtype}, stochastic={stochastic}, dense={dense}, align={align}"))
    for dense, align in layouts:
        specs.append(CompileSpec(_dequantize_kernel, {
            **codes, "out_ptr": "*fp32", **ints("total_blocks blocks_per_row numel flat_row")},
            _meta(block, DENSE=dense, Q_ALIGN=align), f"dense={dense}, align={align}"))
    for has_div in (False, True):
        for requant, stochastic in ((False, False), (True, False), (True, True)):
            both = "*i8" if requant else "*fp32"  # the pointer in use, passed for both
            for align in _ALIGNS:
                specs.append(CompileSpec(_dequant_reduce_kernel, {
                    **codes, "out_ptr": both, "q_out_ptr": both, "s_out_ptr": "*fp32",
                    "divisor": "fp32", **ints("num_src num_blocks key index_base")},
                    _meta(block, HAS_DIV=has_div, REQUANT=requant, STOCHASTIC=stochastic,
                          Q_ALIGN=align),
                    f"divisor={has_div}, requant={requant}, stochastic={stochastic}, "
                    f"align={align}"))
    return specs


def _row_stride(t: torch.Tensor, name: str) -> int:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"triton quant: {name} must be a 2-D view with unit inner stride, "
                         f"got shape {tuple(t.shape)} stride {t.stride()}")
    return t.stride(0)


def quantize_into(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, *, block: int,
                  flat_row: int, stochastic: bool = False, key: int = 0,
                  index_base: int = 0) -> None:
    """Quantize flat ``x`` (fp32/bf16/fp16) into ``q`` [rows, row_len] int8 and ``s``
    [rows, row_len // block] fp32 (row-strided views); row r is x[r*flat_row:(r+1)*flat_row]."""
    rows, row_len = q.shape
    blocks_per_row = row_len // block
    total = rows * blocks_per_row
    if total == 0:
        return
    bf16 = x.dtype == torch.bfloat16
    dense = flat_row == row_len and _dense(blocks_per_row, rows, block)
    q_stride, q_align = _codes_stride(_row_stride(q, "q"), rows)
    per_row = triton.cdiv(blocks_per_row, _group(block))
    grid = (rows * per_row if dense else triton.cdiv(total, _group(block)),)
    _quantize_kernel[grid](x.view(torch.int16) if bf16 else x, x.numel(), flat_row, total,
                           blocks_per_row, q, q_stride, s, _row_stride(s, "s"), key, index_base,
                           **_quantize_meta(block, stochastic, bf16, dense,
                                            q_align if dense else 1))


def dequantize_into(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor, *, block: int,
                    flat_row: int) -> None:
    """Flat fp32 ``out``: row r of dequant(``q`` [rows, row_len], ``s``) lands at
    out[r*flat_row : (r+1)*flat_row] (cut at out.numel())."""
    rows = q.shape[0]
    blocks_per_row = triton.cdiv(flat_row, block)
    total = rows * blocks_per_row
    if total == 0 or out.numel() == 0:
        return
    dense = flat_row % block == 0 and _dense(blocks_per_row, rows, block)
    q_stride, q_align = _codes_stride(_row_stride(q, "q"), rows)
    per_row = triton.cdiv(blocks_per_row, _group(block))
    grid = (rows * per_row if dense else triton.cdiv(total, _group(block)),)
    _dequantize_kernel[grid](q, q_stride, s, _row_stride(s, "s"), total, blocks_per_row, out,
                             out.numel(), flat_row,
                             **_meta(block, DENSE=dense, Q_ALIGN=q_align if dense else 1))


def dequant_reduce_into(q: torch.Tensor, s: torch.Tensor, *, block: int, divisor: float,
                        out: torch.Tensor | None = None, q_out: torch.Tensor | None = None,
                        s_out: torch.Tensor | None = None, stochastic: bool = False,
                        key: int = 0, index_base: int = 0) -> None:
    """Sum the ``q``/``s`` rows [num_src, row_len] in fp32 (row order), divide by ``divisor``
    unless it is 1, then write fp32 ``out`` [row_len] or requantize into ``q_out``/``s_out``."""
    num_src, row_len = q.shape
    num_blocks = row_len // block
    if num_blocks == 0:
        return
    requant = out is None
    if requant == (q_out is None or s_out is None):
        raise ValueError("triton dequant_reduce_into: give either out or (q_out, s_out)")
    # The pointers a branch does not use still need a tensor; pass one that exists.
    out, q_out, s_out = (q_out, q_out, s_out) if requant else (out, out, out)
    q_stride, q_align = _codes_stride(_row_stride(q, "q"), num_src)
    grid = (triton.cdiv(num_blocks, _group(block)),)
    _dequant_reduce_kernel[grid](
        q, q_stride, s, _row_stride(s, "s"), num_src, num_blocks, float(divisor),
        out, q_out, s_out, key, index_base,
        **_meta(block, HAS_DIV=divisor != 1, REQUANT=requant, STOCHASTIC=stochastic,
                Q_ALIGN=q_align))
