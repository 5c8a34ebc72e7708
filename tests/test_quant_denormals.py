"""Tiny and subnormal values in the INT8 kernels: every implementation writes the bytes a GPU
running with flush-to-zero (FTZ) writes, and the documented error bound holds.

Compiled GPU code may flush subnormals (cupy compiles csrc/quant.cu with -ftz=true; libdevice's
div_rn follows the FTZ flag). The contract (csrc/quant.cuh) zeroes every magnitude below 2^-125
at the points where a subnormal could appear, so the result cannot depend on the denormal mode.
The oracle here emulates an FTZ device op by op: each fp32 operation reads subnormal operands as
0 and writes subnormal results as 0. Before the contract had its tiny-to-zero rule, the CPU kept
subnormal scales and sums, and these tests failed.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from overlap.comm.quant import kernels as qk  # noqa: E402

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

IMPLS = ("torch", "cpp", "triton")
F32 = torch.float32
TINY = 2.0**-125  # the contract's cut (csrc/quant.cuh kTiny)
FLT_MIN = 2.0**-126
FMAX = torch.finfo(F32).max
MAGIC = 12582912.0


# ---- an FTZ device running the contract, op by op ------------------------------------------

def _ftz(t: torch.Tensor) -> torch.Tensor:
    """What FTZ hardware does to an operand or a result: subnormal -> 0 (sign kept)."""
    return torch.where(t.abs() < FLT_MIN, t * 0.0, t)


def _op(fn, *args):
    return _ftz(fn(*(_ftz(a) if isinstance(a, torch.Tensor) else a for a in args)))


def _tz(t: torch.Tensor) -> torch.Tensor:
    # A select on a compare: an FTZ compare reads a subnormal as 0, which is below the cut too.
    return torch.where(_ftz(t).abs() < TINY, torch.zeros_like(t), t)


def _full(t, v):
    return torch.full_like(t, v)


def _ftz_quantize(xb: torch.Tensor, stochastic=False, noise=None):
    """xb [blocks, block] fp32 -> (codes int8, scales fp32) as an FTZ device computes them."""
    fin = xb.abs() <= FMAX
    absmax = _op(torch.abs, torch.where(fin, xb, 0.0)).amax(dim=1)  # max of flushed values
    scale = _tz(_op(torch.div, absmax, _full(absmax, 127.0)))
    xz = _tz(torch.where(fin, xb, 0.0))
    safe = torch.where(scale > 0, scale, 1.0)[:, None].expand_as(xb)
    v = _tz(_op(torch.div, xz, safe))
    if stochastic:
        r = torch.floor(_op(torch.add, v, noise))
    else:
        r = _op(torch.sub, _op(torch.add, v, _full(v, MAGIC)), _full(v, MAGIC))
    r = r.clamp(-127.0, 127.0)
    r = torch.where((scale > 0)[:, None], r, 0.0)
    return torch.where(fin, r, -128.0).to(torch.int8), scale


def _ftz_dequant(qb: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = _tz(scale)[:, None].expand(qb.shape)
    d = _op(torch.mul, qb.to(F32), s).clamp(-FMAX, FMAX)
    return torch.where(qb == -128, float("nan"), d)


def _ftz_reduce(q, s, block, divisor):
    acc = _ftz_dequant(q[0].view(-1, block), s[0])
    for r in range(1, q.shape[0]):
        acc = _tz(_op(torch.add, acc, _ftz_dequant(q[r].view(-1, block), s[r])))
    if divisor != 1:
        acc = _tz(_op(torch.div, acc, _full(acc, float(divisor))))
    return acc


# ---- inputs ---------------------------------------------------------------------------------

def _tiny_blocks(block: int) -> torch.Tensor:
    """One block per case: absmax subnormal, at and around the zero-block cut (127 * 2^-125) and
    FLT_MIN, and normal blocks that hold subnormal elements or have a scale near the cut."""
    g = torch.Generator().manual_seed(7)
    cut = 127 * TINY
    maxima = [1e-40, 1e-39, FLT_MIN, 2.0**-149, FLT_MIN * 1.5, 2 * FLT_MIN, cut,
              float(torch.tensor(cut).nextafter(torch.tensor(0.0))), cut * 1.01, 127 * FLT_MIN,
              3e-36, 1e-30, 1.0]
    rows = []
    for m in maxima:
        x = torch.rand(block, generator=g) * 2 - 1
        x = x / x.abs().max() * m
        x[1] = -m
        x[2] = 2.0**-149 * (1 if m > 1e-35 else -1)   # a subnormal next to a normal maximum
        x[3] = -1.5 * FLT_MIN
        x[4] = 0.75 * m if m < 1e-30 else 1e-39       # lands near the rounding threshold
        rows.append(x.to(F32).clamp(-m, m))
    return torch.stack(rows).reshape(-1)


def _run(impl, fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(impl)


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("block", [8, 32])
@pytest.mark.parametrize("stochastic", [False, True])
def test_tiny_blocks_match_an_ftz_device(block, stochastic):
    x = _tiny_blocks(block)
    key = 99
    idx = torch.arange(x.numel(), dtype=torch.int64).view(-1, block)
    want_q, want_s = _ftz_quantize(x.view(-1, block), stochastic, qk.noise_u01(key, idx))
    want_d = _ftz_dequant(want_q, want_s).reshape(-1)
    for impl in IMPLS:
        q, s = _run(impl, lambda i: qk.quantize(x, block=block, stochastic=stochastic, key=key,
                                                impl=i))
        d = _run(impl, lambda i: qk.dequantize(q, s, x.numel(), block=block, impl=i))
        assert torch.equal(_bits(s), _bits(want_s)), (impl, s.tolist(), want_s.tolist())
        assert torch.equal(q, want_q.reshape(-1)), (impl, (q != want_q.reshape(-1)).nonzero())
        assert torch.equal(_bits(d), _bits(want_d)), impl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_blocks_and_no_subnormal_output(dtype):
    block = 16
    x = _tiny_blocks(block).to(dtype)
    M = x.float().abs().view(-1, block).amax(1)
    for impl in IMPLS:
        q, s = _run(impl, lambda i: qk.quantize(x, block=block, impl=i))
        d = _run(impl, lambda i: qk.dequantize(q, s, x.numel(), block=block, impl=i))
        zero = M < 127 * TINY
        assert zero.any() and (~zero).any()
        assert (s[zero] == 0).all() and (s[~zero] >= TINY).all(), impl
        assert (q.view(-1, block)[zero] == 0).all(), impl
        assert not ((d != 0) & (d.abs() < FLT_MIN)).any(), f"{impl}: subnormal output"


def test_documented_bound_for_tiny_blocks():
    # Q(M) = M/254 + M*2^-21 + 2^-118 (overlap/comm/quant/kernels.py), stochastic 2Q.
    block = 32
    x = _tiny_blocks(block)
    M = x.double().abs().view(-1, block).amax(1).repeat_interleave(block)
    for stochastic in (False, True):
        q, s = qk.quantize(x, block=block, stochastic=stochastic, key=5)
        d = qk.dequantize(q, s, x.numel(), block=block)
        bound = (M / 254 + M * 2.0**-21 + 2.0**-118) * (2 if stochastic else 1)
        assert ((d.double() - x.double()).abs() <= bound).all(), stochastic


def _cancelling_rows(n, block):
    """n sources whose dequantized values cancel to subnormal partial sums."""
    base = torch.zeros(n, 4 * block, dtype=F32)
    base[0, :block] = 1.5 * FLT_MIN * 127  # scale 1.5 * 2^-126: code 127 -> 127 * scale
    base[1, :block] = -1.25 * FLT_MIN * 127
    base[0, block:2 * block] = 3 * FLT_MIN * 127
    base[1, block:2 * block] = -3 * FLT_MIN * 127 + 2.0**-140
    g = torch.Generator().manual_seed(3)
    base[:, 2 * block:] = torch.randn(n, 2 * block, generator=g) * 1e-36
    base[:, 3 * block] = 3e-36 * (-1) ** torch.arange(n)
    return base


@pytest.mark.parametrize("divisor", [1.0, 3.0])
@pytest.mark.parametrize("requant", [False, True])
def test_reduce_of_tiny_sums_matches_an_ftz_device(divisor, requant):
    n, block = 3, 16
    xs = _cancelling_rows(n, block)
    q, s = qk.quantize(xs.reshape(-1), block=block)  # one row per source, blocks never straddle
    q, s = q.view(n, -1), s.view(n, -1)
    want = _ftz_reduce(q, s, block, divisor)
    want_q, want_s = _ftz_quantize(want)
    for impl in IMPLS:
        L = q.shape[1]
        if requant:
            q_out = torch.empty(L, dtype=torch.int8)
            s_out = torch.empty(L // block)
            _run(impl, lambda i: qk.dequant_reduce_into(q, s, block=block, divisor=divisor,
                                                        q_out=q_out, s_out=s_out, impl=i))
            assert torch.equal(q_out, want_q.reshape(-1)), impl
            assert torch.equal(_bits(s_out), _bits(want_s)), impl
        else:
            out = torch.empty(L)
            _run(impl, lambda i: qk.dequant_reduce_into(q, s, block=block, divisor=divisor,
                                                        out=out, impl=i))
            assert torch.equal(_bits(out), _bits(want.reshape(-1))), impl
            assert not ((out != 0) & (out.abs() < FLT_MIN)).any(), impl


@pytest.mark.parametrize("avg", [False, True])
def test_all_reduce_bound_with_tiny_blocks(avg):
    """The all-reduce pipeline (quantize, reduce + requantize, dequantize) on the kernels, with
    the bound of overlap/comm/quant: sum_r Q(M_r) + n 2^-23 S + Q(S (1 + 2^-7) + n 2^-118),
    for avg divided by n plus 2^-23 S / n + 2^-117."""
    n, block = 3, 16
    xs = _cancelling_rows(n, block)
    q, s = qk.quantize(xs.reshape(-1), block=block)
    q, s = q.view(n, -1), s.view(n, -1)
    q_out = torch.empty(q.shape[1], dtype=torch.int8)
    s_out = torch.empty(q.shape[1] // block)
    qk.dequant_reduce_into(q, s, block=block, divisor=n if avg else 1, q_out=q_out, s_out=s_out)
    got = qk.dequantize(q_out, s_out, q.shape[1], block=block).double()
    x64 = xs.double()
    M = x64.abs().view(n, -1, block).amax(-1).repeat_interleave(block, -1)
    S = M.sum(0)

    def Q(m):
        return m / 254 + m * 2.0**-21 + 2.0**-118

    b = Q(M).sum(0) + n * 2.0**-23 * S + Q(S * (1 + 2.0**-7) + n * 2.0**-118)
    if avg:
        b = b / n + 2.0**-23 * S / n + 2.0**-117
    exact = x64.sum(0) / (n if avg else 1)
    assert ((got - exact).abs() <= b).all()
