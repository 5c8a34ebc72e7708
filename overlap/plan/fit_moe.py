"""Fit the MoE all-to-all efficiency to published Megatron-Core MoE runs; report every row.

``python -m overlap.plan.fit_moe`` fits two numbers, ``a2a_efficiency`` (the achieved fraction
of NVLink and InfiniBand bandwidth in the dispatch/combine all-to-all) and
``grouped_gemm_efficiency`` (the expert grouped GEMMs' throughput relative to a dense GEMM), on
the rows of ``data/moe_runs.csv`` marked ``fit``, and prints the error of every row, the
held-out ``check`` rows included; ``--report`` only prints the errors of the shipped
``MOE_FITTED``. Everything else is the dense fit's, unchanged. Objective: the sum of
``log(predicted / published step time)^2``, by Nelder-Mead with both values kept in (0, 1).
The narrative (what each row is assumed to run): docs/design/planner.md.
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

__all__ = ["MoERow", "load_runs", "row_setup", "errors", "fit", "report", "balance_ratios",
           "DROPLESS_IMBALANCE"]

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


def row_setup(row: MoERow, fitted: dict[str, float] | None = None):
    """(model, cluster, layout, EP group placement) of one run. Fixed, not fitted: Megatron's all-to-all does not
    overlap the expert GEMMs (``Overlap.ep`` off), the in-schedule overlap is on only where the
    row says "1f1b overlap", DP and P2P overlap on, TP collectives unfused, dropless routing
    with a balanced load (imbalance 1), ZeRO-1. The interleaved schedule with the row's virtual
    stages, the 94 layers spread over the pp x vpp chunks as evenly as possible; where there
    are fewer layers than chunks (pp 32 x vpp 3: Megatron counts the embedding and the loss as
    chunks' layers), 1F1B over pp stages (a larger bubble than theirs)."""
    device = build_profiles()["h100-sxm"].replace(**(fitted or MOE_FITTED))
    model = get_model("qwen3-235b-a22b")
    interleave = row.vpp > 1 and row.pp * row.vpp <= model.num_layers
    cluster = ClusterSpec(device=device, num_gpus=row.gpus, gpus_per_node=8)
    layout = Layout(tp=row.tp, pp=row.pp, ep=row.ep // row.tp, global_batch=2048,
                    micro_batch=1,
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
    for row in rows or load_runs():
        model, cluster, layout, group = row_setup(row, fitted)
        pred = estimate(model, cluster, layout, ep_group=group).step_time_s
        out.append((row, pred, pred / row.step_s - 1.0))
    return out


def balance_ratios(imbalance: float, path: str = BALANCE) -> list[tuple[int, float, float]]:
    """(sequence length, published, predicted) dropless over forced-balance step time of the
    long-context runs (``data/moe_balance.csv``): the same layout estimated with
    ``moe_imbalance=imbalance`` and with 1 (a balanced load)."""
    device = build_profiles()["h100-sxm"].replace(**MOE_FITTED)
    out = []
    for r in csv_records(path):
        tp, cp, seq = int(r["tp"]), int(r["cp"]), int(r["seq_len"])
        model = dataclasses.replace(get_model("qwen3-235b-a22b"), seq_len=seq)
        cluster = ClusterSpec(device=device, num_gpus=8 * int(r["nodes"]), gpus_per_node=8)
        # EP 8 folded over TP x DP (row_setup says how): the planner's ep is 8 / tp.
        layout = Layout(tp=tp, pp=8, cp=cp, cp_method="ring", ep=8 // tp,
                        global_batch=int(r["global_batch"]), schedule="interleaved", virtual=4,
                        recompute="selective", sequence_parallel=True, zero=1,
                        ep_node_dedup=True, overlap=Overlap(tp=False, ep=False))
        t = [estimate(model, cluster, dataclasses.replace(layout, moe_imbalance=i),
                      ep_group=_ep_group(8)).step_time_s for i in (imbalance, 1.0)]
        out.append((seq, float(r["tflops_forced"]) / float(r["tflops_dropless"]), t[0] / t[1]))
    return out


def _params(x: list[float]) -> dict[str, float]:
    return {k: 1.0 / (1.0 + math.exp(-z)) for k, z in zip(KEYS, x)}


def fit(rows: list[MoERow] | None = None) -> dict[str, float]:
    """The two efficiencies that minimise the log error of the ``fit`` rows' step times."""
    rows = [r for r in (rows or load_runs()) if r.role == "fit"]

    def loss(x: list[float]) -> float:
        return sum(math.log(1.0 + e) ** 2 for _, _, e in errors(_params(x), rows))

    x = _nelder_mead(loss, [0.0, 0.0], iters=200, tol=1e-8)
    return {k: round(v, 4) for k, v in _params(x).items()}


def report(fitted: dict[str, float] | None = None) -> str:
    lines = ["| run | tp | ep | pp | dp | role | published step | predicted | error |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    errs = errors(fitted)
    for row, pred, e in errs:
        lines.append(f"| {row.name} | {row.tp} | {row.ep} | {row.pp} | {row.dp} | {row.role} | "
                     f"{row.step_s:.1f} s | {pred:.1f} s | {100 * e:+.1f}% |")
    lines += role_lines([(r.role, e) for r, _, e in errs])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return fit_main("fit_moe", __doc__, MOE_FITTED, fit, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
