"""Fit the MoE all-to-all and grouped-GEMM efficiencies to published Megatron-Core MoE runs.

``python -m overlap.plan.fit_moe`` fits ``a2a_efficiency`` (the achieved fraction of NVLink and
InfiniBand bandwidth of the all-to-all on NCCL collectives, Megatron's "alltoall" dispatcher)
and ``grouped_gemm_efficiency`` (the expert GEMMs' throughput relative to a dense GEMM) on the
``fit`` rows and prints every row's error; ``--report`` only prints the shipped ``MOE_FITTED``'s.
Rows: ``data/moe_runs.csv`` (step times) and ``data/moe_balance.csv`` (TFLOP/s of long-context
runs, dropless fitted, forced balance held out, made step times by Megatron's own FLOP count,
:func:`megatron_step_flops`). DeepEP's once-per-node dispatch runs at the links' rate (its own
kernel table, ``profiles.DEEPEP_EFFICIENCY``), not fitted. Everything else is the dense fit's.
Objective: the sum of ``log(predicted / published step time)^2``, by Nelder-Mead with both
values kept in (0, 1). The narrative (what each row is assumed to run): docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses
import math
import os

from overlap.plan.comm import Placement
from overlap.plan.estimate import estimate
from overlap.plan.fit import _nelder_mead, csv_records, fit_main, role_lines
from overlap.plan.hardware import ClusterSpec
from overlap.plan.layout import Layout, Overlap
from overlap.plan.models import get_model
from overlap.plan.profiles import MOE_FITTED, build_profiles

__all__ = ["MoERow", "load_runs", "load_long_runs", "row_setup", "errors", "fit", "report",
           "balance_ratios", "megatron_step_flops", "DROPLESS_IMBALANCE"]

DATA = os.path.join(os.path.dirname(__file__), "data", "moe_runs.csv")
BALANCE = os.path.join(os.path.dirname(__file__), "data", "moe_balance.csv")
KEYS = ("a2a_efficiency", "grouped_gemm_efficiency")
# The one moe_imbalance that reproduces the dropless / forced-balance ratios of the long-context
# runs (balance_ratios; each within 1.5%): Qwen3-235B-A22B's own router over EP 8.
DROPLESS_IMBALANCE = 1.47


@dataclasses.dataclass(slots=True, frozen=True)
class MoERow:
    name: str
    dispatcher: str
    gpus: int
    tp: int
    ep: int
    pp: int
    vpp: int
    dp: int
    recompute: str
    a2a_1f1b_overlap: bool
    step_s: float
    tflops_per_gpu: float
    role: str
    seq_len: int = 4096
    cp: int = 1
    global_batch: int = 2048
    moe_imbalance: float = 1.0   # the router's load (1: balanced, forced or assumed)


def load_runs(path: str = DATA) -> list[MoERow]:
    out = []
    for r in csv_records(path):
        out.append(MoERow(name=r["name"], dispatcher=r["dispatcher"], gpus=int(r["gpus"]),
                          tp=int(r["tp"]), ep=int(r["ep"]), pp=int(r["pp"]), vpp=int(r["vpp"]),
                          dp=int(r["dp"]), recompute=r["recompute"],
                          a2a_1f1b_overlap=r["a2a_1f1b_overlap"] == "1",
                          step_s=float(r["step_s"]), tflops_per_gpu=float(r["tflops_per_gpu"]),
                          role=r["role"]))
    return out


def megatron_step_flops(model, seq_len: int, global_batch: int) -> float:
    """The FLOPs of one step as Megatron counts them for its TFLOP/s: 3 x the forward of every
    GEMM on the active parameters (attention projections, ``top_k`` routed SwiGLU experts, the
    logits; no router), plus the causal half of QK^T and AV. With the model zoo's step times it
    gives back their "Per GPU TF" column within 1% (tests/test_plan_moe.py)."""
    h, layers = model.hidden, model.num_layers
    proj = sum(model.attn_proj_params())
    experts = model.moe_top_k * 3 * h * model.expert_ffn
    core = seq_len * model.num_heads * model.head_dim  # 2 GEMMs x 2 FLOPs x s/2 (causal) each
    per_token = 2 * layers * (proj + experts + core) + 2 * h * model.vocab
    return 3.0 * per_token * seq_len * global_batch


def load_long_runs(path: str = BALANCE, imbalance: float | None = None) -> list[MoERow]:
    """The long-context runs of ``data/moe_balance.csv`` as two rows each: dropless (a ``fit``
    row, routed with ``imbalance``, default :data:`DROPLESS_IMBALANCE`) and forced balance
    (``check``, imbalance 1), step time = :func:`megatron_step_flops` / (GPUs x TFLOP/s).
    Layout (the source's command): EP 8 folded over TP x DP, PP 8 x VPP 4, DeepEP, selective
    recomputation (the planner has no mode that recomputes the MoE layer, as theirs does)."""
    imbalance = DROPLESS_IMBALANCE if imbalance is None else imbalance
    model = get_model("qwen3-235b-a22b")
    out = []
    for r in csv_records(path):
        seq, tp, cp, gbs = int(r["seq_len"]), int(r["tp"]), int(r["cp"]), int(r["global_batch"])
        gpus, pp = 8 * int(r["nodes"]), 8
        flops = megatron_step_flops(model, seq, gbs)
        for routing, role, imb in (("dropless", "fit", imbalance), ("forced", "check", 1.0)):
            tf = float(r[f"tflops_{routing}"])
            out.append(MoERow(name=f"qwen3-long-{seq // 1024}k-{routing}", dispatcher="deepep",
                              gpus=gpus, tp=tp, ep=8, pp=pp, vpp=4, dp=gpus // (tp * cp * pp),
                              recompute="selective", a2a_1f1b_overlap=False,
                              step_s=flops / (gpus * tf * 1e12), tflops_per_gpu=tf, role=role,
                              seq_len=seq, cp=cp, global_batch=gbs, moe_imbalance=imb))
    return out


def row_setup(row: MoERow, fitted: dict[str, float] | None = None):
    """(model, cluster, layout, EP group placement) of one run. Fixed, not fitted: Megatron's
    all-to-all does not overlap the expert GEMMs (``Overlap.ep`` off), the in-schedule overlap
    is on only where the row says "1f1b overlap", DP and P2P overlap on, TP collectives
    unfused, the row's router load (``moe_imbalance``; 1 for the model zoo's 4k table), ZeRO-1.
    The interleaved schedule with the row's virtual stages, the 94 layers spread over the
    pp x vpp chunks as evenly as possible; where there are fewer layers than chunks (pp 32 x
    vpp 3: Megatron counts the embedding and the loss as chunks' layers), 1F1B over pp stages
    (a larger bubble than theirs)."""
    device = build_profiles()["h100-sxm"].replace(**(fitted or MOE_FITTED))
    model = dataclasses.replace(get_model("qwen3-235b-a22b"), seq_len=row.seq_len)
    interleave = row.vpp > 1 and row.pp * row.vpp <= model.num_layers
    cluster = ClusterSpec(device=device, num_gpus=row.gpus, gpus_per_node=8)
    layout = Layout(tp=row.tp, pp=row.pp, cp=row.cp, cp_method="ring", ep=row.ep // row.tp,
                    global_batch=row.global_batch, micro_batch=1,
                    moe_imbalance=row.moe_imbalance,
                    schedule="interleaved" if interleave else "1f1b",
                    virtual=row.vpp if interleave else 1,
                    recompute=row.recompute, sequence_parallel=row.tp > 1,
                    zero=1, ep_node_dedup=row.dispatcher == "deepep",
                    overlap=Overlap(tp=False, ep=False, ep_schedule=row.a2a_1f1b_overlap))
    # Megatron folds EP over TP x DP (expert TP 1) with ranks ordered tp, cp, ep, dp, pp: the
    # EP group is row.ep consecutive ranks. This runtime's EP lies inside dp and replicates
    # experts over TP, which moves the same rows per GPU through a group of ep / tp.
    return model, cluster, layout, _ep_group(row.ep)


def _ep_group(ep: int) -> Placement:
    """Megatron's EP group: ``ep`` consecutive ranks on nodes of 8 GPUs."""
    return Placement(size=ep, per_node=min(ep, 8), nodes=math.ceil(ep / 8))


def errors(fitted: dict[str, float] | None = None,
           rows: list[MoERow] | None = None) -> list[tuple[MoERow, float, float]]:
    """(row, predicted step seconds, relative error) per row."""
    out = []
    for row in rows or load_runs() + load_long_runs():
        model, cluster, layout, group = row_setup(row, fitted)
        pred = estimate(model, cluster, layout, ep_group=group).step_time_s
        out.append((row, pred, pred / row.step_s - 1.0))
    return out


def balance_ratios(imbalance: float, path: str = BALANCE) -> list[tuple[int, float, float]]:
    """(sequence length, published, predicted) dropless over forced-balance step time of the
    long-context runs (:func:`load_long_runs`): the same layout estimated with
    ``moe_imbalance=imbalance`` and with 1 (a balanced load)."""
    rows = load_long_runs(path, imbalance)
    out = []
    for dropless, forced in zip(rows[::2], rows[1::2]):
        t = [p for _, p, _ in errors(rows=[dropless, forced])]
        out.append((dropless.seq_len, forced.tflops_per_gpu / dropless.tflops_per_gpu,
                    t[0] / t[1]))
    return out


def _params(x: list[float]) -> dict[str, float]:
    return {k: 1.0 / (1.0 + math.exp(-z)) for k, z in zip(KEYS, x)}


def fit(rows: list[MoERow] | None = None) -> dict[str, float]:
    """The two efficiencies that minimise the log error of the ``fit`` rows' step times."""
    rows = [r for r in (rows or load_runs() + load_long_runs()) if r.role == "fit"]

    def loss(x: list[float]) -> float:
        return sum(math.log(1.0 + e) ** 2 for _, _, e in errors(_params(x), rows))

    x = _nelder_mead(loss, [0.0, 0.0], iters=200, tol=1e-8)
    return {k: round(v, 4) for k, v in _params(x).items()}


def report(fitted: dict[str, float] | None = None) -> str:
    lines = ["| run | seq | tp | cp | ep | pp | dp | role | published step | predicted | error |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    errs = errors(fitted)
    for row, pred, e in errs:
        lines.append(f"| {row.name} | {row.seq_len} | {row.tp} | {row.cp} | {row.ep} | {row.pp} | "
                     f"{row.dp} | {row.role} | "
                     f"{row.step_s:.1f} s | {pred:.1f} s | {100 * e:+.1f}% |")
    lines += role_lines([(r.role, e) for r, _, e in errs])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return fit_main("fit_moe", __doc__, MOE_FITTED, fit, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
