"""Triton fused TP GEMMs (overlap.kernels.triton.tp_gemm) on 1, 2 and 4 processes under the
Triton interpreter over shared memory, against the unfused references.

References: ag_gemm vs all_gather(x_shard) @ w, gemm_rs vs reduce_scatter(x @ w) with the
partials rounded to the dtype and summed in fp32. Every rank derives every rank's inputs from a
seed (phase, rank), so the references need no collective and the fused calls run back to back
with nothing in between that could hide a race; rank (phase % world) also sleeps before some
calls so the others run ahead into the double buffer.

Tolerances: fp32 |y - ref| <= 1e-5 * max|ref| (IEEE fp32 in the kernel, only the summation
order differs); bf16 / fp16 rtol 1.6e-2 (one bf16 ulp is 2^-8 = 3.9e-3) and atol 1e-2 * max|ref|.
"""

import time

import pytest
import torch
import torch.distributed as dist

from harness import WORLD_SIZES, requires_gpu, run_ranks, run_ranks_outcomes
from overlap.symm.workspace import create_workspace

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
BIG = (12, 72, 40)    # (m rows per shard, K, N): M = 12 * world, nothing a multiple of a block
SMALL = (5, 24, 17)


def _inputs(phase, r, m, k, n, dtype, device, what):
    g = torch.Generator().manual_seed(7919 * phase + 104729 * r + (what == "rs"))
    world = dist.get_world_size()
    rows = m if what == "ag" else m * world
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (torch.randn(k, n, generator=g) / k ** 0.5).to(dtype).to(device)
    return x, w


def _check(y, ref, dtype, what):
    ref = ref.to(y.device)
    scale = float(ref.abs().max())
    if dtype == F32:
        torch.testing.assert_close(y, ref, rtol=0, atol=1e-5 * scale, msg=lambda s: f"{what}: {s}")
    else:
        torch.testing.assert_close(y.float(), ref.float(), rtol=1.6e-2, atol=1e-2 * scale,
                                   msg=lambda s: f"{what}: {s}")


def _device(device):
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _skew(phase):
    if phase % 3 == 0 and dist.get_rank() == phase % dist.get_world_size():
        time.sleep(0.02)


def _ag_calls(cases, device="cpu"):
    from overlap.kernels.triton.tp_gemm import ag_gemm, ag_gemm_num_signals, ag_gemm_workspace_bytes

    device = _device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = max(ag_gemm_workspace_bytes(m, k, world, dt) for (m, k, n), dt, _ in cases)
    outs = []
    with create_workspace(dist.group.WORLD, nbytes, num_signals=ag_gemm_num_signals(world),
                          device=device, timeout=30) as ws:
        for phase, ((m, k, n), dt, gathered) in enumerate(cases, start=1):
            x, w = _inputs(phase, rank, m, k, n, dt, device, "ag")
            _skew(phase)
            outs.append((phase, ag_gemm(ws, x, w, phase=phase, return_gathered=gathered)))
        ws.barrier()  # peers may still read our buffer until they are done too
    for (phase, (y, g)), ((m, k, n), dt, gathered) in zip(outs, cases):
        xs = [_inputs(phase, s, m, k, n, dt, device, "ag")[0] for s in range(world)]
        w = _inputs(phase, rank, m, k, n, dt, device, "ag")[1]
        full = torch.cat(xs)
        _check(y, (full.double() @ w.double()).to(dt), dt, f"ag_gemm phase {phase} {dt}")
        assert (g is None) != gathered and (g is None or torch.equal(g, full)), phase
    return len(outs)


def _rs_calls(cases, device="cpu"):
    from overlap.kernels.triton.tp_gemm import gemm_rs, gemm_rs_num_signals, gemm_rs_workspace_bytes

    device = _device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = max(gemm_rs_workspace_bytes(m, n, world, dt) for (m, k, n), dt in cases)
    outs = []
    with create_workspace(dist.group.WORLD, nbytes, num_signals=gemm_rs_num_signals(world),
                          device=device, timeout=30) as ws:
        for phase, ((m, k, n), dt) in enumerate(cases, start=1):
            x, w = _inputs(phase, rank, m, k, n, dt, device, "rs")
            _skew(phase)
            outs.append((phase, gemm_rs(ws, x, w, phase=phase)))
        ws.barrier()
    for (phase, y), ((m, k, n), dt) in zip(outs, cases):
        ref = torch.zeros(m, n, dtype=torch.float64, device=device)
        for s in range(world):  # each source's partial rounded to dt, as x @ w would be
            x, w = _inputs(phase, s, m, k, n, dt, device, "rs")
            ref += (x[rank * m:(rank + 1) * m].double() @ w.double()).to(dt).double()
        _check(y, ref.to(dt), dt, f"gemm_rs phase {phase} {dt}")
    return len(outs)


def _cases(world):
    # Phases back to back on one workspace, shapes and dtypes changing between calls. World 4
    # gets fewer calls: the interpreter runs 4 ranks on 2 cores.
    if world == 4:
        return [(BIG, F32), (SMALL, F32), (BIG, BF16), (SMALL, F32)]
    return [(BIG, F32), (SMALL, F32), (BIG, F32), (BIG, BF16), (SMALL, F16), (SMALL, BF16)]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ag_gemm_matches_all_gather_then_matmul(world):
    cases = [(shape, dt, i % 2 == 0) for i, (shape, dt) in enumerate(_cases(world))]
    assert run_ranks(_ag_calls, world, cases) == [len(cases)] * world


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gemm_rs_matches_matmul_then_reduce_scatter(world):
    cases = _cases(world)
    assert run_ranks(_rs_calls, world, cases) == [len(cases)] * world


def _mlp(num_steps):
    # The TP MLP pattern: column-parallel ag_gemm feeding row-parallel gemm_rs, each op on its
    # own workspace, steps back to back.
    from overlap.kernels.triton import tp_gemm as tp

    rank, world = dist.get_rank(), dist.get_world_size()
    m, d, f = 6, 20, 24  # f features per rank
    g = dist.group.WORLD
    errs = []
    with create_workspace(g, tp.ag_gemm_workspace_bytes(m, d, world, F32),
                          num_signals=tp.ag_gemm_num_signals(world), timeout=30) as ws_ag, \
            create_workspace(g, tp.gemm_rs_workspace_bytes(m, d, world, F32),
                             num_signals=tp.gemm_rs_num_signals(world), timeout=30) as ws_rs:
        for step in range(1, num_steps + 1):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(world * m, d, generator=gen)
            w1 = torch.randn(world, d, f, generator=gen)
            w2 = torch.randn(world, f, d, generator=gen)
            h, _ = tp.ag_gemm(ws_ag, x[rank * m:(rank + 1) * m], w1[rank], phase=step)
            y = tp.gemm_rs(ws_rs, h, w2[rank], phase=step)
            ref = sum((x.double() @ w1[s].double()).float().double() @ w2[s].double()
                      for s in range(world))[rank * m:(rank + 1) * m]
            errs.append(float((y.double() - ref).abs().max() / ref.abs().max()))
        ws_ag.barrier()
        ws_rs.barrier()
    return max(errs)


@pytest.mark.parametrize("world", (2, 4))
def test_column_then_row_parallel_back_to_back(world):
    assert max(run_ranks(_mlp, world, 3)) < 1e-5


def _bad_inputs():
    from overlap.kernels.triton import tp_gemm as tp

    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    with create_workspace(g, 256, num_signals=2 * world) as ws:
        need = tp.ag_gemm_workspace_bytes(16, 8, world, F32)
        with pytest.raises(ValueError, match=rf"ag_gemm: .* has 256 bytes but .* needs {need} "
                                             rf"\(rank {rank}\)"):
            tp.ag_gemm(ws, torch.randn(16, 8), w, phase=1)
        need = tp.gemm_rs_workspace_bytes(8, 6, world, F32)
        with pytest.raises(ValueError, match=rf"gemm_rs: .* has 256 bytes but .* needs {need} "
                                             rf"\(rank {rank}\)"):
            tp.gemm_rs(ws, torch.randn(8 * world, 8), w, phase=1)
        with pytest.raises(ValueError, match="gemm_rs: x has M=.* multiple of 2"):
            tp.gemm_rs(ws, torch.randn(5, 8), w, phase=1)
        with pytest.raises(ValueError, match=r"w must be \[K=8, N\]"):
            tp.ag_gemm(ws, x, torch.randn(7, 6), phase=1)
        with pytest.raises(TypeError, match="inputs must share one dtype"):
            tp.ag_gemm(ws, x, w.double(), phase=1)
        with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
            tp.ag_gemm(ws, x.double(), w.double(), phase=1)
    with create_workspace(g, 4096, num_signals=2 * world - 1) as ws:
        with pytest.raises(ValueError, match=rf"has {2 * world - 1} signals but ag_gemm needs"):
            tp.ag_gemm(ws, x, w, phase=1)
    with create_workspace(g, 4096, num_signals=2 * world, timeout=20) as ws:
        with pytest.raises(ValueError, match="phase must be a positive int"):
            tp.ag_gemm(ws, x, w, phase=0)
        y1, _ = tp.ag_gemm(ws, x, w, phase=1)
        with pytest.raises(ValueError, match="phase must increase .* got 1 after 1"):
            tp.ag_gemm(ws, x, w, phase=1)
        with pytest.raises(ValueError, match="already serves ag_gemm"):
            tp.gemm_rs(ws, torch.randn(2 * world, 8), w, phase=2)
        ws.barrier()
    return float((y1[rank * 4:(rank + 1) * 4] - x @ w).abs().max())


def test_bad_inputs_raise_before_any_signal():
    assert max(run_ranks(_bad_inputs, 2)) < 1e-5


def _absent_peer(op):
    from overlap.kernels.triton import tp_gemm as tp

    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = max(tp.ag_gemm_workspace_bytes(4, 8, world, F32),
                 tp.gemm_rs_workspace_bytes(4, 6, world, F32))
    with create_workspace(dist.group.WORLD, nbytes, num_signals=2 * world, timeout=20) as ws:
        if rank == 1:  # never arrives, but stays alive for the barrier
            dist.barrier()
            return "absent"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"{op}: rank 0 of group .* at phase 1 waiting "
                                               r"on signal slot 1 \(ready flag of source rank 1"):
            if op == "ag_gemm":
                tp.ag_gemm(ws, torch.randn(4, 8), torch.randn(8, 6), phase=1, timeout=0.3)
            else:
                tp.gemm_rs(ws, torch.randn(4 * world, 8), torch.randn(8, 6), phase=1,
                           timeout=0.3)
        elapsed = time.monotonic() - t0
        dist.barrier()
        return elapsed


@pytest.mark.parametrize("op", ("ag_gemm", "gemm_rs"))
def test_absent_peer_times_out(op):
    outcomes = run_ranks_outcomes(_absent_peer, 2, op, timeout=60)
    assert [o.status for o in outcomes] == ["ok", "ok"], [o.error for o in outcomes]
    assert outcomes[1].value == "absent"
    assert outcomes[0].value < 20  # the spin budget, not the workspace's 20 s timeout


def _lost_ack():
    # A consumer that never acknowledges (here: its ack is rewound) blocks the producer from
    # reusing the buffer, and the producer reports the ack slot.
    from overlap.kernels.triton import tp_gemm as tp

    x, w = torch.randn(3, 8), torch.randn(8, 5)
    with create_workspace(dist.group.WORLD, 4096, num_signals=2) as ws:
        y, _ = tp.ag_gemm(ws, x, w, phase=1)
        y, _ = tp.ag_gemm(ws, 2 * x, w, phase=2)
        ws.signal(0, slot=1, value=0)
        with pytest.raises(TimeoutError, match=r"ag_gemm: rank 0 .* phase 3 waiting on signal "
                                               r"slot 1 \(ack of consumer rank 0: .* buffer 1 "
                                               r"from phase 1\): wanted >= 1, last saw 0"):
            tp.ag_gemm(ws, x, w, phase=3, timeout=0.2)
        return float((y - (2 * x) @ w).abs().max())


def test_missing_ack_times_out():
    assert run_ranks(_lost_ack, 1)[0] < 1e-5


GPU_CASES = [((256, 512, 384), F32), ((256, 512, 384), BF16), ((100, 264, 200), BF16),
             ((128, 1024, 512), F16)]


@requires_gpu
def test_ag_gemm_gpu():
    """The CUDA twin of test_ag_gemm_matches_all_gather_then_matmul, at tensor-core sizes."""
    world = min(4, torch.cuda.device_count())
    cases = [(shape, dt, True) for shape, dt in GPU_CASES] * 2
    assert run_ranks(_ag_calls, world, cases, "cuda", backend="nccl") == [len(cases)] * world


@requires_gpu
def test_gemm_rs_gpu():
    """The CUDA twin of test_gemm_rs_matches_matmul_then_reduce_scatter."""
    world = min(4, torch.cuda.device_count())
    cases = GPU_CASES * 2
    assert run_ranks(_rs_calls, world, cases, "cuda", backend="nccl") == [len(cases)] * world
