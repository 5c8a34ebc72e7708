"""Shared benchmark runner: timing, the machine description, and JSON + markdown output.

Every bench script measures its op and its baseline *in the same run* and reports ratios from
medians, because these machines are noisy. Use:

    from bench.runner import time_fn, Table, machine_info

    t = time_fn(lambda: op(x), warmup=2, iters=10, sync=group_barrier)   # -> Timing
    table = Table("matmul_reduce_scatter", columns=["shape", "backend", "median_ms", "speedup"])
    table.add(shape="...", backend="chunked", median_ms=t.median_ms, speedup=base.median / t.median)
    table.write("bench/results/tp_ops")   # writes tp_ops.json and tp_ops.md

On GPUs pass ``sync=torch.cuda.synchronize`` (or a barrier that includes it) so the clock stops
when the device work is done; NVTX ranges come from overlap.profile.nvtx.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable

__all__ = ["Timing", "time_fn", "Table", "machine_info", "parse_config", "command_line"]


@dataclasses.dataclass(slots=True)
class Timing:
    """Seconds per iteration for each timed iteration (after warm-up)."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def median_ms(self) -> float:
        return 1e3 * self.median

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the run was."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, iters: int = 10,
            sync: Callable[[], Any] | None = None) -> Timing:
    """Time ``fn`` ``iters`` times after ``warmup`` calls; ``sync`` runs before each clock read
    (e.g. a process-group barrier so every rank starts together, or cuda.synchronize)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        samples.append(time.perf_counter() - t0)
    return Timing(samples)


def machine_info() -> dict[str, Any]:
    """What ran the benchmark: enough for a reader to know what the numbers can say."""
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_rev() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=os.path.dirname(__file__))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class Table:
    """Rows of results with fixed columns, written as JSON and as a markdown table."""

    def __init__(self, title: str, columns: list[str], notes: list[str] | None = None):
        self.title = title
        self.columns = columns
        self.notes = list(notes or [])
        self.rows: list[dict[str, Any]] = []

    def add(self, **row: Any) -> None:
        missing = [c for c in self.columns if c not in row]
        if missing:
            raise ValueError(f"Table.add: row lacks columns {missing} (has {sorted(row)})")
        self.rows.append(row)

    def markdown(self, machine: dict[str, Any]) -> str:
        lines = [f"# {self.title}", ""]
        desc = ", ".join(f"{k}: {v}" for k, v in machine.items() if v is not None)
        lines += [f"Machine: {desc}.", ""]
        lines += [f"- {n}" for n in self.notes]
        if self.notes:
            lines.append("")
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(_fmt(row[c]) for c in self.columns) + " |")
        return "\n".join(lines) + "\n"

    def publish(self, stem: str) -> None:
        """Write ``<stem>.json`` and ``<stem>.md`` and print the markdown table."""
        _, md = self.write(stem)
        with open(md) as f:
            print(f.read())

    def write(self, stem: str) -> tuple[str, str]:
        """Write ``<stem>.json`` and ``<stem>.md``; returns both paths."""
        machine = machine_info()
        machine["commit"] = _git_rev()
        os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump({"title": self.title, "machine": machine, "notes": self.notes,
                       "columns": self.columns, "rows": self.rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(self.markdown(machine))
        return stem + ".json", stem + ".md"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.3f}"
    return str(v)


def parse_config(cls: type, description: str, argv: list[str] | None = None) -> Any:
    """A bench's CLI, generated from its config dataclass (one definition of the settings):
    ``--field-name VALUE`` per field, tuples as ``nargs='+'``."""
    defaults = cls()
    ap = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(cls):
        val = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(val, tuple):
            ap.add_argument(flag, nargs="+", type=type(val[0]), default=val)
        else:
            ap.add_argument(flag, type=type(val), default=val)
    ns = vars(ap.parse_args(argv))
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in ns.items()})


def command_line(module: str, cfg: Any) -> str:
    """The command that reproduces ``cfg`` through ``parse_config``: ``python -m module`` plus
    a flag for every field that differs from the dataclass default."""
    defaults = type(cfg)()
    flags = "".join(
        f" --{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in dataclasses.asdict(cfg).items() if v != getattr(defaults, k))
    return f"python -m {module}{flags}"
