"""Blockwise INT8 quantization kernels behind one interface (``impl=``): "torch" (the reference),
"cpp" (``overlap._C``), "triton" (``overlap.kernels.triton.quant``) and "cuda" (csrc/quant.cu);
"auto" is "cpp" on CPU tensors and "triton" on GPU tensors ("cuda" without a usable Triton).
All write the same bytes: the arithmetic of csrc/quant.cuh; values below 2^-125 read and
written as 0.
One quantization of a block with absmax M errs by at most Q(M) = M/254 + M*2^-21 + 2^-118
(stochastic rounding: 2Q); a non-finite input gets code -128, which dequantizes to NaN.

Buffers: ``q`` an int8 view [rows, row_len] and ``s`` an fp32 view [rows, row_len / block], each
with unit inner stride and any row stride (one [codes | scales] wire row per destination rank).
Row r stands for ``flat[r * flat_row : (r + 1) * flat_row]`` (``flat_row <= row_len``), the rest
zero padding; an element's noise index is its index in the flat tensor plus ``index_base``.
The narrative: docs/design/quantized.md.
"""

from __future__ import annotations

import functools

import torch

from overlap.profile import names, nvtx
from overlap.versions import triton_problem

__all__ = ["DTYPE_CODES", "IMPLS", "TINY", "resolve_impl", "triton_available", "noise_u01",
           "quantize_into", "dequantize_into", "dequant_reduce_into", "quantize", "dequantize"]

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
IMPLS = ("auto", "torch", "cpp", "triton", "cuda")
FLOAT_MAX = torch.finfo(torch.float32).max
TINY = 2.0**-125  # tz() zeroes magnitudes below this (csrc/quant.cuh kTiny)
_KEY_MASK = 0x7FFFFFFF  # keys stay int32-sized so Triton never retypes (and recompiles) them


@functools.cache
def triton_available() -> bool:
    """Whether a Triton that can run the Triton kernels is installed (overlap.versions)."""
    return triton_problem() is None


def _profiled(name: str):
    """Run the decorated kernel entry inside the profiler range ``name`` (NVTX on CUDA):
    every quantize and dequantize shows in traces under overlap.profile.names' scheme."""
    def wrap(fn):
        @functools.wraps(fn)
        def ranged(*args, **kwargs):
            with nvtx.range(name):
                return fn(*args, **kwargs)
        return ranged
    return wrap


def resolve_impl(impl: str, device: torch.device) -> str:
    """``auto`` is the C++ kernels on CPU tensors; on GPU tensors Triton, or the CUDA kernels
    where Triton is not installed."""
    if impl not in IMPLS:
        raise ValueError(f"quant kernels: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if device.type != "cuda":
            return "cpp"
        return "triton" if triton_available() else "cuda"
    if impl == "triton" and not triton_available():
        raise ValueError(f"quant kernels: impl 'triton' cannot run here: {triton_problem()}; "
                         "the kernels that work here: 'auto', 'cuda' (GPU), 'cpp' (CPU), "
                         "'torch'")
    if impl == "cpp" and device.type != "cpu":
        raise ValueError(f"quant kernels: impl 'cpp' needs CPU tensors, got {device}")
    if impl == "cuda" and device.type != "cuda":
        raise ValueError(f"quant kernels: impl 'cuda' needs CUDA tensors, got {device}")
    return impl


# ---- torch reference -------------------------------------------------------------------------

def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # (h * c) mod 2^32 in int64 without overflow: split c into 16-bit halves.
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & 0xFFFFFFFF


def noise_u01(key: int, idx: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) noise per int64 index, the same bits as csrc/quant.cuh noise_u01."""
    h = (idx & 0xFFFFFFFF) ^ (key & 0xFFFFFFFF)
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * 2.0**-24


def _tz(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t.abs() < TINY, torch.zeros_like(t), t)


def _scales_ref(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fin = xb.abs() <= FLOAT_MAX
    absmax = torch.where(fin, xb.abs(), 0.0).amax(dim=1)
    # Tensor / tensor: a division by a Python scalar may become a reciprocal multiply on GPUs.
    return fin, _tz(absmax / torch.full_like(absmax, 127.0))


def _codes_ref(xb, fin, scale, idx, stochastic: bool, key: int) -> torch.Tensor:
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    v = _tz(_tz(torch.where(fin, xb, 0.0)) / safe[:, None])
    r = torch.floor(v + noise_u01(key, idx)) if stochastic else torch.round(v)
    r = r.clamp(-127.0, 127.0)
    r = torch.where((scale > 0)[:, None], r, 0.0)
    return torch.where(fin, r, -128.0).to(torch.int8)


def _dequant_ref(qb: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    d = (qb.to(torch.float32) * _tz(scale)[:, None]).clamp(-FLOAT_MAX, FLOAT_MAX)
    return torch.where(qb == -128, float("nan"), d)


def _quantize_torch(x, q, s, block, flat_row, stochastic, key, index_base):
    rows, row_len = q.shape
    flat = torch.zeros(rows * flat_row, dtype=torch.float32, device=x.device)
    flat[: x.numel()] = x.reshape(-1).to(torch.float32)
    xf = torch.zeros(rows, row_len, dtype=torch.float32, device=x.device)
    xf[:, :flat_row] = flat.view(rows, flat_row)
    xb = xf.view(-1, block)
    fin, scale = _scales_ref(xb)
    j = torch.arange(row_len, device=x.device, dtype=torch.int64)
    idx = index_base + torch.arange(rows, device=x.device)[:, None] * flat_row + j
    q.copy_(_codes_ref(xb, fin, scale, idx.view(-1, block), stochastic, key).view(rows, row_len))
    s.copy_(scale.view(rows, -1))


def _dequantize_torch(q, s, out, block, flat_row):
    rows, row_len = q.shape
    d = _dequant_ref(q.reshape(-1, block), s.reshape(-1)).view(rows, row_len)
    out.copy_(d[:, :flat_row].reshape(-1)[: out.numel()])


def _dequant_reduce_torch(q, s, block, divisor, out, q_out, s_out, stochastic, key, index_base):
    num_src, row_len = q.shape
    acc = torch.zeros(row_len // block, block, dtype=torch.float32, device=q.device)
    for r in range(num_src):  # rank order, one rounding per add
        acc = _tz(acc + _dequant_ref(q[r].reshape(-1, block), s[r]))
    if divisor != 1:
        acc = _tz(acc / torch.full_like(acc, float(divisor)))
    if out is not None:
        out.copy_(acc.view(-1))
        return
    fin, scale = _scales_ref(acc)
    idx = index_base + torch.arange(row_len, device=q.device, dtype=torch.int64).view(-1, block)
    q_out.copy_(_codes_ref(acc, fin, scale, idx, stochastic, key).view(-1))
    s_out.copy_(scale)


# ---- dispatch --------------------------------------------------------------------------------

def _check(op: str, block: int, q: torch.Tensor, s: torch.Tensor) -> None:
    if block < 1 or block > 4096 or block & (block - 1):
        raise ValueError(f"{op}: block must be a power of two in [1, 4096], got {block}")
    if q.dtype != torch.int8 or s.dtype != torch.float32:
        raise TypeError(f"{op}: q must be int8 and s float32, got {q.dtype} and {s.dtype}")
    if q.dim() != 2 or s.dim() != 2 or q.shape[1] % block or s.shape != (q.shape[0], q.shape[1] // block):
        raise ValueError(f"{op}: q [rows, row_len] and s [rows, row_len/block] with block {block} "
                         f"do not fit: q {tuple(q.shape)}, s {tuple(s.shape)}")
    for name, t in (("q", q), ("s", s)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{op}: {name} needs unit inner stride, got strides {t.stride()}")


def _check_flat(op: str, numel: int, flat_row: int | None, q: torch.Tensor) -> int:
    rows, row_len = q.shape
    flat_row = row_len if flat_row is None else flat_row
    if not 0 <= flat_row <= row_len or numel > rows * flat_row:
        raise ValueError(f"{op}: {numel} elements do not fit {rows} rows of flat_row={flat_row} "
                         f"(row_len {row_len})")
    return flat_row


@_profiled(names.quant("quantize", "blocks"))
def quantize_into(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, *, block: int,
                  flat_row: int | None = None, stochastic: bool = False, key: int = 0,
                  index_base: int = 0, impl: str = "auto") -> None:
    """Quantize flat contiguous ``x`` (fp32/bf16/fp16) into ``q`` [rows, row_len] int8 and ``s``
    [rows, row_len // block] fp32; row r holds x[r*flat_row : (r+1)*flat_row] (default
    flat_row = row_len), zero-padded."""
    _check("quantize_into", block, q, s)
    if x.dtype not in DTYPE_CODES or not x.is_contiguous():
        raise TypeError(f"quantize_into: x must be a contiguous fp32/bf16/fp16 tensor, got "
                        f"{x.dtype}, contiguous={x.is_contiguous()}")
    flat_row = _check_flat("quantize_into", x.numel(), flat_row, q)
    key &= _KEY_MASK
    impl = resolve_impl(impl, x.device)
    if impl == "torch":
        _quantize_torch(x, q, s, block, flat_row, stochastic, key, index_base)
    elif impl in ("cpp", "cuda"):
        args = (x.data_ptr(), DTYPE_CODES[x.dtype], x.numel(), flat_row, q.shape[0], q.shape[1],
                block, q.data_ptr(), q.stride(0), s.data_ptr(), s.stride(0), stochastic, key,
                index_base)
        if impl == "cpp":
            from overlap import _C
            _C.quantize_blocks(*args, torch.get_num_threads())
        else:
            from overlap.kernels import cuda
            cuda.quantize_blocks(*args, device=x.device)
    else:
        from overlap.kernels.triton import quant as tq
        tq.quantize_into(x, q, s, block=block, flat_row=flat_row, stochastic=stochastic, key=key,
                         index_base=index_base)


@_profiled(names.quant("dequantize", "blocks"))
def dequantize_into(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor, *, block: int,
                    flat_row: int | None = None, impl: str = "auto") -> None:
    """The inverse layout of ``quantize_into``: row r of ``q``/``s`` dequantizes into the flat
    contiguous fp32 ``out[r*flat_row : (r+1)*flat_row]``, cut at ``out.numel()``."""
    _check("dequantize_into", block, q, s)
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"dequantize_into: out must be contiguous fp32, got {out.dtype}")
    flat_row = _check_flat("dequantize_into", out.numel(), flat_row, q)
    impl = resolve_impl(impl, q.device)
    if impl == "torch":
        _dequantize_torch(q, s, out, block, flat_row)
    elif impl in ("cpp", "cuda"):
        args = (q.data_ptr(), q.stride(0), s.data_ptr(), s.stride(0), q.shape[0], q.shape[1],
                block, out.data_ptr(), out.numel(), flat_row)
        if impl == "cpp":
            from overlap import _C
            _C.dequantize_blocks(*args, torch.get_num_threads())
        else:
            from overlap.kernels import cuda
            cuda.dequantize_blocks(*args, device=q.device)
    else:
        from overlap.kernels.triton import quant as tq
        tq.dequantize_into(q, s, out, block=block, flat_row=flat_row)


@_profiled(names.quant("dequantize", "reduce"))
def dequant_reduce_into(q: torch.Tensor, s: torch.Tensor, *, block: int, divisor: float = 1.0,
                        out: torch.Tensor | None = None, q_out: torch.Tensor | None = None,
                        s_out: torch.Tensor | None = None, stochastic: bool = False,
                        key: int = 0, index_base: int = 0, impl: str = "auto") -> None:
    """The reduce phase: ``acc = sum_r deq(q[r], s[r])`` in fp32, in row order, then
    ``acc / divisor`` unless divisor is 1; written as fp32 ``out`` [row_len] or requantized into
    ``q_out`` [row_len] int8 / ``s_out`` [row_len // block] fp32 (all contiguous)."""
    _check("dequant_reduce_into", block, q, s)
    if q.shape[0] < 1:
        raise ValueError("dequant_reduce_into: needs at least one source row")
    if (out is None) == (q_out is None or s_out is None):
        raise ValueError("dequant_reduce_into: give either out or (q_out, s_out)")
    row_len = q.shape[1]
    for name, t, n, dt in (("out", out, row_len, torch.float32), ("q_out", q_out, row_len, torch.int8),
                           ("s_out", s_out, row_len // block, torch.float32)):
        if t is not None and (t.dtype != dt or t.numel() != n or not t.is_contiguous()):
            raise ValueError(f"dequant_reduce_into: {name} must be contiguous {dt} with {n} "
                             f"elements, got {t.dtype} {tuple(t.shape)}")
    key &= _KEY_MASK
    impl = resolve_impl(impl, q.device)
    if impl == "torch":
        _dequant_reduce_torch(q, s, block, divisor, out, q_out, s_out, stochastic, key, index_base)
    elif impl in ("cpp", "cuda"):
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        args = (q.data_ptr(), q.stride(0), s.data_ptr(), s.stride(0), q.shape[0], row_len, block,
                float(divisor), ptr(out), ptr(q_out), ptr(s_out), stochastic, key, index_base)
        if impl == "cpp":
            from overlap import _C
            _C.dequant_reduce_blocks(*args, torch.get_num_threads())
        else:
            from overlap.kernels import cuda
            cuda.dequant_reduce_blocks(*args, device=q.device)
    else:
        from overlap.kernels.triton import quant as tq
        tq.dequant_reduce_into(q, s, block=block, divisor=divisor, out=out, q_out=q_out,
                               s_out=s_out, stochastic=stochastic, key=key, index_base=index_base)


def quantize(x: torch.Tensor, *, block: int, stochastic: bool = False, key: int = 0,
             impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize flat ``x``: returns int8 codes [ceil(numel / block) * block] (zero-padded) and
    fp32 scales [ceil(numel / block)]."""
    x = x.reshape(-1).contiguous()
    nb = -(-x.numel() // block)
    q = torch.empty(1, nb * block, dtype=torch.int8, device=x.device)
    s = torch.empty(1, nb, dtype=torch.float32, device=x.device)
    quantize_into(x, q, s, block=block, stochastic=stochastic, key=key, impl=impl)
    return q.view(-1), s.view(-1)


def dequantize(q: torch.Tensor, s: torch.Tensor, numel: int, *, block: int,
               dtype: torch.dtype = torch.float32, impl: str = "auto") -> torch.Tensor:
    """The first ``numel`` values of ``quantize``'s output, dequantized, as ``dtype``."""
    out = torch.empty(numel, dtype=torch.float32, device=q.device)
    dequantize_into(q.view(1, -1), s.view(1, -1), out, block=block, impl=impl)
    return out.to(dtype)

