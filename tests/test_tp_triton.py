"""Triton fused TP GEMMs (overlap.kernels.triton.tp_gemm) on 1, 2 and 4 processes under the
Triton interpreter over shared memory, against the unfused references.

References: all_gather_matmul vs all_gather(x_shard) @ w, matmul_reduce_scatter vs
reduce_scatter(x @ w) with the partials rounded to the dtype and summed in fp32. Every rank derives
every rank's inputs from a seed (phase, rank), so the references need no collective and the fused calls run back
to back with nothing in between that could hide a race; rank (phase % world) also sleeps before
some calls so the others run ahead into the double buffer.

Tolerances, against references computed in float64 from the same (rounded) inputs:
fp32 |y - ref| <= 1e-5 * max|ref| (IEEE fp32 in the kernel, only the summation order differs).
all_gather_matmul bf16 / fp16: one ulp of the output, rtol 2^-7 / 2^-10, plus atol 1e-4 * max|ref|
(fp32 accumulation). matmul_reduce_scatter bf16 / fp16: rtol 1.6e-2, atol 1e-2 * max|ref|, since
each of the world partials is rounded to the dtype (like x @ w) and may land one ulp off the
reference's.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from harness import WORLD_SIZES, gpu_world, requires_gpu, run_ranks, run_ranks_outcomes
from overlap.dist.device import gpu_for_rank
from overlap.symm.workspace import create_workspace

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
BIG = (12, 72, 40)    # (m rows per shard, K, N): M = 12 * world, nothing a multiple of a block
SMALL = (5, 24, 17)
TALL = (20, 16, 40)   # two row tiles and two column tiles per shard at the interpreter's blocks


def _inputs(phase, r, m, k, n, dtype, device, what):
    g = torch.Generator().manual_seed(7919 * phase + 104729 * r + (what == "rs"))
    world = dist.get_world_size()
    rows = m if what == "ag" else m * world
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (torch.randn(k, n, generator=g) / k ** 0.5).to(dtype).to(device)
    return x, w


def _check(y, ref, dtype, what, *, partials_rounded=False):
    ref = ref.to(y.device)
    scale = float(ref.abs().max())
    if dtype == F32:
        rtol, atol = 0.0, 1e-5 * scale
    elif partials_rounded:
        rtol, atol = 1.6e-2, 1e-2 * scale
    else:
        rtol, atol = (2.0 ** -7 if dtype == BF16 else 2.0 ** -10), 1e-4 * scale
    torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=atol,
                               msg=lambda s: f"{what}: {s}")


def _device(device):
    if device == "cuda":
        return gpu_for_rank()
    return torch.device("cpu")


def _skew(phase):
    if phase % 3 == 0 and dist.get_rank() == phase % dist.get_world_size():
        time.sleep(0.02)


def _ag_calls(cases, device="cpu"):
    from overlap.kernels.triton.tp_gemm import (all_gather_matmul,
                                                all_gather_matmul_num_signals as num_signals,
                                                all_gather_matmul_workspace_bytes as nbytes_of)

    device = _device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = max(nbytes_of(m, k, world, dt) for (m, k, n), dt, _ in cases)
    outs = []
    with create_workspace(dist.group.WORLD, nbytes, num_signals=num_signals(world),
                          device=device, timeout=30) as ws:
        for phase, ((m, k, n), dt, gathered) in enumerate(cases, start=1):
            x, w = _inputs(phase, rank, m, k, n, dt, device, "ag")
            _skew(phase)
            outs.append((phase, all_gather_matmul(ws, x, w, phase=phase, return_gathered=gathered)))
        ws.barrier()  # peers may still read our buffer until they are done too
    for (phase, (y, g)), ((m, k, n), dt, gathered) in zip(outs, cases):
        xs = [_inputs(phase, s, m, k, n, dt, device, "ag")[0] for s in range(world)]
        w = _inputs(phase, rank, m, k, n, dt, device, "ag")[1]
        full = torch.cat(xs)
        _check(y, (full.double() @ w.double()).to(dt), dt, f"all_gather_matmul phase {phase} {dt}")
        assert (g is None) != gathered and (g is None or torch.equal(g, full)), phase
    return len(outs)


def _rs_calls(cases, device="cpu"):
    from overlap.kernels.triton.tp_gemm import (matmul_reduce_scatter,
                                                matmul_reduce_scatter_num_signals as num_signals,
                                                matmul_reduce_scatter_workspace_bytes as nbytes_of)

    device = _device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = max(nbytes_of(m, n, world, dt) for (m, k, n), dt in cases)
    outs = []
    with create_workspace(dist.group.WORLD, nbytes, num_signals=num_signals(world),
                          device=device, timeout=30) as ws:
        for phase, ((m, k, n), dt) in enumerate(cases, start=1):
            x, w = _inputs(phase, rank, m, k, n, dt, device, "rs")
            _skew(phase)
            outs.append((phase, matmul_reduce_scatter(ws, x, w, phase=phase)))
        ws.barrier()
    for (phase, y), ((m, k, n), dt) in zip(outs, cases):
        ref = torch.zeros(m, n, dtype=torch.float64, device=device)
        for s in range(world):  # each source's partial rounded to dt, as x @ w would be
            x, w = _inputs(phase, s, m, k, n, dt, device, "rs")
            ref += (x[rank * m:(rank + 1) * m].double() @ w.double()).to(dt).double()
        _check(y, ref.to(dt), dt, f"matmul_reduce_scatter phase {phase} {dt}",
               partials_rounded=True)
    return len(outs)


def _cases(world):
    # Phases back to back on one workspace, shapes and dtypes changing between calls. World 4
    # gets fewer calls: the interpreter runs 4 ranks on 2 cores.
    if world == 4:
        return [(BIG, F32), (SMALL, F32), (BIG, BF16), (TALL, F32)]
    return [(BIG, F32), (SMALL, F32), (TALL, F32), (BIG, BF16), (SMALL, F16), (TALL, BF16)]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_gather_matmul_matches_all_gather_then_matmul(world):
    cases = [(shape, dt, i % 2 == 0) for i, (shape, dt) in enumerate(_cases(world))]
    assert run_ranks(_ag_calls, world, cases) == [len(cases)] * world


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matmul_reduce_scatter_matches_matmul_then_reduce_scatter(world):
    cases = _cases(world)
    assert run_ranks(_rs_calls, world, cases) == [len(cases)] * world


def _mlp(num_steps):
    # The TP MLP pattern: column-parallel all_gather_matmul feeding row-parallel
    # matmul_reduce_scatter, each op on its own workspace, steps back to back.
    from overlap.kernels.triton import tp_gemm as tp

    rank, world = dist.get_rank(), dist.get_world_size()
    m, d, f = 6, 20, 24  # f features per rank
    g = dist.group.WORLD
    errs = []
    with create_workspace(g, tp.all_gather_matmul_workspace_bytes(m, d, world, F32),
                          num_signals=tp.all_gather_matmul_num_signals(world),
                          timeout=30) as ws_ag, \
            create_workspace(g, tp.matmul_reduce_scatter_workspace_bytes(m, d, world, F32),
                             num_signals=tp.matmul_reduce_scatter_num_signals(world),
                             timeout=30) as ws_rs:
        for step in range(1, num_steps + 1):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(world * m, d, generator=gen)
            w1 = torch.randn(world, d, f, generator=gen)
            w2 = torch.randn(world, f, d, generator=gen)
            h, _ = tp.all_gather_matmul(ws_ag, x[rank * m:(rank + 1) * m], w1[rank], phase=step)
            y = tp.matmul_reduce_scatter(ws_rs, h, w2[rank], phase=step)
            ref = sum((x.double() @ w1[s].double()).float().double() @ w2[s].double()
                      for s in range(world))[rank * m:(rank + 1) * m]
            errs.append(float((y.double() - ref).abs().max() / ref.abs().max()))
        ws_ag.barrier()
        ws_rs.barrier()
    return max(errs)


def test_column_then_row_parallel_back_to_back():
    assert max(run_ranks(_mlp, 2, 3)) < 1e-5


def _bad_inputs():
    from overlap.kernels.triton import tp_gemm as tp

    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    with create_workspace(g, 256, num_signals=2 * world) as ws:
        need = tp.all_gather_matmul_workspace_bytes(16, 8, world, F32)
        with pytest.raises(ValueError, match=rf"all_gather_matmul: .* has 256 bytes but .* "
                                             rf"needs {need} \(rank {rank}\)"):
            tp.all_gather_matmul(ws, torch.randn(16, 8), w, phase=1)
        need = tp.matmul_reduce_scatter_workspace_bytes(8, 6, world, F32)
        with pytest.raises(ValueError, match=rf"matmul_reduce_scatter: .* has 256 bytes but .* "
                                             rf"needs {need} \(rank {rank}\)"):
            tp.matmul_reduce_scatter(ws, torch.randn(8 * world, 8), w, phase=1)
        with pytest.raises(ValueError, match="matmul_reduce_scatter: x has M=.* multiple of 2"):
            tp.matmul_reduce_scatter(ws, torch.randn(5, 8), w, phase=1)
        with pytest.raises(ValueError, match=r"w must be \[K=8, N\]"):
            tp.all_gather_matmul(ws, x, torch.randn(7, 6), phase=1)
        with pytest.raises(TypeError, match="inputs must share one dtype"):
            tp.all_gather_matmul(ws, x, w.double(), phase=1)
        with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
            tp.all_gather_matmul(ws, x.double(), w.double(), phase=1)
    with create_workspace(g, 4096, num_signals=2 * world - 1) as ws:
        with pytest.raises(ValueError,
                           match=rf"has {2 * world - 1} signals but all_gather_matmul needs"):
            tp.all_gather_matmul(ws, x, w, phase=1)
    with create_workspace(g, 4096, num_signals=2 * world, timeout=20) as ws:
        with pytest.raises(ValueError, match="phase must be a positive int"):
            tp.all_gather_matmul(ws, x, w, phase=0)
        y1, _ = tp.all_gather_matmul(ws, x, w, phase=1)
        with pytest.raises(ValueError, match="phase must increase .* got 1 after 1"):
            tp.all_gather_matmul(ws, x, w, phase=1)
        with pytest.raises(ValueError, match="already serves all_gather_matmul"):
            tp.matmul_reduce_scatter(ws, torch.randn(2 * world, 8), w, phase=2)
        ws.barrier()
    return float((y1[rank * 4:(rank + 1) * 4] - x @ w).abs().max())


def test_bad_inputs_raise_before_any_signal():
    assert max(run_ranks(_bad_inputs, 2)) < 1e-5


def _absent_peer():
    from overlap.kernels.triton import tp_gemm as tp

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        nbytes = max(tp.all_gather_matmul_workspace_bytes(4, 8, world, F32),
                     tp.matmul_reduce_scatter_workspace_bytes(4, 6, world, F32))
        with create_workspace(dist.group.WORLD, nbytes, num_signals=2 * world, timeout=20) as ws:
            if rank == 1:  # never arrives, but stays alive for the barrier
                dist.barrier()
                out.append("absent")
                continue
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=rf"{op}: rank 0 of group .* at phase 1 "
                                                   r"waiting on signal slot 1 \(ready flag of "
                                                   r"source rank 1"):
                if op == "all_gather_matmul":
                    tp.all_gather_matmul(ws, torch.randn(4, 8), torch.randn(8, 6), phase=1,
                                         timeout=0.3)
                else:  # the deferred check: the call returns, check_pending raises
                    tp.matmul_reduce_scatter(ws, torch.randn(4 * world, 8), torch.randn(8, 6),
                                             phase=1, timeout=0.3, sync=False)
                    tp.check_pending(ws)
            out.append(time.monotonic() - t0)
            dist.barrier()
    return out


def test_absent_peer_times_out():
    outcomes = run_ranks_outcomes(_absent_peer, 2, timeout=60)
    assert [o.status for o in outcomes] == ["ok", "ok"], [o.error for o in outcomes]
    assert outcomes[1].value == ["absent", "absent"]
    # Within the 0.3 s spin budget (plus interpreter slack), not the workspace's 20 s timeout.
    assert max(outcomes[0].value) < 15


def _lost_ack():
    # A consumer that never acknowledges (here: its ack is rewound) blocks the producer from
    # reusing the buffer, and the producer reports the ack slot.
    from overlap.kernels.triton import tp_gemm as tp

    x, w = torch.randn(3, 8), torch.randn(8, 5)
    with create_workspace(dist.group.WORLD, 4096, num_signals=2) as ws:
        y, _ = tp.all_gather_matmul(ws, x, w, phase=1)
        y, _ = tp.all_gather_matmul(ws, 2 * x, w, phase=2)
        ws.signal(0, slot=1, value=0)
        with pytest.raises(TimeoutError, match=r"all_gather_matmul: rank 0 .* phase 3 waiting on "
                                               r"signal slot 1 \(ack of consumer rank 0: .* "
                                               r"buffer 1 "
                                               r"from phase 1\): wanted >= 1, last saw 0"):
            tp.all_gather_matmul(ws, x, w, phase=3, timeout=0.2)
        return float((y - (2 * x) @ w).abs().max())


def test_missing_ack_times_out():
    assert run_ranks(_lost_ack, 1)[0] < 1e-5


# Compiles every kernel for sm_80 and sm_90 with Triton's own ptxas (no GPU needed): the
# interpreter cannot catch what only the GPU compiler checks (IR types of atomics, inline asm,
# dot shapes). Launch-time specialisation is mimicked: pointers and sizes divisible by 16,
# unit strides constant. One dtype per arch keeps it to a few seconds (cached by Triton).
_COMPILE = textwrap.dedent("""
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from overlap.kernels.triton import all_gather_matmul as ag, matmul_reduce_scatter as rs

    out = {}
    for cc, dt in ((80, "fp32"), (90, "bf16")):
        p, bk = "*" + dt, 32 if dt == "fp32" else 64
        ints = {"phase": "i64", "ack_phase": "i64", "max_spins": "i64", "timeout_ns": "i64",
                "buf_off": "i64"}
        ptrs = {"data_table": "*i64", "flag_table": "*i64", "counter_ptr": "*i32",
                "status_ptr": "*i64"}
        gemm = dict(BM=128, BN=128, BK=bk, CAST_F32=False, SOFT_BF16=False, USE_CLOCK=True)
        jobs = [(ag._ag_publish_kernel, {"x_ptr": p}, dict(BLOCK=4096, USE_CLOCK=True)),
                (ag._all_gather_matmul_kernel, {"w_ptr": p, "y_ptr": p, "g_ptr": p},
                 dict(gemm, RETURN_GATHERED=True)),
                (rs._matmul_reduce_scatter_kernel, {"x_ptr": p, "w_ptr": p}, gemm),
                (rs._reduce_kernel, {"y_ptr": p}, dict(BLOCK=4096, SOFT_BF16=False,
                                                     USE_CLOCK=True))]
        for fn, types, consts in jobs:
            types = {**ptrs, **ints, **types}
            consts = {**consts, **{a: 1 for a in ("stride_wn", "stride_xk") if a in fn.arg_names}}
            sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                     if a not in consts and (sig[a].startswith("*") or a in (
                         "m", "N", "K", "stride_xm", "stride_wk", "numel", "buf_off"))}
            k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", cc, 32),
                               options={"num_warps": 8, "num_stages": 3})
            out[f"sm_{cc} {fn.__name__}"] = k.asm["ptx"]
    json.dump(out, sys.stdout)
""")


def test_kernels_compile_for_sm80_and_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler")
    import json

    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    ptx = json.loads(run.stdout)
    assert len(ptx) == 8
    for name, code in ptx.items():
        assert "globaltimer" in code, name  # waits bounded by the GPU clock
        # tp_sync's atomic add of 0 is lowered to a plain load with the same ordering (a flag:
        # acquire, a status word: relaxed, both at system scope); the publish is a release
        # exchange at system scope. Triton 3.4 lowers them the same way.
        assert "ld.global.sys.acquire.b64" in code and "ld.global.sys.relaxed.b64" in code, name
        assert "atom.global.sys.release.exch.b64" in code, name
    # The peer loads and stores are vectorised (the alignment hint on raw addresses works).
    assert "cp.async" in ptx["sm_90 _all_gather_matmul_kernel"]


GPU_CASES = [((256, 512, 384), F32), ((256, 512, 384), BF16), ((100, 264, 200), BF16),
             ((128, 1024, 512), F16)]


@requires_gpu
def test_all_gather_matmul_gpu():
    """The CUDA twin of test_all_gather_matmul_matches_all_gather_then_matmul, at tensor-core
    sizes."""
    world = gpu_world()
    cases = [(shape, dt, True) for shape, dt in GPU_CASES] * 2
    assert run_ranks(_ag_calls, world, cases, "cuda", backend="nccl") == [len(cases)] * world


@requires_gpu
def test_matmul_reduce_scatter_gpu():
    """The CUDA twin of test_matmul_reduce_scatter_matches_matmul_then_reduce_scatter."""
    world = gpu_world()
    cases = GPU_CASES * 2
    assert run_ranks(_rs_calls, world, cases, "cuda", backend="nccl") == [len(cases)] * world
