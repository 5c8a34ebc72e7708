"""Fit the planner's free parameters to Narayanan et al. 2021, Table 1, and report the error.

``python -m overlap.plan.fit`` fits and prints the table; ``python -m overlap.plan.fit
--report`` only prints the per-row error of the shipped ``FITTED`` parameters.

The data: ``data/narayanan2021_table1.csv``, copied from the paper. Only four numbers are
fitted: the GEMM efficiency curve (``e_max``, ``d_half``) and the achieved fraction of NVLink
and InfiniBand bandwidth; everything else is fixed beforehand. Objective: the sum over rows of
``log(predicted / published)^2`` of TFLOP/s per GPU, minimised by Nelder-Mead.
The narrative (what is fixed, and how): docs/design/planner.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os

from overlap.plan.estimate import estimate
from overlap.plan.hardware import ClusterSpec
from overlap.plan.layout import Layout, Overlap
from overlap.plan.models import ModelSpec
from overlap.plan.profiles import FITTED, build_profiles

__all__ = ["Row", "load_table", "row_setup", "predict", "errors", "fit", "paper_flops",
           "role_lines", "fit_main"]

DATA = os.path.join(os.path.dirname(__file__), "data", "narayanan2021_table1.csv")
KEYS = ("gemm_e_max", "gemm_d_half", "nvlink_efficiency", "ib_efficiency")
# Where the fit starts: NCCL's own A100 NVLink ceiling (235 of 300 GB/s, src/graph/tuning.cc),
# round numbers for the rest. The result does not depend on it (tests restart from elsewhere).
START = {"gemm_e_max": 0.8, "gemm_d_half": 64.0, "nvlink_efficiency": 0.78,
         "ib_efficiency": 0.8}


@dataclasses.dataclass(slots=True, frozen=True)
class Row:
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float
    pct_peak: float


def csv_records(path: str) -> list[dict[str, str]]:
    """The rows of a data table (CSV with a header; lines starting with # are comments)."""
    with open(path) as f:
        return list(csv.DictReader([ln for ln in f if not ln.startswith("#")]))


def load_table(path: str = DATA) -> list[Row]:
    rows = []
    for rec in csv_records(path):
        rows.append(Row(params_b=float(rec["params_B"]), heads=int(rec["heads"]),
                        hidden=int(rec["hidden"]), layers=int(rec["layers"]), tp=int(rec["tp"]),
                        pp=int(rec["pp"]), gpus=int(rec["gpus"]),
                        global_batch=int(rec["global_batch"]),
                        tflops_per_gpu=float(rec["tflops_per_gpu"]),
                        pct_peak=float(rec["pct_peak"])))
    return rows


def _virtual(row: Row, m: int) -> int:
    if row.pp == 1 or m % row.pp:
        return 1
    per_stage = row.layers // row.pp if row.layers % row.pp == 0 else 0
    for v in range(2, per_stage + 1):
        if per_stage % v == 0:
            return v
    return 1


def row_setup(row: Row, fitted: dict[str, float] | None = None):
    """(model, cluster, layout) of one table row, as described in the module docstring."""
    model = ModelSpec(name=f"gpt-{row.params_b}b", num_layers=row.layers, hidden=row.hidden,
                      num_heads=row.heads, vocab=51200, seq_len=2048)
    cluster = ClusterSpec(device=build_profiles(fitted)["a100-80g"], num_gpus=row.gpus,
                          gpus_per_node=8)
    dp = row.gpus // (row.tp * row.pp)
    m = row.global_batch // dp
    v = _virtual(row, m)
    layout = Layout(tp=row.tp, pp=row.pp, global_batch=row.global_batch, micro_batch=1,
                    schedule="interleaved" if v > 1 else "1f1b", virtual=v, recompute="full",
                    sequence_parallel=False, flash_attention=False, zero=0, comm_dtype="bf16",
                    overlap=Overlap.none())
    return model, cluster, layout


def paper_flops(row: Row, seq: int = 2048, vocab: int = 51200) -> float:
    """FLOPs per iteration as Narayanan et al. count them (forward, backward, recompute)."""
    b, s, l, h = row.global_batch, seq, row.layers, row.hidden
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))


def predict(row: Row, fitted: dict[str, float] | None = None) -> float:
    """Predicted TFLOP/s per GPU (the paper's FLOP count over the predicted step time)."""
    est = estimate(*row_setup(row, fitted))
    return paper_flops(row) / est.step_time_s / row.gpus / 1e12


def errors(fitted: dict[str, float] | None = None,
           rows: list[Row] | None = None) -> list[tuple[Row, float, float]]:
    """(row, predicted TFLOP/s per GPU, relative error) per row."""
    out = []
    for row in rows or load_table():
        pred = predict(row, fitted)
        out.append((row, pred, pred / row.tflops_per_gpu - 1.0))
    return out


def _objective(fitted: dict[str, float], rows: list[Row]) -> float:
    return sum(math.log(1.0 + e) ** 2 for _, _, e in errors(fitted, rows))


def _to_params(x: list[float]) -> dict[str, float]:
    sig = [1.0 / (1.0 + math.exp(-z)) for z in x]
    return {"gemm_e_max": sig[0], "gemm_d_half": math.exp(x[1]),
            "nvlink_efficiency": sig[2], "ib_efficiency": sig[3]}


def _from_params(p: dict[str, float]) -> list[float]:
    def logit(y: float) -> float:
        y = min(max(y, 1e-6), 1 - 1e-6)
        return math.log(y / (1 - y))
    return [logit(p["gemm_e_max"]), math.log(max(p["gemm_d_half"], 1e-3)),
            logit(p["nvlink_efficiency"]), logit(p["ib_efficiency"])]


def _nelder_mead(f, x0: list[float], step: float = 0.5, iters: int = 400,
                 tol: float = 1e-10) -> list[float]:
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        refl = [c[j] + (c[j] - pts[-1][j]) for j in range(n)]
        fr = f(refl)
        if fr < vals[0]:
            exp = [c[j] + 2 * (c[j] - pts[-1][j]) for j in range(n)]
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = [c[j] + 0.5 * (pts[-1][j] - c[j]) for j in range(n)]
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                for i in range(1, n + 1):
                    pts[i] = [pts[0][j] + 0.5 * (pts[i][j] - pts[0][j]) for j in range(n)]
                    vals[i] = f(pts[i])
    return pts[min(range(n + 1), key=lambda i: vals[i])]


def fit(rows: list[Row] | None = None, start: dict[str, float] | None = None) -> dict[str, float]:
    rows = rows or load_table()
    x = _nelder_mead(lambda z: _objective(_to_params(z), rows), _from_params(start or START))
    return {k: round(v, 4) for k, v in _to_params(x).items()}


def report(fitted: dict[str, float] | None = None) -> str:
    errs = errors(fitted)
    lines = ["| params | tp | pp | gpus | batch | published TFLOP/s | predicted | error |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, pred, e in errs:
        lines.append(f"| {row.params_b}B | {row.tp} | {row.pp} | {row.gpus} | "
                     f"{row.global_batch} | {row.tflops_per_gpu:.0f} | {pred:.1f} | "
                     f"{100 * e:+.1f}% |")
    abs_err = [abs(e) for _, _, e in errs]
    lines.append(f"\nmean |error| {100 * sum(abs_err) / len(abs_err):.1f}%, "
                 f"max |error| {100 * max(abs_err):.1f}%")
    return "\n".join(lines)


def role_lines(errs: list[tuple[str, float]]) -> list[str]:
    """Per role ("fit": used by a fit, "check": kept out), the mean and max |error| of
    ``errs`` ((role, relative error) per row)."""
    lines = []
    for role in ("fit", "check"):
        es = [abs(e) for r, e in errs if r == role]
        if es:
            lines.append(f"\n{role}: mean |error| {100 * sum(es) / len(es):.1f}%, max "
                         f"{100 * max(es):.1f}% ({len(es)} rows)")
    return lines


def fit_main(module: str, doc: str, shipped: dict[str, float], fit_fn, report_fn,
             argv: list[str] | None) -> int:
    """``python -m overlap.plan.<module> [--report]``: fit (or take ``shipped``) and report."""
    p = argparse.ArgumentParser(prog=f"python -m overlap.plan.{module}",
                                description=doc.split("\n")[0])
    p.add_argument("--report", action="store_true", help="only report the shipped parameters")
    args = p.parse_args(argv)
    fitted = dict(shipped) if args.report else fit_fn()
    print("fitted parameters:", fitted)
    print(report_fn(fitted))
    return 0


def main(argv: list[str] | None = None) -> int:
    return fit_main("fit", __doc__, {k: FITTED[k] for k in KEYS}, fit, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
