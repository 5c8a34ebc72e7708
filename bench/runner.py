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

Trace-measured overlap (``--profile DIR`` / ``--nsys``): every bench config inherits
``TraceOptions``; each rank builds a ``Tracer`` and passes ``trace=tracer.row(key)`` to
``time_fn`` (or wraps its own measured loop in ``tracer.region`` and each sample in
``tracer.sample``). Every timed sample becomes a ``step:<id>`` range, so the analyzer
(``overlap-analyze``: overlap.profile.analyze) reports it as one window; ``fill_trace_column``
then sets each row's ``trace_overlap%`` = 100 * hidden / comm over that row's windows on every
rank. ``python -m bench.runner fill OUT [REPORT]`` fills the column of a table written under
nsys, once nsys has written its report (it does so when the profiled process exits).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

from overlap.dist.device import RANKS_PER_GPU_ENV, ranks_per_gpu, sharing_note

__all__ = ["Timing", "time_fn", "Table", "machine_info", "parse_config", "command_line",
           "TraceOptions", "Tracer", "TRACE_COLUMN", "check_trace_options", "trace_columns",
           "finish_trace_column", "fill_trace_column", "add_fields", "sharing_flag",
           "apply_sharing_flag"]

TRACE_COLUMN = "trace_overlap%"


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
            sync: Callable[[], Any] | None = None, trace: "_Row | None" = None) -> Timing:
    """Time ``fn`` ``iters`` times after ``warmup`` calls; ``sync`` runs before each clock read
    (e.g. a process-group barrier so every rank starts together, or cuda.synchronize).
    ``trace`` (``Tracer.row``): the timed iterations, not the warm-up, form its traced region,
    and each timed call is one step range."""
    for _ in range(warmup):
        fn()
    samples = []
    with trace.region() if trace is not None else contextlib.nullcontext():
        for _ in range(iters):
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            with trace.sample() if trace is not None else contextlib.nullcontext():
                fn()
            if sync is not None:
                sync()
            samples.append(time.perf_counter() - t0)
    return Timing(samples)


def time_interleaved(fns: dict[str, Callable[[], Any]], *, warmup: int = 2, iters: int = 10,
                     sync: Callable[[], Any] | None = None) -> dict[str, Timing]:
    """``time_fn`` for several callables at once: each of ``iters`` rounds times every one in
    turn (``sync`` before and after each), so a slow stretch of a noisy machine hits them all
    alike and their ratios compare like with like."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            samples[name].append(time.perf_counter() - t0)
    return {name: Timing(s) for name, s in samples.items()}


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
        "ranks_per_gpu": ranks_per_gpu(),
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
        shared = sharing_note(machine.get("ranks_per_gpu") or 1)
        notes = [f"**{shared}**"] * bool(shared) + self.notes
        lines += [f"- {n}" for n in notes]
        if notes:
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

    def write(self, stem: str, machine: dict[str, Any] | None = None) -> tuple[str, str]:
        """Write ``<stem>.json`` and ``<stem>.md``; returns both paths. ``machine``: keep a
        loaded table's description (default: this machine, now)."""
        if machine is None:
            machine = machine_info()
            machine["commit"] = _git_rev()
        os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump({"title": self.title, "machine": machine, "notes": self.notes,
                       "columns": self.columns, "rows": self.rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(self.markdown(machine))
        return stem + ".json", stem + ".md"


    @classmethod
    def load(cls, stem: str) -> tuple["Table", dict[str, Any]]:
        """A table written by ``write`` and its machine description."""
        with open(stem + ".json") as f:
            data = json.load(f)
        table = cls(data["title"], data["columns"], notes=data["notes"])
        table.rows = data["rows"]
        return table, data["machine"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.3f}"
    return str(v)


def add_fields(parser: argparse.ArgumentParser, cls: type,
               skip: tuple[str, ...] = ()) -> None:
    """``--field-name VALUE`` per field of the dataclass ``cls`` (tuples as ``nargs='+'``,
    bools as switches), so a CLI never defines a setting a second time."""
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        val = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(val, bool):
            parser.add_argument(flag, action="store_true", default=val)
        elif isinstance(val, tuple):
            parser.add_argument(flag, nargs="+", type=type(val[0]), default=val)
        else:
            parser.add_argument(flag, type=type(val), default=val)


def parse_config(cls: type, description: str, argv: list[str] | None = None) -> Any:
    """A bench's CLI, generated from its config dataclass (one definition of the settings):
    ``--field-name VALUE`` per field, tuples as ``nargs='+'``, bools as switches; and
    ``--ranks-per-gpu`` (``sharing_flag``)."""
    ap = argparse.ArgumentParser(description=description)
    add_fields(ap, cls)
    sharing_flag(ap)
    ns = vars(ap.parse_args(argv))
    apply_sharing_flag(ap, ns)
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in ns.items()})


def sharing_flag(parser: argparse.ArgumentParser) -> None:
    """``--ranks-per-gpu N``, which every bench takes: N ranks share each GPU (the launcher
    reads it from env OVERLAP_RANKS_PER_GPU, and every table then says its timings mean
    nothing for speed)."""
    parser.add_argument("--ranks-per-gpu", type=int, default=None, metavar="N",
                        help="ranks that share one GPU (default: env OVERLAP_RANKS_PER_GPU, "
                             "else 1); for correctness runs on one GPU, not for speed")


def apply_sharing_flag(parser: argparse.ArgumentParser, ns: dict) -> None:
    """Take ``--ranks-per-gpu`` out of the parsed ``ns`` into this process's environment, where
    ``overlap.dist.launch`` and torchrun's ranks find it; a bad value is a usage error."""
    value = ns.pop("ranks_per_gpu", None)
    try:
        os.environ[RANKS_PER_GPU_ENV] = str(ranks_per_gpu(value))
    except ValueError as exc:
        parser.error(str(exc))


def command_line(module: str, cfg: Any) -> str:
    """The command that reproduces ``cfg`` through ``parse_config``: ``python -m module`` plus
    a flag for every field that differs from the dataclass default."""
    defaults = type(cfg)()

    def flag(k: str, v: Any) -> str:
        name = " --" + k.replace("_", "-")
        if isinstance(v, bool):
            return name
        return f"{name} {' '.join(map(str, v)) if isinstance(v, tuple) else v}"

    flags = "".join(flag(k, v) for k, v in dataclasses.asdict(cfg).items()
                    if v != getattr(defaults, k))
    return f"python -m {module}{flags}"


# -- trace-measured overlap: --profile DIR (torch.profiler) and --nsys (Nsight Systems) ---------

@dataclasses.dataclass(kw_only=True, slots=True)
class TraceOptions:
    """The tracing settings every bench config inherits (so every bench takes the same flags).

    ``profile``: a directory; each measured region is traced by torch.profiler on every rank
    (all threads: on CPU the communication runs on gloo's and the copier's threads) into
    ``<profile>/<region>/trace_rank<r>.json``, and the table gets ``trace_overlap%``.
    ``nsys``: the run is under ``nsys profile --capture-range=cudaProfilerApi
    --capture-range-end=stop``; each rank calls ``torch.cuda.profiler.start()`` when its first
    measured region begins and ``stop()`` after its last (a ``stop`` capture has one range, so
    warm-ups between regions are in the report too; only the step ranges of timed samples
    count). ``nsys_report``: the report nsys writes (its ``-o``), default ``<out>.nsys-rep``;
    nsys writes it when the profiled process exits, so the column is filled by ``python -m
    bench.runner fill <out>`` afterwards (or at once, if the report already exists)."""

    profile: str = ""
    nsys: bool = False
    nsys_report: str = ""


def check_trace_options(opts: TraceOptions, prog: str, *, cuda: bool) -> None:
    """Exit with one line on stderr (status 2) for settings that cannot work here: ``cuda`` is
    whether this run's ranks compute on CUDA devices."""
    err = None
    if opts.nsys and opts.profile:
        err = "--nsys and --profile both trace the measured region; pick one"
    elif opts.nsys and not cuda:
        import torch

        err = ("--nsys needs CUDA: Nsight Systems captures CUDA work between "
               "torch.cuda.profiler.start()/stop(), and "
               + ("this machine has no CUDA device" if not torch.cuda.is_available()
                  else "this run computes on the CPU (pass --device cuda, or use torchrun)")
               + "; use --profile DIR for torch.profiler traces")
    elif opts.nsys_report and not opts.nsys:
        err = "--nsys-report is the report of an --nsys run; pass --nsys too"
    if err is not None:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2)


def trace_columns(columns: list[str], opts: TraceOptions, *, after: str) -> list[str]:
    """``columns`` with ``trace_overlap%`` after ``after`` when this run traces."""
    if not (opts.profile or opts.nsys):
        return list(columns)
    i = columns.index(after) + 1
    return columns[:i] + [TRACE_COLUMN] + columns[i:]


class _Row:
    """One table row's traced region and step ranges (``Tracer.row``)."""

    def __init__(self, tracer: "Tracer", key: str, region: str):
        self.tracer, self.key, self.region_name = tracer, key, region

    def region(self) -> contextlib.AbstractContextManager[None]:
        return self.tracer.region(self.region_name)

    def sample(self) -> contextlib.AbstractContextManager[None]:
        return self.tracer.sample(self.key)


class Tracer:
    """One rank's tracing of a bench's measured regions (a no-op without --profile/--nsys).

    ``region(name)``: a measured region (profile: one torch.profiler session, exported per rank
    to ``<profile>/<prefix><name>/``; nsys: the capture range starts at the first one).
    ``sample(key)``: one timed sample of row ``key``, a ``step:<id>`` range (NVTX on CUDA,
    record_function everywhere) with ids in issue order: every rank runs the same loop, so a
    sample has the same id on every rank. ``info(key)`` goes into the row: where its steps
    are. ``close()`` ends the nsys capture range."""

    def __init__(self, opts: TraceOptions, *, rank: int, device: Any, prefix: str = ""):
        self.opts, self.rank, self.device, self.prefix = opts, rank, device, prefix
        self.on = bool(opts.profile or opts.nsys)
        self._next = 0
        self._steps: dict[str, tuple[str | None, list[int]]] = {}
        self._capturing = False
        self._region: str | None = None

    def row(self, key: str, region: str | None = None) -> _Row:
        return _Row(self, key, region if region is not None else key)

    def _sync(self) -> None:
        import torch

        if getattr(self.device, "type", "cpu") == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        if not self.on:
            yield
            return
        import torch

        self._region = self.prefix + _slug(name)
        if self.opts.nsys:
            if not self._capturing:
                self._sync()
                torch.cuda.profiler.start()
                self._capturing = True
            yield
            return
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if getattr(self.device, "type", "cpu") == "cuda":
            acts.append(ProfilerActivity.CUDA)
        # Every thread: on CPU the communication runs on gloo's threads and the copier's.
        prof = profile(activities=acts,
                       experimental_config=_ExperimentalConfig(profile_all_threads=True))
        self._sync()
        prof.start()
        try:
            yield
        finally:
            self._sync()
            prof.stop()
        out = os.path.join(self.opts.profile, self._region)
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"trace_rank{self.rank}.json"))

    @contextlib.contextmanager
    def sample(self, key: str) -> Iterator[None]:
        if not self.on:
            yield
            return
        from overlap.profile import nvtx

        step = self._next
        self._next += 1
        where = None if self.opts.nsys else self._region
        self._steps.setdefault(key, (where, []))[1].append(step)
        with nvtx.step(step):
            yield

    def wrap(self, key: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` run as one sample of row ``key`` (for loops that time calls themselves)."""
        def traced() -> Any:
            with self.sample(key):
                return fn()
        return traced

    def info(self, key: str) -> dict[str, Any]:
        """What a row carries so ``fill_trace_column`` finds its windows (empty when off)."""
        if not self.on:
            return {}
        region, steps = self._steps.get(key, (None, []))
        return {"trace_region": region, "trace_steps": list(steps)}

    def close(self) -> None:
        if self._capturing:
            import torch

            self._sync()
            torch.cuda.profiler.stop()
            self._capturing = False


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip("_") or "region"


def _windows_by_step(path: str) -> dict[int, list[dict[str, Any]]]:
    """Every (rank, step) window of a trace, by step number: the analyzer's own report."""
    from overlap.profile.analyze import AnalyzeConfig, analyze

    report = analyze(path, AnalyzeConfig(progress="off"))
    by_step: dict[int, list[dict[str, Any]]] = {}
    for rank in report["ranks"]:
        for s in rank["steps"]:
            if s["step"] is not None:
                by_step.setdefault(s["step"], []).append(s)
    return by_step


def fill_trace_column(rows: list[dict[str, Any]], source: str) -> None:
    """Set each row's ``trace_overlap%`` = 100 * sum(hidden) / sum(comm) over the windows of
    its steps on every rank (``-`` when they hold no communication). ``source``: the --profile
    directory (a row's ``trace_region`` is a subdirectory of it) or one nsys export / report
    for all rows."""
    cache: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for row in rows:
        steps = row.get("trace_steps")
        if steps is None:
            continue
        region = row.get("trace_region")
        path = source if region is None else os.path.join(source, region)
        if path not in cache:
            cache[path] = _windows_by_step(path)
        windows = [w for s in steps for w in cache[path].get(s, [])]
        comm = sum(w["comm_s"] for w in windows)
        hidden = sum(w["hidden_s"] for w in windows)
        row[TRACE_COLUMN] = 100.0 * hidden / comm if comm > 0 else "-"


def _nsys_sqlite(report: str) -> str:
    """The sqlite export of an nsys report: the file itself if it is one, else ``nsys export
    --type sqlite`` into ``<report stem>.sqlite`` next to it."""
    if not report.endswith((".nsys-rep", ".qdrep")):
        return report
    from overlap.profile.nsys import export_report

    target = os.path.splitext(report)[0] + ".sqlite"
    exported, tmp = export_report(report)
    try:
        shutil.move(str(exported), target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _report_path(opts: TraceOptions, out: str) -> str:
    return opts.nsys_report or out + ".nsys-rep"


def finish_trace_column(opts: TraceOptions, rows: list[dict[str, Any]], out: str,
                        prog: str) -> None:
    """After the ranks are done: fill ``trace_overlap%`` from the --profile traces, or from the
    nsys report when it already exists; otherwise mark it pending and say how to fill it."""
    if opts.profile:
        fill_trace_column(rows, opts.profile)
        return
    if not opts.nsys:
        return
    report = _report_path(opts, out)
    if os.path.exists(report):
        fill_trace_column(rows, _nsys_sqlite(report))
        return
    for row in rows:
        row.setdefault(TRACE_COLUMN, "pending")
    print(f"{prog}: {TRACE_COLUMN} is pending: nsys writes {report} when this process exits; "
          f"then run: python -m bench.runner fill {out}"
          + ("" if not opts.nsys_report else f" {report}"), file=sys.stderr)


def _fill_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.runner fill",
        description="Fill the trace_overlap% column of a bench table written under --nsys from "
                    "nsys's report (exported to sqlite next to it), or of any traced table from "
                    "a --profile directory.")
    ap.add_argument("out", help="the table's stem: <out>.json and <out>.md")
    ap.add_argument("source", nargs="?", default=None,
                    help="nsys report (.nsys-rep) or its sqlite export, or a --profile "
                         "directory; default <out>.nsys-rep")
    a = ap.parse_args(argv)
    try:
        table, machine = Table.load(a.out)
        source = a.source or a.out + ".nsys-rep"
        if not os.path.exists(source):
            raise ValueError(f"{source}: no such file or directory")
        if TRACE_COLUMN not in table.columns:
            raise ValueError(f"{a.out}.json has no {TRACE_COLUMN} column (not a traced run)")
        fill_trace_column(table.rows, source if os.path.isdir(source) else _nsys_sqlite(source))
    except (ValueError, OSError, KeyError) as exc:
        print(f"bench.runner fill: error: {str(exc).splitlines()[0] if str(exc) else exc!r}",
              file=sys.stderr)
        return 2
    paths = table.write(a.out, machine)
    print(table.markdown(machine))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["fill"]:
        print("usage: python -m bench.runner fill OUT [SOURCE]", file=sys.stderr)
        sys.exit(2)
    sys.exit(_fill_main(sys.argv[2:]))
