"""``overlap-analyze PATH``: per rank and per step, how much communication ran and how much of it
compute hid, from a torch.profiler trace, a directory of per-rank traces, or an Nsight Systems
export (``nsys export --type sqlite``; a ``.nsys-rep`` is exported when ``nsys`` is on PATH).

    overlap-analyze runs/prof                      # overlap.train --profile's trace_rank<r>.json
    overlap-analyze report.sqlite --json           # one JSON object on stdout
    overlap-analyze report.nsys-rep --plot t.png   # lanes per rank: compute, comm, exposed, ...
    overlap-analyze --compare runs/off runs/on     # two traces side by side

The output leads with the exposed communication (% of the step, per rank) and a table per
kind (tp, pp, dp, ep, cp, offload), details after. Definitions: ``overlap/profile/metrics.py``
(``exposed``, the one definition every report uses); how rows are classified: the naming scheme in
``overlap/profile/names.py`` and the kernel registry in ``overlap/kernels/registry.py``.
Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from overlap import cli
from overlap.profile import metrics
from overlap.profile.kineto import rank_from_name, read_kineto
from overlap.profile.nsys import export_report, read_nsys_sqlite
from overlap.profile.progress import LARGE_BYTES, Progress
from overlap.profile.spans import RankTrace

__all__ = ["AnalyzeConfig", "load_traces", "analyze", "format_table", "format_compare", "main"]

PROG = "overlap-analyze"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_JSON_SUFFIXES = (".json", ".json.gz")
_SQLITE_SUFFIXES = (".sqlite", ".sqlite3", ".db")
_REPORT_SUFFIXES = (".nsys-rep", ".qdrep")


@dataclasses.dataclass(kw_only=True, slots=True)
class AnalyzeConfig:
    path: str | None = None
    compare: list[str] | None = None
    json: bool = False
    png: str | None = None
    top: int = 5
    progress: str = "auto"  # "auto": on for inputs of LARGE_BYTES or more; "on"; "off"


def _progress(cfg: AnalyzeConfig, path: Path, label: str) -> Progress:
    size = path.stat().st_size if path.is_file() else 0
    on = cfg.progress == "on" or (cfg.progress == "auto" and size >= LARGE_BYTES)
    return Progress(label, enabled=on)


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(_REPORT_SUFFIXES):
        return "report"
    if name.endswith(_SQLITE_SUFFIXES):
        return "sqlite"
    if name.endswith(_JSON_SUFFIXES):
        return "json"
    with open(path, "rb") as f:
        return "sqlite" if f.read(16) == _SQLITE_MAGIC else "json"


def _load_file(path: Path, cfg: AnalyzeConfig, default_rank: int) -> list[RankTrace]:
    kind = _kind(path)
    prog = _progress(cfg, path, f"reading {path.name}")
    try:
        if kind == "json":
            return [read_kineto(path, default_rank=default_rank, progress=prog)]
        if kind == "sqlite":
            traces = read_nsys_sqlite(path, progress=prog)
        else:
            sqlite, tmp = export_report(path)
            try:
                traces = read_nsys_sqlite(sqlite, progress=prog)
                for t in traces:
                    t.source = str(path)  # the export is a temporary file
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        prog.close()
    if len(traces) == 1:  # one report per rank (nsys profile -o report_rank%q{RANK})
        traces[0].rank = rank_from_name(path, default_rank)
    return traces


def load_traces(path: str | Path, cfg: AnalyzeConfig | None = None) -> list[RankTrace]:
    """Every rank in a file or a directory of per-rank files, sorted by rank. In a directory,
    JSON files that are not Chrome traces (``overlap_metrics.json``) are skipped."""
    cfg = cfg or AnalyzeConfig()
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if path.is_file():
        return sorted(_load_file(path, cfg, 0), key=lambda t: t.rank)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().endswith(
        _JSON_SUFFIXES + _SQLITE_SUFFIXES + _REPORT_SUFFIXES))
    traces: list[RankTrace] = []
    for i, f in enumerate(files):
        try:
            traces += _load_file(f, cfg, i)
        except ValueError as exc:
            if _kind(f) == "json" and "Chrome trace" in str(exc):
                continue
            raise
    if not traces:
        raise ValueError(f"{path}: no torch.profiler trace (*.json) or nsys export (*.sqlite, "
                         "*.nsys-rep) in this directory")
    seen: dict[int, str] = {}
    for t in traces:
        if t.rank in seen and seen[t.rank] != t.source:
            raise ValueError(f"{path}: rank {t.rank} appears in both {seen[t.rank]} and "
                             f"{t.source}; put one run's traces in a directory")
        seen[t.rank] = t.source
    return sorted(traces, key=lambda t: t.rank)


def analyze(path: str | Path, cfg: AnalyzeConfig | None = None) -> dict[str, Any]:
    """The JSON report of one path: per-rank steps and totals, top exposed ranges, summary."""
    cfg = cfg or AnalyzeConfig()
    traces = load_traces(path, cfg)
    reports = [metrics.analyze_rank(t, top=cfg.top) for t in traces]
    return {"source": str(path), "format": traces[0].fmt,
            "schema_version": traces[0].schema_version,
            "ranks": [r.as_dict() for r in reports], "summary": metrics.summary(reports),
            "_traces": traces}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.3f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


_COLS = ("step_s", "compute_s", "comm_s", "hidden_s", "exposed_s", "fused_s")


def _kind_rows(by_kind: dict[str, dict[str, float]], step_s: float) -> list[str]:
    rows = []
    for k, v in by_kind.items():
        hidden = 100.0 * v["hidden_s"] / v["comm_s"] if v["comm_s"] > 0 else None
        exposed = 100.0 * v["exposed_s"] / step_s if step_s > 0 else None
        rows.append(f"{k:<8} {_ms(v['exposed_s']):>10} {_pct(exposed):>8} "
                    f"{_ms(v['comm_s']):>10} {_ms(v['hidden_s']):>10} {_pct(hidden):>8}")
    return rows


def _kinds_over_ranks(ranks: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for r in ranks:
        for k, v in r["by_kind"].items():
            cur = out.setdefault(k, dict.fromkeys(metrics.KIND_FIELDS, 0.0))
            for f in metrics.KIND_FIELDS:
                cur[f] += v[f]
    return out


def format_table(report: dict[str, Any]) -> str:
    """The headline (exposed % of the step, per rank), the per-kind table, then the details."""
    ranks, s = report["ranks"], report["summary"]
    modes = sorted({r["mode"] for r in ranks})
    lines = [f"{PROG}: {report['source']} ({report['format']}, {len(ranks)} rank(s), "
             f"{'/'.join(modes)} mode; times in ms)"]
    if s:
        lines.append(f"exposed communication: {_pct(s['exposed_pct'])}% of the step "
                     f"({_ms(s['exposed_s'])} of {_ms(s['step_s'])} ms per step, mean over "
                     "ranks)")
    lines.append(f"{'rank':>4} {'exposed%':>8} {'exposed':>10} {'step':>10} {'hidden%':>8} "
                 f"{'fused':>10}")
    for r in ranks:
        t = r["total"]
        lines.append(f"{r['rank']:>4} {_pct(t['exposed_pct']):>8} {_ms(t['exposed_s']):>10} "
                     f"{_ms(t['step_s']):>10} {_pct(t['overlap_pct']):>8} {_ms(t['fused_s']):>10}")
    step_all = sum(r["total"]["step_s"] for r in ranks)
    lines += ["", "by kind, all ranks (exposed% of the step; hidden% of the kind's communication)",
              f"{'kind':<8} {'exposed':>10} {'exposed%':>8} {'comm':>10} {'hidden':>10} "
              f"{'hidden%':>8}"]
    lines += _kind_rows(_kinds_over_ranks(ranks), step_all)
    lines += ["", "details: per rank and step",
              f"{'rank':>4} {'step':>5} {'step':>10} {'compute':>10} {'comm':>10} {'hidden':>10} "
              f"{'exposed':>10} {'fused':>10} {'overlap%':>8} {'exposed%':>8}"]
    for r in ranks:
        for st in r["steps"] + [r["total"]]:
            label = "all" if st is r["total"] else ("-" if st["step"] is None else st["step"])
            lines.append(f"{r['rank']:>4} {label:>5} " + " ".join(
                f"{_ms(st[c]):>10}" for c in _COLS)
                + f" {_pct(st['overlap_pct']):>8} {_pct(st['exposed_pct']):>8}")
    lines += ["", "details: top exposed communication (each exposed instant charged to one range;"
              " count = occurrences)", f"{'rank':>4} {'exposed':>10} {'count':>6} {'kind':<8} "
              "range [kernel]"]
    for r in ranks:
        for t in r["top_exposed"]:
            what = t["range"] + (f" [{t['kernel']}]" if t["kernel"] else "")
            lines.append(f"{r['rank']:>4} {_ms(t['exposed_s']):>10} {t['count']:>6} "
                         f"{t['kind']:<8} {what}")
    lines += ["", "details: by kind per rank",
              f"{'rank':>4} {'kind':<8} {'exposed':>10} {'exposed%':>8} {'comm':>10} "
              f"{'hidden':>10} {'hidden%':>8}"]
    for r in ranks:
        lines += [f"{r['rank']:>4} {row}" for row in _kind_rows(r["by_kind"],
                                                              r["total"]["step_s"])]
    return "\n".join(lines)


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    sa, sb = a["summary"], b["summary"]
    diff = {k: (None if sa.get(k) is None or sb.get(k) is None else sb[k] - sa[k])
            for k in _COLS + ("overlap_pct", "exposed_pct")}
    ratio = {k: (sb[k] / sa[k] if sa.get(k) and sb.get(k) is not None else None) for k in _COLS}
    return {"a": a, "b": b, "b_minus_a": diff, "b_over_a": ratio}


def format_compare(result: dict[str, Any]) -> str:
    a, b = result["a"], result["b"]
    sa, sb = a["summary"], b["summary"]
    lines = [f"{PROG} --compare (per step, mean over ranks and steps; times in ms)",
             f"  A: {a['source']} ({len(a['ranks'])} rank(s))",
             f"  B: {b['source']} ({len(b['ranks'])} rank(s))",
             f"{'':>12} {'A':>12} {'B':>12} {'B - A':>12} {'B / A':>8}"]
    for k in _COLS:
        r = result["b_over_a"][k]
        lines.append(f"{k[:-2] + ' ms':>12} {_ms(sa.get(k)):>12} {_ms(sb.get(k)):>12} "
                     f"{_ms(result['b_minus_a'][k]):>12} {'-' if r is None else f'{r:.3f}':>8}")
    for k in ("overlap_pct", "exposed_pct"):
        d = result["b_minus_a"][k]
        lines.append(f"{k[:-4] + ' %':>12} {_pct(sa.get(k)):>12} {_pct(sb.get(k)):>12} "
                     f"{'-' if d is None else f'{d:+.1f}':>12} {'-':>8}")
    return "\n".join(lines)


def _public(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if not k.startswith("_")}


def build_parser() -> argparse.ArgumentParser:
    d = AnalyzeConfig()
    p = cli.ArgumentParser(prog=PROG, description="Overlap metrics per rank and step from "
                           "a torch.profiler trace, a directory of per-rank traces, or an "
                           "nsys export.")
    p.add_argument("path", nargs="?", default=d.path,
                   help="trace file (.json[.gz], .sqlite, .nsys-rep) or directory of them")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), default=d.compare,
                   help="analyze two traces and show them side by side")
    p.add_argument("--json", action="store_true", default=d.json,
                   help="print one JSON object instead of the table")
    p.add_argument("--plot", "--png", dest="png", metavar="FILE", default=d.png,
                   help="draw a timeline (PNG): per rank, lanes for compute, NCCL, copy, waits "
                        "and the exposed communication")
    p.add_argument("--top", type=int, default=d.top,
                   help="exposed communication ranges listed per rank")
    p.add_argument("--progress", choices=("auto", "on", "off"), default=d.progress,
                   help="progress on stderr (auto: for inputs of 32 MiB or more)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = AnalyzeConfig(**vars(parser.parse_args(argv)))
    if (cfg.path is None) == (cfg.compare is None):
        parser.exit(2, f"{PROG}: error: give either PATH or --compare A B\n")
    if cfg.top < 0:
        parser.exit(2, f"{PROG}: error: --top must be >= 0, got {cfg.top}\n")
    try:
        if cfg.compare is None:
            report = analyze(cfg.path, cfg)
            groups = [(f"rank {r.rank}", r) for r in report["_traces"]]
            out = json.dumps(_public(report), indent=1) if cfg.json else format_table(report)
        else:
            a, b = (analyze(p, cfg) for p in cfg.compare)
            result = compare(a, b)
            groups = ([(f"A rank {r.rank}", r) for r in a["_traces"]]
                      + [(f"B rank {r.rank}", r) for r in b["_traces"]])
            result = {**result, "a": _public(a), "b": _public(b)}
            out = json.dumps(result, indent=1) if cfg.json else format_compare(result)
        if cfg.png:
            from overlap.profile.plot import plot_lanes

            plot_lanes(groups, cfg.png, title=f"{PROG} {cfg.path or ' vs '.join(cfg.compare)}")
    except (ValueError, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        parser.exit(2, f"{PROG}: error: {msg}\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
