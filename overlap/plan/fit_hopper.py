"""The Hopper (H100/H200) terms of the planner, from public measurements, and their error.

``python -m overlap.plan.fit_hopper`` fits and prints; ``--report`` prints the shipped
``HOPPER_FITTED``'s error. Data, each row with its source: ``data/hopper_kernels.csv`` (GEMM and
attention kernel TFLOP/s by shape, collective bus bandwidth) and ``data/hopper_runs.csv``
(published dense training runs with their layout). In order, each term from its own data:
the GEMM curve (``e_max``, ``d_half``) from the GEMM rows, the flash-attention curve by
sequence length from the attention rows, the NVLink and InfiniBand efficiencies from the
collectives' bus bandwidth at large messages; then, on the ``fit`` runs, what no kernel row
measures: the fraction of peak a layer's GEMMs keep inside a training step
(``step_gemm_factor``), ZeRO-3's per-layer cost (``zero3_layer_s``) and the level of an
attention kernel a run used that the kernel rows do not hold (``ATTENTION_KERNELS``). The
``check`` runs are kept out of every fit and reported. The narrative: docs/planner.md ("Hopper").
"""

from __future__ import annotations

import dataclasses
import math
import os

from overlap.plan.estimate import estimate
from overlap.plan.fit import _nelder_mead, csv_records, fit_main, role_lines
from overlap.plan.hardware import ClusterSpec
from overlap.plan.layout import Layout, Overlap
from overlap.plan.models import ModelSpec
from overlap.plan.profiles import HOPPER_FITTED, build_profiles

__all__ = ["Run", "Kernel", "load_runs", "load_kernels", "fit_kernel_terms", "row_setup",
           "errors", "fit", "report"]

HERE = os.path.join(os.path.dirname(__file__), "data")
RUNS, KERNELS = os.path.join(HERE, "hopper_runs.csv"), os.path.join(HERE, "hopper_kernels.csv")
PEAK = 989e12  # H100/H200 SXM dense BF16 (profiles.py cites the datasheet)
# A run's ``attention`` kernel -> the fitted term holding its level (fraction of peak on the
# causal half of the attention FLOPs). "triton-2023": llm-foundry's ``attn_impl: triton`` (the
# MPT yamls and the benchmark sweep's default), a Triton flash kernel of 2023 that no kernel
# row of the data measures on Hopper, so its level is fitted on the runs.
ATTENTION_KERNELS = {"triton-2023": "attn_triton_e_max"}
NVLINK, IB = 450e9, 50e9  # per GPU per direction (profiles.py)


def _f(x: str) -> float | None:
    return float(x) if x not in ("", None) else None


def _i(x: str) -> int | None:
    return int(float(x)) if x not in ("", None) else None


@dataclasses.dataclass(slots=True, frozen=True)
class Run:
    name: str
    gpu: str
    gpus: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    gated_mlp: bool
    vocab: int
    seq_len: int
    tp: int
    pp: int
    vpp: int
    cp: int
    micro_batch: int
    global_batch: int
    recompute: str
    sequence_parallel: bool
    zero: int
    attention: str      # the attention kernel, where the profile's (FlashAttention-3) is not it
    tflops_per_gpu: float | None
    tokens_per_s_per_gpu: float | None
    step_s: float | None
    role: str

    def published_step_s(self, model_flops: float) -> float:
        """The step time the source states, or its tokens/s per GPU turned into one, or its
        TFLOP/s per GPU in ``model_flops`` per step (the planner's count: where a source does
        not say how it counts, the common one, attention over the full s x s, no recompute)."""
        if self.tokens_per_s_per_gpu:
            return self.global_batch * self.seq_len / (self.tokens_per_s_per_gpu * self.gpus)
        if self.step_s:
            return self.step_s
        return model_flops / (self.tflops_per_gpu * 1e12 * self.gpus)


def load_runs(path: str = RUNS) -> list[Run]:
    out = []
    for r in csv_records(path):
        if r["precision"].strip().lower() != "bf16" or not r.get("role"):
            continue  # the planner models bf16; rows without a role are recorded, not used
        heads = int(r["heads"])
        out.append(Run(
            name=r["name"], gpu=r["gpu"], gpus=int(r["gpus"]), layers=int(r["layers"]),
            hidden=int(r["hidden"]), heads=heads, kv_heads=_i(r["kv_heads"]) or heads,
            ffn=_i(r["ffn"]) or 4 * int(r["hidden"]),
            gated_mlp=r["gated_mlp"].strip().lower() in ("1", "true", "yes"),
            vocab=int(r["vocab"]), seq_len=int(r["seq_len"]), tp=int(r["tp"]), pp=int(r["pp"]),
            vpp=_i(r["vpp"]) or 1, cp=_i(r["cp"]) or 1, micro_batch=_i(r["micro_batch"]) or 1,
            global_batch=int(r["global_batch"]), recompute=r["recompute"] or "none",
            sequence_parallel=r["sequence_parallel"].strip().lower() in ("1", "true", "yes")
            if r["sequence_parallel"] else int(r["tp"]) > 1, zero=int(r["zero"]),
            attention=r.get("attention", ""),
            tflops_per_gpu=_f(r["tflops_per_gpu"]),
            tokens_per_s_per_gpu=_f(r["tokens_per_s_per_gpu"]), step_s=_f(r["step_s"]),
            role=r["role"]))
    return out


@dataclasses.dataclass(slots=True, frozen=True)
class Kernel:
    kind: str
    m: float | None
    n: float | None
    k: float | None
    seq_len: float | None
    bytes: float | None
    link: str
    tflops: float | None
    busbw_GBps: float | None
    latency_us: float | None
    causal: bool
    source: str
    direction: str = ""  # attention: "fwd" or "bwd"


def load_kernels(path: str = KERNELS) -> list[Kernel]:
    """The rows the fit uses (role "fit"; the others are recorded, their reasons in the file)."""
    return [Kernel(kind=r["kind"], m=_f(r["m"]), n=_f(r["n"]), k=_f(r["k"]),
                   seq_len=_f(r["seq_len"]), bytes=_f(r["bytes"]), link=r["link"],
                   tflops=_f(r["tflops"]), busbw_GBps=_f(r["busbw_GBps"]),
                   latency_us=_f(r["latency_us"]), causal=r["causal"] == "1",
                   source=r["source"], direction=r["direction"])
            for r in csv_records(path) if r["role"] == "fit"]


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def fit_gemm(rows: list[Kernel]) -> tuple[float, float, float]:
    """(e_max, d_half, overhead_s) of ``time = overhead + 2mnk / (peak e_max prod d/(d +
    d_half))`` (profiles' GemmCurve) minimising the squared log error of the measured times."""
    pts = [((r.m, r.n, r.k), 2.0 * r.m * r.n * r.k / (r.tflops * 1e12)) for r in rows]

    def model(x: list[float], dims) -> float:
        eff = _sig(x[0]) * math.prod(d / (d + math.exp(x[1])) for d in dims)
        return math.exp(x[2]) + 2.0 * math.prod(dims) / (PEAK * eff)

    x = _nelder_mead(lambda x: sum(math.log(model(x, d) / t) ** 2 for d, t in pts),
                     [1.0, math.log(64.0), math.log(5e-6)], iters=600, tol=1e-14)
    return _sig(x[0]), math.exp(x[1]), math.exp(x[2])


def fit_attention(rows: list[Kernel]) -> tuple[float, float, float]:
    """(e_max, s_half, backward) of a flash kernel's efficiency ``e_max s / (s + s_half)``: the
    shape in s from the one sequence sweep (non-causal forward rows), the level from the causal
    forward rows at their sequence length, and the causal backward's level over the forward's
    at the same length (``backward``; a training step's kernels are causal)."""
    sweep = [(r.seq_len, r.tflops) for r in rows if not r.causal]
    causal = [(r.seq_len, r.tflops * 1e12 / PEAK, r.direction) for r in rows if r.causal]

    def loss(x: list[float]) -> float:  # the sweep's level is free: only its shape is used
        level, half = math.exp(x[0]), math.exp(x[1])
        return sum(math.log(level * s / (s + half) / t) ** 2 for s, t in sweep)

    half = math.exp(_nelder_mead(loss, [math.log(700.0), math.log(256.0)], iters=400,
                                 tol=1e-14)[1])
    level = {d: [e / (s / (s + half)) for s, e, dd in causal if dd == d] for d in ("fwd", "bwd")}
    e_max = sum(level["fwd"]) / len(level["fwd"])
    return e_max, half, sum(level["bwd"]) / len(level["bwd"]) / e_max


# The NCCL maintainer's stated typical peak across nodes: 24 GB/s bus bandwidth per 200 Gb/s
# NIC (NVIDIA/nccl-tests#119), 0.96 of its 25 GB/s; no row of the data measures InfiniBand at a
# stated message size (hopper_kernels.csv says why).
IB_EFFICIENCY = 0.96


def fit_kernel_terms(kernels: list[Kernel] | None = None) -> dict[str, float]:
    """The terms each measured by its own kernel rows (module docstring)."""
    kernels = kernels if kernels is not None else load_kernels()
    e_max, d_half, overhead = fit_gemm([r for r in kernels if r.kind == "gemm"])
    a_max, s_half, a_bwd = fit_attention([r for r in kernels if r.kind == "attention"])
    ring = [r.busbw_GBps for r in kernels if r.kind in ("reducescatter", "allgather")
            and r.link.startswith("nvlink")]
    return {"gemm_e_max": round(e_max, 4), "gemm_d_half": round(d_half, 2),
            "gemm_overhead_s": round(overhead, 8), "attn_e_max": round(a_max, 4),
            "attn_s_half": round(s_half, 1), "attn_bwd": round(a_bwd, 4),
            "nvlink_efficiency": round(min(1.0, sum(ring) / len(ring) * 1e9 / NVLINK), 4),
            "ib_efficiency": IB_EFFICIENCY}


def row_setup(run: Run, fitted: dict[str, float] | None = None):
    """(model, cluster, layout) of one run. Fixed, not fitted: the row's ZeRO stage (3 for
    FSDP, else Megatron's distributed optimizer), sequence parallelism with tp > 1 unless the
    row says otherwise, flash attention, bf16 gradients reduced, and every overlap such
    runtimes have on in their published configurations (TP comm+GEMM, DP buckets and
    parameter gathers, P2P)."""
    terms = HOPPER_FITTED if fitted is None else fitted
    device = build_profiles(hopper=terms)["h200" if run.gpu.lower().startswith("h200")
                                          else "h100-sxm"]
    if run.attention:  # the run's own kernel: its level is a fitted term, its shape in s is
        # FlashAttention-3's (the one sweep the data has)
        level = terms[ATTENTION_KERNELS[run.attention]]
        device = device.replace(attention=dataclasses.replace(device.attention, e_max=level))
    gated = run.gated_mlp
    model = ModelSpec(name=run.name, num_layers=run.layers, hidden=run.hidden,
                      num_heads=run.heads, num_kv_heads=run.kv_heads, ffn=run.ffn,
                      vocab=run.vocab, seq_len=run.seq_len, gated_mlp=gated,
                      tied_embeddings=not gated, learned_positions=not gated, bias=not gated,
                      dropout=False)
    cluster = ClusterSpec(device=device, num_gpus=run.gpus, gpus_per_node=8)
    layout = Layout(tp=run.tp, pp=run.pp, cp=run.cp, cp_method="ring",
                    global_batch=run.global_batch, micro_batch=run.micro_batch,
                    schedule="interleaved" if run.vpp > 1 else "1f1b", virtual=run.vpp,
                    recompute=run.recompute, sequence_parallel=run.sequence_parallel,
                    flash_attention=True, zero=run.zero, comm_dtype="bf16", overlap=Overlap())
    return model, cluster, layout


def errors(fitted: dict[str, float] | None = None,
           runs: list[Run] | None = None) -> list[tuple[Run, float, float]]:
    """(run, predicted TFLOP/s per GPU on the source's FLOP count, relative speed error) per
    run; a run without a published TFLOP/s is shown in the planner's own FLOP count."""
    out = []
    for run in runs if runs is not None else load_runs():
        est = estimate(*row_setup(run, fitted))
        published = run.published_step_s(est.model_flops)
        speed = published / est.step_time_s
        shown = run.tflops_per_gpu or est.model_flops / published / run.gpus / 1e12
        out.append((run, shown * speed, speed - 1.0))
    return out


def fit(runs: list[Run] | None = None, kernels: list[Kernel] | None = None) -> dict[str, float]:
    """Every Hopper term: the kernel terms, then on the ``fit`` runs ``step_gemm_factor``,
    ``zero3_layer_s`` and the level of each run-side attention kernel (``ATTENTION_KERNELS``):
    the long-sequence runs, where attention is most of the step, pin the latter."""
    terms = fit_kernel_terms(kernels)
    rows = [r for r in (runs if runs is not None else load_runs()) if r.role == "fit"]
    kinds = sorted({ATTENTION_KERNELS[r.attention] for r in rows if r.attention})

    def trial(x: list[float]) -> dict[str, float]:
        return {**terms, "step_gemm_factor": _sig(x[0]), "zero3_layer_s": math.exp(x[1]),
                **{k: _sig(v) for k, v in zip(kinds, x[2:])}}

    def loss(x: list[float]) -> float:
        return sum(math.log(1.0 + e) ** 2 for _, _, e in errors(trial(x), rows))

    x = _nelder_mead(loss, [1.0, math.log(1e-3)] + [-1.0] * len(kinds), iters=600, tol=1e-12)
    fitted = trial(x)
    return {**terms, "step_gemm_factor": round(fitted["step_gemm_factor"], 4),
            "zero3_layer_s": round(fitted["zero3_layer_s"], 7),
            **{k: round(fitted[k], 4) for k in kinds}}


def report(fitted: dict[str, float] | None = None) -> str:
    errs = errors(fitted)
    lines = ["| run | gpus | tp | pp | cp | role | published | predicted | error |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for run, pred, e in errs:
        pub = pred / (1.0 + e)
        lines.append(f"| {run.name} | {run.gpus} | {run.tp} | {run.pp} | {run.cp} | {run.role} "
                     f"| {pub:.0f} | {pred:.0f} | {100 * e:+.1f}% |")
    lines += role_lines([(r.role, e) for r, _, e in errs])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return fit_main("fit_hopper", __doc__, HOPPER_FITTED or {}, fit, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
