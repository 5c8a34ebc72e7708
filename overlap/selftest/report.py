"""One result per check, merged over the ranks: a progress line as each finishes, then a table
and JSON."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, TextIO

__all__ = ["RankResult", "CheckResult", "merge", "Progress", "format_table", "format_environment",
           "write_json", "JSON_FIELDS"]

JSON_FIELDS = ("name", "passed", "seconds", "metric", "measured", "limit", "error", "detail")


@dataclasses.dataclass(kw_only=True, slots=True)
class RankResult:
    """One check on one rank; ``measured`` is None when the rank had nothing to measure."""

    name: str
    passed: bool
    seconds: float
    metric: str = ""
    measured: float | None = None
    limit: float | None = None
    error: str = ""
    detail: str = ""


@dataclasses.dataclass(kw_only=True, slots=True)
class CheckResult:
    """A check over all ranks: it passed iff it passed on every rank; ``seconds`` is the
    slowest rank's time, ``measured`` the worst rank's value and ``error`` the first failing
    rank's error."""

    name: str
    passed: bool
    seconds: float
    metric: str
    measured: float | None
    limit: float | None
    error: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def merge(names: list[str], per_rank: list[list[dict] | None],
          rank_errors: list[str | None]) -> list[CheckResult]:
    """Combine every rank's results (dicts of RankResult). A rank that returned nothing (it
    died, hung or failed outside a check) fails every check with its error."""
    merged = []
    for name in names:
        rows: list[tuple[int, RankResult | None]] = []
        for rank, results in enumerate(per_rank):
            found = [RankResult(**d) for d in results or [] if d["name"] == name]
            rows.append((rank, found[0] if found else None))
        errors, seconds, metric, measured, limit, detail = [], 0.0, "", None, None, ""
        for rank, res in rows:
            if res is None:
                errors.append(f"rank {rank}: {rank_errors[rank] or 'no result'}")
                continue
            seconds = max(seconds, res.seconds)
            metric, detail = metric or res.metric, detail or res.detail
            if res.measured is not None and (measured is None or not res.measured <= measured):
                measured, limit = res.measured, res.limit
            if not res.passed:
                errors.append(f"rank {rank}: {res.error}")
        merged.append(CheckResult(name=name, passed=not errors, seconds=seconds, metric=metric,
                                  measured=measured, limit=limit, error="; ".join(errors),
                                  detail=detail))
    return merged


def _time(seconds: float) -> str:
    return f"{1e3 * seconds:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _measured(r: CheckResult) -> str:
    if r.measured is None:
        return ""
    return f"{r.metric} {r.measured:.3g} <= {r.limit:.3g}"


def _one_line(text: str, width: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 3] + "..."


class Progress:
    """One line per finished check, ``[ k/N] name  pass  12 ms``: in a log (not a TTY) each on
    its own line; on a terminal one line rewritten in place, where a failure's line stays."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total, self.done = total, 0
        self.stream = stream if stream is not None else sys.stdout
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self._open = False  # a terminal line waiting to be overwritten

    def __call__(self, r: CheckResult) -> None:
        self.done += 1
        width = len(str(self.total))
        line = (f"[{self.done:>{width}}/{self.total}] {r.name}  "
                f"{'pass' if r.passed else 'FAIL'}  {_time(r.seconds)}")
        if not r.passed:
            line += f"  {_one_line(r.error, 80)}"
        if self.tty:
            self.stream.write(f"\r\x1b[K{line}" + ("" if r.passed else "\n"))
            self._open = r.passed
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._open = False


def format_table(results: list[CheckResult], *, error_width: int = 100) -> str:
    head = ("check", "result", "time", "measured", "error")
    rows = [(r.name, "pass" if r.passed else "FAIL", _time(r.seconds), _measured(r),
             _one_line(r.error, error_width)) for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:{'>' if i == 2 else '<'}{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head).rstrip(), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*row).rstrip() for row in rows]
    return "\n".join(lines)


def format_environment(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_json(path: str, *, environment: dict, run: dict, results: list[CheckResult]) -> None:
    doc = {"passed": bool(results) and all(r.passed for r in results), **run,
           "environment": environment, "checks": [r.as_dict() for r in results]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
