"""The blockwise INT8 kernels: torch reference, C++ (overlap._C) and Triton (interpreter) must
write bit-identical codes and scales and dequantize to bit-identical values; the arithmetic
contract of csrc/quant.cuh (RNE, NaN/Inf code, zero blocks, FLT_MAX, the error bound)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from overlap.comm.quant import kernels as qk  # noqa: E402

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

BACKENDS = ("torch", "cpp", "triton")
FMAX = torch.finfo(torch.float32).max


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare floats by bits, but every NaN as one value (payloads may legitimately differ).
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(torch.int32)


def _make(kind: str, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    if kind == "huge":
        x = x * 1e37
        if numel > 3:
            x[1], x[2] = FMAX, -FMAX
    elif kind == "denormal":
        x = x * 1e-39  # fp32 subnormals; bf16 keeps some, fp16 flushes them to zero on cast
        if numel > 5:
            x[3:5] = torch.tensor([1.4e-45, -2.8e-45])
    elif kind == "special" and numel:
        idx = torch.randperm(numel, generator=g)
        x[idx[: max(1, numel // 50)]] = float("nan")
        x[idx[max(1, numel // 50): max(2, numel // 25)]] = float("inf")
        x[idx[-1]] = float("-inf")
        x[: min(numel, 64)] = 0.0  # an all-zero block
    elif kind == "mixed":
        x = x * torch.logspace(-30, 30, numel) if numel else x
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000) if kind != "special" else x
    return x.to(dtype)


def _quantize_all(x, block, **kw):
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # interpreter: NaN/overflow in numpy
        for be in BACKENDS:
            q, s = qk.quantize(x, block=block, impl=be, **kw)
            d = qk.dequantize(q, s, x.numel(), block=block, impl=be)
            out[be] = (q, s, d)
    return out


@pytest.mark.parametrize("numel", [0, 1, 7, 127, 128, 129, 1000, 2053])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["normal", "huge", "denormal", "special", "mixed"])
def test_backends_bit_identical(numel, dtype, kind):
    block = 32 if numel % 2 else 128
    x = _make(kind, numel, dtype, seed=numel)
    res = _quantize_all(x, block)
    q0, s0, d0 = res["torch"]
    assert q0.numel() == -(-numel // block) * block and s0.numel() == -(-numel // block)
    for be in ("cpp", "triton"):
        q, s, d = res[be]
        assert torch.equal(q, q0), f"{be}: codes differ at {(q != q0).nonzero()[:5].tolist()}"
        assert torch.equal(s.view(torch.int32), s0.view(torch.int32)), f"{be}: scales differ"
        assert torch.equal(_bits(d), _bits(d0)), f"{be}: dequantized values differ"


@pytest.mark.parametrize("block", [8, 64])
def test_stochastic_bit_identical_and_unbiased(block):
    x = _make("normal", 300, torch.float32, seed=3)
    res = _quantize_all(x, block, stochastic=True, key=1234)
    for be in ("cpp", "triton"):
        assert torch.equal(res[be][0], res["torch"][0]), be
    # E[deq] = x: the mean over many keys is far closer to x than one RNE step (scale / 2).
    mean = torch.stack([qk.dequantize(*qk.quantize(x, block=block, stochastic=True, key=k),
                                      300, block=block) for k in range(400)]).mean(0)
    _, s = qk.quantize(x, block=block)
    step = s.repeat_interleave(block)[:300]
    assert ((mean - x).abs() <= step * 0.2).all()


def test_wire_layout_rows_bit_identical():
    # Rows of a [rows, C] byte buffer, row r = x[r*m:(r+1)*m] padded to L: the all-reduce layout.
    block, rows, m = 32, 3, 50
    L = 64
    x = _make("special", rows * m - 7, torch.bfloat16, seed=5)
    outs = {}
    for be in BACKENDS:
        buf = torch.full((rows, L + 4 * (L // block)), 0xAB, dtype=torch.uint8)
        q, s = buf[:, :L].view(torch.int8), buf[:, L:].view(torch.float32)
        qk.quantize_into(x, q, s, block=block, flat_row=m, stochastic=be != "torch", key=9,
                         impl=be)
        back = torch.empty(x.numel())
        qk.dequantize_into(q, s, back, block=block, flat_row=m, impl=be)
        outs[be] = (buf, back)
    for be in ("cpp", "triton"):
        assert torch.equal(outs[be][0], outs["cpp"][0])
        assert torch.equal(_bits(outs[be][1]), _bits(outs["cpp"][1]))
    buf, back = outs["torch"]
    assert (buf[:, m:L] == 0).all(), "padding codes must be zero"
    fin = torch.isfinite(x.float())
    assert torch.isnan(back[~fin]).all() and torch.isfinite(back[fin]).all()


@pytest.mark.parametrize("requant", [False, True])
@pytest.mark.parametrize("divisor", [1.0, 3.0])
def test_dequant_reduce_bit_identical(requant, divisor):
    block, num_src, L = 16, 3, 96
    q = torch.randint(-128, 128, (num_src, L), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    s = torch.rand(num_src, L // block) * 10
    s[1, 2] = 0.0
    q[:, 32:48] = 0  # a block whose sum is exactly zero
    q[2, 0:16] = 127
    s[2, 0] = FMAX / 100  # sums that overflow fp32 -> NaN code after requantizing
    res = {}
    for be in BACKENDS:
        if requant:
            q_out, s_out = torch.empty(L, dtype=torch.int8), torch.empty(L // block)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                qk.dequant_reduce_into(q, s, block=block, divisor=divisor, q_out=q_out,
                                       s_out=s_out, impl=be)
            res[be] = (q_out, s_out.view(torch.int32))
        else:
            out = torch.empty(L)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                qk.dequant_reduce_into(q, s, block=block, divisor=divisor, out=out, impl=be)
            res[be] = (_bits(out),)
    for be in ("cpp", "triton"):
        for a, b in zip(res[be], res["torch"]):
            assert torch.equal(a, b), be
    if requant:
        assert (res["torch"][0][32:48] == 0).all() and res["torch"][1][2] == 0


def test_round_half_even_and_special_values():
    # absmax 127 -> scale exactly 1, so x / scale hits the ties exactly.
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -3.5])
    for be in BACKENDS:
        q, s = qk.quantize(x, block=8, impl=be)
        assert s.item() == 1.0
        assert q.tolist() == [127, 0, 2, 2, 0, -2, 126, -4], be
    z = torch.zeros(40)
    z[33] = float("nan")
    for be in BACKENDS:
        q, s = qk.quantize(z, block=32, impl=be)
        d = qk.dequantize(q, s, 40, block=32, impl=be)
        assert s.tolist() == [0.0, 0.0] and (d[:32] == 0).all()  # all-zero block: exact
        assert torch.isnan(d[33]) and (d[32] == 0) and (d[34:] == 0).all()  # NaN stays local
    big = torch.tensor([FMAX, -FMAX, 1.0, float("inf")])
    for be in BACKENDS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            d = qk.dequantize(*qk.quantize(big, block=4, impl=be), 4, block=4, impl=be)
        assert d[0] == FMAX and d[1] == -FMAX, "127 * (FLT_MAX/127) must clamp, not overflow"
        assert torch.isnan(d[3])


@pytest.mark.parametrize("kind", ["normal", "huge", "denormal", "mixed"])
def test_single_quantization_error_bound(kind):
    # |deq - x| <= Q(M) = M/254 + M*2^-21 + 2^-118 with M the block's absmax (values below 2^-125
    # count as 0 on every path, so a zero block errs by up to its absmax; see comm/quant).
    block = 64
    x = _make(kind, 4096, torch.float32, seed=11)
    d = qk.dequantize(*qk.quantize(x, block=block), x.numel(), block=block)
    M = x.double().abs().view(-1, block).amax(1).repeat_interleave(block)
    bound = M / 254 + M * 2.0**-21 + 2.0**-118
    assert ((d.double() - x.double()).abs() <= bound).all()


def test_bad_arguments():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="power of two"):
        qk.quantize(x, block=48)
    with pytest.raises(TypeError, match="fp32/bf16/fp16"):
        qk.quantize(x.double(), block=8)
    with pytest.raises(ValueError, match="impl"):
        qk.quantize(x, block=8, impl="cuda")
    q = torch.empty(2, 16, dtype=torch.int8)
    s = torch.empty(2, 2)
    with pytest.raises(ValueError, match="do not fit"):
        qk.quantize_into(torch.randn(40), q, s, block=8, flat_row=16)
    with pytest.raises(ValueError, match="either out or"):
        qk.dequant_reduce_into(q, s, block=8)
