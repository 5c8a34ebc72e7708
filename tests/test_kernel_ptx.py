"""What Triton's compiler makes of the INT8 kernels and the fused GEMMs' tiles, on this machine
without a GPU (docs/design/kernels.md): the launches the host picks for the quantized
collectives' layouts, compiled for sm_90 with the runtime's own argument specialisation, move
their bulk data with vector (64/128-bit) global loads and stores, not 1- and 2-byte ones; and
every tile of gemm_blocks' per-arch table fits the arch's shared memory as Triton allocates it.
One child process with TRITON_INTERPRET=0 compiles everything (a few seconds, cached by Triton).
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from overlap.kernels import compile_check
from overlap.kernels.triton import tp_sync
from overlap.kernels.triton.spec import CUDA

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

ROOT = Path(__file__).resolve().parent.parent
N = 1 << 24  # elements of the flat INT8 cases; any multiple of the tile gives the same code
RANKS = 8

# The host's launches are captured (meta tensors: nothing is allocated or run), then compiled
# as JITFunction.run would: its native specialisation of every argument (16-byte alignment of
# pointers and of integers, integers equal to 1 as constants), for sm_90.
_PROBE = textwrap.dedent("""
    import json, sys, traceback
    import torch, triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from overlap.kernels.triton import quant, matmul_reduce_scatter as rs

    N, RANKS, BLOCK = int(sys.argv[1]), int(sys.argv[2]), 128

    def compile_(fn, values, meta, arch):
        backend = make_backend(GPUTarget("cuda", arch, 32))
        consts = {k: v for k, v in meta.items() if k in fn.arg_names}
        options = {k: v for k, v in meta.items() if k not in fn.arg_names}
        sig, attrs = {}, {}
        for i, p in enumerate(fn.params):
            if p.name in consts:
                sig[p.name] = "constexpr"
                continue
            ty, key = native_specialize_impl(type(backend), values[p.name], False,
                                             not p.do_not_specialize, True)
            sig[p.name] = ty
            if ty == "constexpr":
                consts[p.name] = key
            elif isinstance(key, str) and key:
                attrs[(i,)] = backend.parse_attr(key)
        return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)

    launches = []

    class Capture:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **meta):
                names = [n for n in self.fn.arg_names if n not in meta]
                launches.append((self.fn, dict(zip(names, args)), meta))
            return launch

    for name in ("_quantize_kernel", "_dequantize_kernel", "_dequant_reduce_kernel"):
        setattr(quant, name, Capture(getattr(quant, name)))

    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    out = {"int8": {}, "gemm": {}}
    # quantize() / dequantize(): one row of codes for a flat tensor.
    q, s = meta(1, N, dtype=torch.int8), meta(1, N // BLOCK)
    quant.quantize_into(meta(N, dtype=torch.bfloat16), q, s, block=BLOCK, flat_row=N)
    quant.dequantize_into(q, s, meta(N), block=BLOCK, flat_row=N)
    # The all-reduce's reduce phase: RANKS stamped wire rows [codes | scales | stamp].
    m = N // RANKS
    wire = meta(RANKS, m + 4 * (m // BLOCK) + 88, dtype=torch.uint8)
    q, s = wire[:, :m].view(torch.int8), wire[:, m:m + 4 * (m // BLOCK)].view(torch.float32)
    quant.dequant_reduce_into(q, s, block=BLOCK, divisor=1.0, out=meta(m))
    # ... and its first phase: quantize x into those rows, dequantize the gathered ones.
    quant.quantize_into(meta(N, dtype=torch.bfloat16), q, s, block=BLOCK, flat_row=m)
    quant.dequantize_into(q, s, meta(N), block=BLOCK, flat_row=m)
    cases = ["quantize flat", "dequantize flat", "dequant_reduce wire", "quantize wire",
             "dequantize wire"]
    for case, (fn, values, m_) in zip(cases, launches):
        k = compile_(fn, values, m_, 90)
        out["int8"][case] = k.asm["ptx"]

    # The fused GEMM with the most shared memory: reduce-scatter (it stages x and w tiles),
    # at each arch's largest tile, for a large problem (16384 x 8192 x 2048 on RANKS ranks).
    # A failure here is reported to the GEMM test, not to the INT8 ones.
    try:
        from overlap.kernels.triton.tp_sync import gemm_tiles

        for arch, compile_for in ((90, 90), (80, 80), (None, 86)):
            for dtype in ("bf16", "fp32"):
                dt = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype])
                t = max(gemm_tiles(arch, dt),
                        key=lambda b: (b.bm * b.bk + b.bk * b.bn) * b.num_stages)
                M, Nn, K = 16384 // RANKS, 8192, 2048
                values = dict(x_ptr=meta(M, K, dtype=dt), w_ptr=meta(K, Nn, dtype=dt),
                              data_table=meta(RANKS, dtype=torch.int64),
                              flag_table=meta(RANKS, dtype=torch.int64),
                              counter_ptr=meta(RANKS + 1, dtype=torch.int32),
                              status_ptr=meta(4, dtype=torch.int64), rank=3, world=RANKS,
                              m=M, N=Nn, K=K, stride_xm=K, stride_xk=1, stride_wk=Nn,
                              stride_wn=1, buf_off=0, phase=5, ack_phase=3, max_spins=7,
                              timeout_ns=10**9)
                k = compile_(rs._matmul_reduce_scatter_kernel, values,
                             rs._gemm_meta(t, dt, True), compile_for)
                out["gemm"][f"{arch} {dtype}"] = [compile_for, k.metadata.shared, t.bm, t.bn,
                                                  t.bk, t.num_stages]
    except Exception:
        out["gemm_error"] = traceback.format_exc()
    json.dump(out, sys.stdout)
""")


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", _PROBE, str(N), str(RANKS)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout)


_GLOBAL = re.compile(r"\b(ld|st)\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bsuf](\d+)\b")


def _vector_bytes(ptx: str) -> dict:
    """Per thread: bytes that the vector (vN) global loads and stores of the PTX move, and the
    widest access of each."""
    got = {"ld": 0, "st": 0, "ld_max": 0, "st_max": 0}
    for op, vec, bits in _GLOBAL.findall(ptx):
        width = int(vec or 1) * int(bits) // 8
        if vec:
            got[op] += width
        got[f"{op}_max"] = max(got[f"{op}_max"], width)
    return got


def _threads(ptx: str) -> int:
    return int(re.search(r"\.(?:reqntid|maxntid)\s+(\d+)", ptx).group(1))


TILE = 4096  # elements per program (quant._TILE)
# case: (bytes per element read, written; widest load, store in bytes). The flat rows are
# 16-byte aligned, the wire rows (a stamp of 88 bytes after the payload) only 8.
CASES = {
    "quantize flat": (2, 1, 16, 16),
    "dequantize flat": (1, 4, 16, 16),
    "dequant_reduce wire": (1, 4, 8, 16),
    "quantize wire": (2, 1, 16, 8),
    "dequantize wire": (1, 4, 8, 16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_int8_kernels_move_their_tiles_with_vector_accesses(compiled, case):
    """The loads of the input and the stores of the output of a whole tile fit in the vector
    accesses of one thread (a masked branch for the program at the end may stay scalar)."""
    ptx = compiled["int8"][case]
    per_in, per_out, widest_ld, widest_st = CASES[case]
    threads = _threads(ptx)
    got = _vector_bytes(ptx)
    assert got["ld"] >= TILE * per_in // threads, f"{case}: vector loads {got}, PTX scalar"
    assert got["st"] >= TILE * per_out // threads, f"{case}: vector stores {got}"
    assert (got["ld_max"], got["st_max"]) == (widest_ld, widest_st), (case, got)


def test_gemm_tiles_fit_shared_memory_as_compiled(compiled):
    assert "gemm_error" not in compiled, compiled.get("gemm_error")
    assert len(compiled["gemm"]) == 6
    for key, (arch, shared, bm, bn, bk, stages) in compiled["gemm"].items():
        limit = compile_check.SHARED_PER_BLOCK[arch]
        assert shared <= limit, f"{key}: {bm}x{bn}x{bk} s{stages} needs {shared} > {limit}"
        assert shared > 0


def _smem(t, dtype: torch.dtype) -> int:
    return (t.bm * t.bk + t.bk * t.bn) * dtype.itemsize * t.num_stages


BF16, F32 = torch.bfloat16, torch.float32


def test_gemm_tile_table():
    """Large bf16 problems get the tiles of Triton's matmul tutorials on each arch; small ones
    shrink; fp32 halves K; every row fits its arch's shared memory; the interpreter's tiles
    and a GPU without a row of its own are as documented."""
    gemm_blocks, gemm_tiles = tp_sync.gemm_blocks, tp_sync.gemm_tiles
    big = [(8192, 8192, 8192), (16384 // RANKS, 8192, 2048)]
    for m, n, k in big:
        t = gemm_blocks(m, n, k, BF16, CUDA, arch=90)
        assert (t.bm, t.bn, t.bk, t.num_warps, t.num_stages) == (128, 256, 64, 8, 3)
        t = gemm_blocks(m, n, k, BF16, CUDA, arch=80)
        assert (t.bm, t.bn, t.bk, t.num_warps, t.num_stages) == (128, 128, 32, 4, 4)
        t = gemm_blocks(m, n, k, F32, CUDA, arch=90)
        assert (t.bm, t.bn, t.bk) == (128, 128, 32)
    small = gemm_blocks(40, 24, 8, BF16, CUDA, arch=90)
    assert (small.bm, small.bn, small.bk) == (64, 32, 16)
    # Too few 128x256 tiles to fill the SMs: the next row, then shrunk.
    mid = gemm_blocks(512, 1024, 4096, BF16, CUDA, arch=90)
    assert (mid.bm, mid.bn, mid.bk) == (64, 128, 64)
    assert gemm_blocks(8192, 8192, 8192, BF16, CUDA, arch=86) == gemm_tiles(None, BF16)[0]
    interp = gemm_blocks(8192, 8192, 8192, BF16, torch.device("cpu"))
    assert (interp.bm, interp.bn, interp.bk, interp.num_warps) == (16, 32, 32, 1)
    for arch, (_, rows) in tp_sync.GEMM_TILES.items():
        for itemsize, tiles in rows.items():
            dtype = BF16 if itemsize == 2 else F32
            for t in tiles:
                assert _smem(t, dtype) <= tp_sync.GEMM_SHARED_LIMIT[arch], (arch, t)
