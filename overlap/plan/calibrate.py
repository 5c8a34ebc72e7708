"""``overlap-plan --calibrate``: measure this machine and write a device profile (JSON).

On a machine without GPUs a "device" is one rank: a single-threaded process, as
``overlap.dist.launch`` starts them. The rank-side benchmarks are in
:mod:`overlap.plan.calibrate_bench`. Profile fields written: ``gemm`` and ``peak_flops`` (GEMM
throughput by shape), ``hbm_bandwidth`` (a layer's element-wise ops), ``base_latency_s`` and
``intra`` (collectives of the local backend), ``tp_link`` and ``tp_base_latency_s`` (the fused
TP ops), ``host_*layer_s``, ``host_*action_s``, ``host_*step_s``, ``comm_cpu_s`` and
``p2p_cpu_s`` (host costs with ``ranks`` ranks busy at once), ``host_cores`` (the cores the
ranks actually get; the profile records what was free when it was measured).
The narrative (what each benchmark measures, and the fits): docs/design/planner.md.
``python -m overlap.plan.calibrate`` prints the error on the published runs instead (accuracy).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch

from overlap.plan import calibrate_bench as bench
from overlap.plan.hardware import DeviceProfile, GemmCurve, LinkSpec

__all__ = ["calibrate", "fit_gemm_curve", "fit_alpha_beta"]

GEMM_DIMS = (16, 64, 256, 1024)
COMM_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 22)
TP_SHAPES = ((256, 64), (4096, 256))


def fit_gemm_curve(samples) -> tuple[float, GemmCurve]:
    """(peak FLOP/s, curve) fitted to (m, n, k, seconds) samples in log space."""
    from overlap.plan.fit import _nelder_mead

    peak = max(2.0 * m * n * k / t for m, n, k, t in samples)

    def curve(x) -> GemmCurve:
        return GemmCurve(e_max=math.exp(x[0]), d_half=math.exp(x[1]), overhead_s=math.exp(x[2]))

    def loss(x) -> float:
        c = curve(x)
        err = 0.0
        for m, n, k, t in samples:
            pred = c.overhead_s + 2.0 * m * n * k / (peak * c.efficiency(m, n, k))
            err += math.log(pred / t) ** 2
        return err

    t_min = min(t for *_, t in samples)
    x = _nelder_mead(loss, [0.0, math.log(16.0), math.log(t_min / 2)], iters=600)
    return peak, curve(x)


def fit_alpha_beta(samples: list[tuple[str, float, float]]) -> tuple[float, float, float]:
    """(base, per-step latency, bandwidth) from (op, bytes, seconds) samples on 2 ranks."""
    import numpy as np

    a = np.array([[1.0, bench.OPS_2[op][0], bench.OPS_2[op][1] * nb] for op, nb, _ in samples])
    y = np.array([t for *_, t in samples])
    w = 1.0 / y  # relative error: small messages matter as much as big ones
    coef = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0]
    if coef[1] < 0:  # base and step latency are not separable here: fold into base
        coef = np.array([*np.linalg.lstsq((a * w[:, None])[:, [0, 2]], y * w,
                                          rcond=None)[0]])
        coef = np.array([coef[0], 0.0, coef[1]])
    base, step, inv_bw = (max(float(c), 0.0) for c in coef)
    return base, step, 1.0 / max(inv_bw, 1e-15)


def _busy(n: int) -> float:
    """About half a second of single-threaded GEMMs (long enough for scheduling noise to
    average out)."""
    import torch.distributed as dist

    a = torch.randn(96, 96)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(20000):
        a @ a
    return time.perf_counter() - t0


def measure_cores(k: int = 8) -> float:
    """Cores a job of k busy local ranks gets: k CPU-bound ranks against one (at most
    os.cpu_count()). The scheduler shares the machine per process, so other jobs take less
    from k busy ranks than from one: measure with the rank count of the job."""
    from overlap.dist.launch import launch

    one = min(launch(_busy, 1, args=(1,))[0] for _ in range(2))
    many = max(launch(_busy, k, args=(k,)))
    return min(float(os.cpu_count() or 1), k * one / many)


def _launch(fn, n: int, *args):
    from overlap.dist.launch import launch

    return launch(fn, n, args=args, backend="nccl_twin", timeout=900)


def _links(iters: int) -> dict[str, float]:
    """Latency and bandwidth of the collectives and the fused TP ops, 2 ranks alone."""
    coll = _launch(bench.bench_collectives, 2, COMM_SIZES, iters)
    tp = _launch(bench.bench_tp_ops, 2, TP_SHAPES, iters)
    samples = [(op, float(nb), max(r[op][i][1] for r in coll))
               for op in bench.OPS_2 for i, (nb, *_) in enumerate(coll[0][op])]
    base, step, link_bw = fit_alpha_beta(samples)
    small, large = (statistics.mean(r[i][1] for r in tp) for i in (0, 1))
    d_bytes = 4.0 * (TP_SHAPES[1][0] * TP_SHAPES[1][1] - TP_SHAPES[0][0] * TP_SHAPES[0][1])
    slope = (large - small) / d_bytes
    return {"base": base, "step": step, "link_bw": link_bw, "tp_base": max(small, 0.0),
            "tp_bw": 0.5 / slope if slope > 0 else link_bw}  # 2-rank AG/RS move half


def _split(cpu: dict[tuple[int, int], float], p2p_cpu: float) -> dict[str, Any]:
    """Per-step CPU at (layers per stage, m) in {1, 3} x {2, 6} -> per layer and micro-batch
    (split 1:2 between forward and backward, as their arithmetic), per compute action (beyond
    its layers and its two P2P sides, which the planner counts itself), per step."""
    d1 = (cpu[(1, 6)] - cpu[(1, 2)]) / 4
    d3 = (cpu[(3, 6)] - cpu[(3, 2)]) / 4
    layer = max((d3 - d1) / 2, 0.0)
    action = max((d1 - layer - 2 * p2p_cpu) / 2, 0.0)
    return {"layer": (layer / 3, 2 * layer / 3), "action": action,
            "step": max(cpu[(1, 2)] - 2 * d1, 0.0)}


def _host(ranks: int, iters: int) -> dict[str, Any]:
    """Host CPU costs with ``ranks`` ranks busy at once (medians over ranks)."""
    coll = _launch(bench.bench_collectives, ranks, COMM_SIZES[:2], iters)

    def med(values) -> float:
        return statistics.median(list(values))

    # CPU per collective step: a 2-rank all-reduce has 2 steps, all-gather and reduce-scatter 1.
    comm_cpu = med(r[op][i][2] / bench.OPS_2[op][0] for r in coll
                   for op in ("all_reduce", "all_gather", "reduce_scatter") for i in (0, 1))
    p2p_cpu = med(r["p2p"][i][2] for r in coll for i in (0, 1))
    out = {"comm_cpu": comm_cpu, "p2p_cpu": p2p_cpu}
    for tp in (1, 2):
        runs = _launch(bench.bench_pipeline, ranks, iters, tp)
        cpu = {key: med(r[key] for r in runs) for key in runs[0]}
        out["plain" if tp == 1 else "tp"] = _split(cpu, p2p_cpu)
    return out


def calibrate(*, ranks: int = 8, quick: bool = False, log=print) -> DeviceProfile:
    """Measure this machine (see the module docstring); ``ranks``: how many local ranks the
    jobs to predict run (host costs are measured with that many busy at once)."""
    if not isinstance(ranks, int) or ranks < 2 or ranks % 2:
        raise ValueError(f"--ranks must be an even number >= 2, got {ranks!r}")
    iters = 8 if quick else 20
    log(f"calibrate: GEMM throughput by shape, {ranks} ranks at once ...")
    dims = (16, 128, 1024) if quick else GEMM_DIMS
    sweeps = _launch(bench.bench_gemms, ranks, dims, iters)
    samples = [(m, n, k, statistics.median(s[i][3] for s in sweeps))
               for i, (m, n, k, _) in enumerate(sweeps[0])]
    peak, curve = fit_gemm_curve(samples)
    ew = _launch(bench.bench_elementwise, ranks, iters)
    bw = statistics.median(r[0] / r[1] for r in ew)
    loss_bw = statistics.median(r[2] / r[3] for r in ew)
    log(f"  peak {peak / 1e9:.1f} GFLOP/s, e_max {curve.e_max:.3f}, d_half {curve.d_half:.1f}, "
        f"overhead {curve.overhead_s * 1e6:.1f} us; element-wise {bw / 1e9:.2f} GB/s, loss "
        f"{loss_bw / 1e9:.2f} GB/s")
    log("calibrate: collectives and fused TP ops, 2 ranks (nccl_twin) ...")
    c = _links(iters)
    log(f"  collectives: base {c['base'] * 1e6:.0f} us + {c['step'] * 1e6:.0f} us per step, "
        f"{c['link_bw'] / 1e9:.2f} GB/s; fused TP op {c['tp_base'] * 1e6:.0f} us, "
        f"{c['tp_bw'] / 1e9:.2f} GB/s")
    log(f"calibrate: host costs, {ranks} ranks busy in pairs ...")
    h = _host(ranks, iters)
    pl, tp = h["plain"], h["tp"]
    log("  per layer fwd/bwd: plain {:.2f}/{:.2f} ms, tp {:.2f}/{:.2f} ms; per action {:.2f} / "
        "{:.2f} ms; per step {:.2f} / {:.2f} ms; CPU per collective step {:.0f} us, per P2P "
        "side {:.0f} us".format(*(1e3 * x for x in (*pl["layer"], *tp["layer"], pl["action"],
                                                    tp["action"], pl["step"], tp["step"])),
                                1e6 * h["comm_cpu"], 1e6 * h["p2p_cpu"]))
    cores = measure_cores(ranks)
    log(f"calibrate: {cores:.2f} cores free")
    src = f"measured by overlap-plan --calibrate --ranks {ranks} ({time.strftime('%Y-%m-%d')})"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = LinkSpec(bandwidth=c["link_bw"], latency_s=c["step"], efficiency=1.0)
    fields = ("peak_flops", "gemm", "hbm_bandwidth", "loss_bandwidth", "intra", "base_latency_s", "tp_link",
              "tp_base_latency_s", "host_layer_s", "host_tp_layer_s", "host_action_s",
              "host_tp_action_s", "host_step_s", "host_tp_step_s", "comm_cpu_s", "p2p_cpu_s",
              "host_cores")
    return DeviceProfile(
        name="local-cpu", peak_flops=peak, hbm_bytes=float(mem), hbm_bandwidth=bw,
        loss_bandwidth=loss_bw,
        mem_efficiency=1.0, gemm=curve, intra=link, inter=link, base_latency_s=c["base"],
        tp_link=LinkSpec(bandwidth=c["tp_bw"], latency_s=0.0, efficiency=1.0),
        tp_base_latency_s=c["tp_base"], host_layer_s=pl["layer"], host_tp_layer_s=tp["layer"],
        host_action_s=pl["action"], host_tp_action_s=tp["action"], host_step_s=pl["step"],
        host_tp_step_s=tp["step"], comm_cpu_s=h["comm_cpu"], p2p_cpu_s=h["p2p_cpu"],
        host_cores=cores,
        sources={k: src for k in fields} | {
            "hbm_bytes": "physical memory of this machine",
            "inter": "no second node: the same local backend as intra"})


def summary(p: DeviceProfile) -> dict[str, Any]:
    """The profile's numbers in readable units (what ``--calibrate`` prints)."""
    ms = 1e3
    return {"peak_gflops": p.peak_flops / 1e9,
            "gemm": {"e_max": p.gemm.e_max, "d_half": p.gemm.d_half,
                     "overhead_us": p.gemm.overhead_s * 1e6},
            "elementwise_gbs": p.hbm_bandwidth / 1e9,
            "loss_gbs": (p.loss_bandwidth or 0.0) / 1e9,
            "collective_base_us": p.base_latency_s * 1e6,
            "collective_step_us": p.intra.latency_s * 1e6,
            "collective_gbs": p.intra.bandwidth / 1e9,
            "tp_op_us": (p.tp_base_latency_s or 0.0) * 1e6,
            "tp_gbs": p.tp_link.bandwidth / 1e9 if p.tp_link else None,
            "host_layer_ms": [x * ms for x in p.host_layer_s],
            "host_tp_layer_ms": [x * ms for x in p.host_tp_layer_s],
            "host_action_ms": [p.host_action_s * ms, p.host_tp_action_s * ms],
            "host_step_ms": [p.host_step_s * ms, p.host_tp_step_s * ms],
            "comm_cpu_us": p.comm_cpu_s * 1e6, "p2p_cpu_us": p.p2p_cpu_s * 1e6,
            "host_cores": p.host_cores}


def main(argv: list[str] | None = None) -> int:
    """The planner's error on every published calibration table (:mod:`overlap.plan.accuracy`);
    measuring this machine is ``overlap-plan --calibrate``."""
    from overlap.plan import accuracy  # its fits import the estimator, which this module need not
    return accuracy.main(argv, prog="python -m overlap.plan.calibrate")


if __name__ == "__main__":
    raise SystemExit(main())
