"""Read an ``nsys export --type sqlite`` file into one ``RankTrace`` per profiled process.

Tables read (Nsight Systems SQLite schema 3.28.1; any table but one of NVTX_EVENTS /
CUPTI_ACTIVITY_KIND_KERNEL may be missing): StringIds, NVTX_EVENTS (ranges only: eventType 59
and 60), CUPTI_ACTIVITY_KIND_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_RUNTIME
(the launch of each kernel or copy) and META_DATA_EXPORT. Serialized ids:

    PID = globalTid / 0x1000000 % 0x1000000,   TID = globalTid % 0x1000000   (globalPid alike)

One process is one rank; ranks are numbered by their first device id, then PID. Timestamps are
nanoseconds in the file and microseconds here.

The narrative (columns, enums): docs/design/profiling.md.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from overlap.profile import names
from overlap.profile import spans as sp

__all__ = ["read_nsys_sqlite", "export_report", "NVTX_PUSH_POP", "NVTX_START_END"]

NVTX_PUSH_POP, NVTX_START_END = 59, 60
_ID = 0x1000000
_NS = 1000.0  # ns per us (divide, as the Chrome writer does, so both give the same floats)
_BATCH = 20_000

Progress = Callable[[int, int], None]


def _pid(global_id: int | None) -> int | None:
    return None if global_id is None else (global_id // _ID) % _ID


def _tid(global_tid: int | None) -> int:
    return 0 if global_tid is None else global_tid % _ID


class _Db:
    """Which tables and columns this export has: nsys versions differ, so every query names
    only columns that exist."""

    def __init__(self, con: sqlite3.Connection, path: str) -> None:
        self.con, self.path = con, path
        try:
            rows = con.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"{path}: not an SQLite file ({exc})") from None
        self.tables = {
            t: {r[1] for r in con.execute(f"PRAGMA table_info('{t}')")} for (t,) in rows}
        self.version = self._version()

    def _version(self) -> str | None:
        if "META_DATA_EXPORT" not in self.tables:
            return None
        row = self.con.execute("SELECT value FROM META_DATA_EXPORT WHERE name = "
                               "'EXPORT_SCHEMA_VERSION'").fetchone()
        return None if row is None else str(row[0])

    def require(self, table: str, *columns: str) -> None:
        missing = [c for c in columns if c not in self.tables[table]]
        if missing:
            raise ValueError(f"{self.path}: table {table} has no column(s) {', '.join(missing)} "
                             f"(export schema version {self.version or 'unknown'}); "
                             "this nsys export is not one overlap-analyze can read")

    def rows(self, table: str, columns: list[str], where: str = "",
             progress: Progress | None = None) -> Iterator[dict[str, Any]]:
        """Rows as dicts; a column this export lacks reads as None."""
        have = [c for c in columns if c in self.tables[table]]
        total = self.con.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
        cur = self.con.execute(f"SELECT {', '.join(have)} FROM {table} {where}")
        done = 0
        while True:
            batch = cur.fetchmany(_BATCH)
            if not batch:
                break
            for row in batch:
                d = dict.fromkeys(columns)
                d.update(zip(have, row))
                yield d
            done += len(batch)
            if progress is not None:
                progress(min(done, total), total)


def _copy_labels(db: _Db) -> dict[int, str]:
    """copyKind -> "DtoD"/"PtoP"/...: the export's own enum table when it has one."""
    labels = {k: v for k, v in names.MEMCPY_KINDS.items()}
    if "ENUM_CUDA_MEMCPY_OPER" in db.tables and "id" in db.tables["ENUM_CUDA_MEMCPY_OPER"]:
        col = "name" if "name" in db.tables["ENUM_CUDA_MEMCPY_OPER"] else "label"
        for i, text in db.con.execute(f"SELECT id, {col} FROM ENUM_CUDA_MEMCPY_OPER"):
            key = str(text).upper().replace("-", "").replace(" ", "")
            if key.endswith(("PTOP", "PEERTOPEER")):
                labels[i] = "PtoP"
            elif key.endswith(("DTOD", "DEVICETODEVICE")):
                labels[i] = "DtoD"
    return labels


def read_nsys_sqlite(path: str | Path, *, progress: Progress | None = None) -> list[sp.RankTrace]:
    """One RankTrace per process found in an ``nsys export --type sqlite`` file."""
    path = Path(path)
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return _read(_Db(con, str(path)), str(path), progress)
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{path}: cannot read the nsys export ({exc})") from None
    finally:
        con.close()


def _read(db: _Db, source: str, progress: Progress | None) -> list[sp.RankTrace]:
    kernels, nvtx = "CUPTI_ACTIVITY_KIND_KERNEL", "NVTX_EVENTS"
    if kernels not in db.tables and nvtx not in db.tables:
        raise ValueError(f"{source}: no {nvtx} or {kernels} table; profile with "
                         "`nsys profile --trace=cuda,nvtx` and export with `nsys export --type "
                         "sqlite`")
    strings: dict[int, str] = {}
    if "StringIds" in db.tables:
        strings = dict(db.con.execute("SELECT id, value FROM StringIds"))
    by_pid: dict[Any, list[sp.Span]] = {}
    device_of: dict[Any, int] = {}
    pending: list[tuple[Any, sp.Span, int | None]] = []  # (pid, span, correlationId)

    if nvtx in db.tables:
        db.require(nvtx, "start", "end")
        where = "WHERE end IS NOT NULL"
        if "eventType" in db.tables[nvtx]:
            where += f" AND eventType IN ({NVTX_PUSH_POP}, {NVTX_START_END})"
        for r in db.rows(nvtx, ["start", "end", "text", "textId", "globalTid"], where, progress):
            name = r["text"] if r["text"] is not None else strings.get(r["textId"])
            if name is None:
                continue
            span = sp.host_span(r["start"] / _NS, r["end"] / _NS, str(name),
                                f"thread {_tid(r['globalTid'])}")
            by_pid.setdefault(_pid(r["globalTid"]), []).append(span)

    if kernels in db.tables:
        db.require(kernels, "start", "end", "streamId")
        name_col = next((c for c in ("shortName", "demangledName", "mangledName")
                         if c in db.tables[kernels]), None)
        if name_col is None:
            db.require(kernels, "shortName")
        for r in db.rows(kernels, ["start", "end", "deviceId", "streamId", "globalPid",
                                   "correlationId", "shortName", "demangledName",
                                   "mangledName"], "", progress):
            ref = r[name_col]
            name = strings.get(ref, ref) if isinstance(ref, int) else ref
            span = sp.kernel_span(r["start"] / _NS, r["end"] / _NS, str(name),
                                  f"stream {r['deviceId']}:{r['streamId']}")
            pending.append((_pid(r["globalPid"]), span, r["correlationId"]))
            device_of.setdefault(_pid(r["globalPid"]), r["deviceId"])

    memcpy = "CUPTI_ACTIVITY_KIND_MEMCPY"
    if memcpy in db.tables:
        db.require(memcpy, "start", "end", "streamId", "copyKind")
        labels = _copy_labels(db)
        for r in db.rows(memcpy, ["start", "end", "deviceId", "streamId", "globalPid",
                                  "correlationId", "bytes", "copyKind", "srcDeviceId",
                                  "dstDeviceId"], "", progress):
            kind = labels.get(r["copyKind"], f"kind{r['copyKind']}")
            src, dst = r["srcDeviceId"], r["dstDeviceId"]
            peer = src is not None and dst is not None and src != dst
            span = sp.copy_span(r["start"] / _NS, r["end"] / _NS,
                                f"Memcpy {kind} ({r['bytes']} B)",
                                f"stream {r['deviceId']}:{r['streamId']}", kind, peer)
            pending.append((_pid(r["globalPid"]), span, r["correlationId"]))
            device_of.setdefault(_pid(r["globalPid"]), r["deviceId"])

    _attach_launches(db, pending, progress)
    known = [p for p in by_pid if p is not None]
    for pid, span, _ in pending:
        if pid is None and len(known) == 1:
            pid = known[0]  # an export without globalPid: one process owns everything
        by_pid.setdefault(pid, []).append(span)
    order = sorted(by_pid, key=lambda p: (device_of.get(p, 1 << 30), -1 if p is None else p))
    out = []
    for rank, pid in enumerate(order):
        spans = by_pid[pid]
        sp.finish(spans)
        out.append(sp.RankTrace(rank=rank, spans=spans, source=source, fmt="nsys-sqlite",
                                schema_version=db.version))
    return out


def _attach_launches(db: _Db, pending: list, progress: Progress | None) -> None:
    """Set each device row's launch time and thread from CUPTI_ACTIVITY_KIND_RUNTIME (matched
    by correlation id within the process), so rows are assigned to the step that launched them
    and labelled by the range open at the launch."""
    runtime = "CUPTI_ACTIVITY_KIND_RUNTIME"
    if runtime not in db.tables or not pending:
        return
    if not {"correlationId", "start", "globalTid"} <= db.tables[runtime]:
        return
    wanted: dict[tuple[Any, int], list[sp.Span]] = {}
    for pid, span, corr in pending:
        if corr is not None:
            wanted.setdefault((pid, corr), []).append(span)
    for r in db.rows(runtime, ["start", "globalTid", "correlationId"], "", progress):
        rows = wanted.get((_pid(r["globalTid"]), r["correlationId"]))
        if rows is None:
            rows = wanted.get((None, r["correlationId"]))
        for span in rows or ():
            span.launch, span.launch_track = r["start"] / _NS, f"thread {_tid(r['globalTid'])}"


def export_report(report: str | Path, *, timeout: float = 900.0) -> tuple[Path, Path]:
    """Export a ``.nsys-rep`` with ``nsys export --type sqlite`` into a fresh temporary
    directory; returns (sqlite file, directory). The caller removes the directory."""
    nsys = shutil.which("nsys")
    if nsys is None:
        raise ValueError(f"{report}: reading a .nsys-rep needs `nsys` on PATH to export it; "
                         "run `nsys export --type sqlite` yourself and pass the .sqlite file")
    tmp = Path(tempfile.mkdtemp(prefix="overlap-analyze-"))
    out = tmp / (Path(report).stem + ".sqlite")
    cmd = [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "--output", str(out),
           str(report)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"{report}: `nsys export` did not finish within {timeout:.0f} s") from None
    if res.returncode != 0 or not out.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        last = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"{report}: `nsys export --type sqlite` failed (exit "
                         f"{res.returncode}): {last[0]}")
    return out, tmp
