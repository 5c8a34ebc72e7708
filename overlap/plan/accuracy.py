"""The planner's error on every calibration table it ships, and the predictions pinned to them.

``python -m overlap.plan.accuracy`` (or ``python -m overlap.plan.calibrate``) prints, per
table, each row's published and predicted number, the error, and the mean and max error of the
rows a fit used and of the rows kept out of every fit. ``--pin`` rewrites ``data/pinned.json``
(each row's prediction, each table's stated errors) after a change meant to move predictions;
its diff shows which ones moved.
``tests/test_plan_pinning.py`` holds every prediction to that file, so a change to one term
that moves another table's predictions fails in CI instead of passing unseen.
The narrative: docs/planner.md ("Accuracy, and what holds it").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from typing import Callable

from overlap.plan import fit, fit_hopper, fit_moe

__all__ = ["TableRow", "TABLES", "table_rows", "summary", "pinned", "PINNED"]

PINNED = os.path.join(os.path.dirname(__file__), "data", "pinned.json")


@dataclasses.dataclass(slots=True, frozen=True)
class TableRow:
    key: str           # unique within its table
    published: float
    predicted: float
    unit: str          # "TFLOP/s per GPU" or "s per step"
    role: str          # "fit" (used by a fit) or "check" (kept out of every fit)

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1.0


def _a100() -> list[TableRow]:
    return [TableRow(f"{r.params_b}B tp{r.tp} pp{r.pp} {r.gpus} GPUs", r.tflops_per_gpu, pred,
                     "TFLOP/s per GPU", "fit") for r, pred, _ in fit.errors()]


def _moe() -> list[TableRow]:
    return [TableRow(r.name, r.step_s, pred, "s per step", r.role)
            for r, pred, _ in fit_moe.errors()]


def _balance() -> list[TableRow]:
    return [TableRow(f"seq {seq}", pub, pred, "dropless / forced-balance step time", "fit")
            for seq, pub, pred in fit_moe.balance_ratios(fit_moe.DROPLESS_IMBALANCE)]


def _hopper() -> list[TableRow]:
    # A run that states no TFLOP/s (a step time or tokens/s) is shown in the planner's FLOP count.
    return [TableRow(r.name, pred / (1.0 + e), pred, "TFLOP/s per GPU", r.role)
            for r, pred, e in fit_hopper.errors()]


# name -> (what the table is, its rows)
TABLES: dict[str, tuple[str, Callable[[], list[TableRow]]]] = {
    "a100-narayanan2021": ("dense GPT, A100-80GB, Narayanan et al. 2021 Table 1 "
                           "(data/narayanan2021_table1.csv)", _a100),
    "h100-moe-qwen3": ("MoE Qwen3-235B-A22B, H100, Megatron-Core model zoo, 4k to 128k tokens "
                       "(data/moe_runs.csv, moe_balance.csv)", _moe),
    "h100-moe-balance": (f"MoE routing, Qwen3-235B-A22B dropless against forced balance, H100, "
                         f"--moe-imbalance {fit_moe.DROPLESS_IMBALANCE} (data/moe_balance.csv)",
                         _balance),
    "hopper-dense": ("dense transformers, H100/H200, published runs (data/hopper_runs.csv)",
                     _hopper),
}


def table_rows(name: str) -> list[TableRow]:
    return TABLES[name][1]()


def summary(rows: list[TableRow]) -> dict[str, dict[str, float]]:
    """Per role ("fit", "check"): mean and max |error| over the rows, and how many."""
    out = {}
    for role in ("fit", "check"):
        errs = [abs(r.error) for r in rows if r.role == role]
        if errs:
            out[role] = {"rows": len(errs), "mean": sum(errs) / len(errs), "max": max(errs)}
    return out


def pinned(path: str = PINNED) -> dict:
    with open(path) as f:
        return json.load(f)


def _pin(path: str = PINNED) -> None:
    doc = {"predictions": {}, "stated": {}}
    for name in TABLES:
        rows = table_rows(name)
        doc["predictions"][name] = {r.key: r.predicted for r in rows}
        # the stated errors (what docs/planner.md prints), rounded up to 0.1%
        doc["stated"][name] = {role: {k: v if k == "rows" else math.ceil(1000 * v - 1e-9) / 1000
                                      for k, v in s.items()}
                               for role, s in summary(rows).items()}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


def report(name: str) -> str:
    what, _ = TABLES[name]
    rows = table_rows(name)
    width = max(len(r.key) for r in rows)
    lines = [f"{name}: {what}",
             f"{'row':<{width}}  role   {'published':>10} {'predicted':>10}  error  ({rows[0].unit})"]
    for r in rows:
        lines.append(f"{r.key:<{width}}  {r.role:<5} {r.published:>10.4g} {r.predicted:>10.4g} "
                     f"{100 * r.error:+6.1f}%")
    for role, s in summary(rows).items():
        kept = "used by the fit" if role == "fit" else "kept out of every fit"
        lines.append(f"{role:<5} ({kept}, {s['rows']} rows): mean |error| "
                     f"{100 * s['mean']:.1f}%, max {100 * s['max']:.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m overlap.plan.accuracy") -> int:
    p = argparse.ArgumentParser(prog=prog,
                                description=__doc__.split("\n")[0])
    p.add_argument("--table", choices=sorted(TABLES), help="one table (default: every one)")
    p.add_argument("--pin", action="store_true",
                   help=f"rewrite {os.path.relpath(PINNED)} from the current predictions")
    args = p.parse_args(argv)
    if args.pin:
        _pin()
    print("\n\n".join(report(n) for n in ([args.table] if args.table else TABLES)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
