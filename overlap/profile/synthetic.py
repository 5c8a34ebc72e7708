"""One synthetic timeline, written both as a torch.profiler Chrome trace and as an nsys SQLite
export in several schema variants, so the two readers can be checked against each other and
against metrics worked out by hand (tests/test_profile_nsys.py, tests/test_profile_analyze.py).

Rows are host ranges (``Range``), kernels (``Kernel``) and copies (``Copy``) with nanosecond
times. The nsys variants differ in the columns and optional tables an export has:

- ``minimal``: only the columns the reader needs (no globalPid, correlationId, eventType, text
  ids) and none of the optional tables (no RUNTIME, MEMCPY, META_DATA_EXPORT, enums);
- ``textid``: NVTX names stored as registered strings (``textId`` -> StringIds, ``text``
  NULL), kernel names only as ``demangledName``, no ``greenContextId``, no META_DATA_EXPORT;
- ``3.28.1``: every column of these tables in the schema documented for nsys 2026.4 (export
  schema 3.28.1), with META_DATA_EXPORT, ENUM_CUDA_MEMCPY_OPER and non-range NVTX rows (a
  mark and a domain creation) that the reader must skip.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

from overlap.profile import names

__all__ = ["Range", "Kernel", "Copy", "write_chrome", "write_nsys", "VARIANTS", "worked_example"]

_ID = 0x1000000


@dataclasses.dataclass(frozen=True)
class Range:
    name: str
    start: int
    end: int
    pid: int = 100
    tid: int = 100
    event_type: int = 59  # 59 push/pop, 60 start/end; 34 (a mark) must be ignored


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    start: int
    end: int
    stream: int = 7
    device: int = 0
    pid: int = 100
    launch: tuple[int, int] | None = None  # (host ns, tid) of the launch call


@dataclasses.dataclass(frozen=True)
class Copy:
    copy_kind: int  # CUPTI CUpti_ActivityMemcpyKind: 1 HtoD, 8 DtoD, 10 PtoP
    start: int
    end: int
    stream: int = 7
    device: int = 0
    pid: int = 100
    src: int | None = None
    dst: int | None = None
    nbytes: int = 4096
    launch: tuple[int, int] | None = None


def _us(ns: int) -> float:
    return ns / 1000.0


def write_chrome(rows: list, path: str | Path, *, rank: int | None = None) -> Path:
    """The rows of one process as a Chrome trace, the way torch.profiler writes CUDA traces."""
    events: list[dict] = []
    for corr, r in enumerate(rows, start=1):
        if isinstance(r, Range):
            if r.event_type in (59, 60):
                events.append({"ph": "X", "cat": "user_annotation", "name": r.name, "pid": r.pid,
                               "tid": r.tid, "ts": _us(r.start), "dur": _us(r.end) - _us(r.start)})
            continue
        if isinstance(r, Kernel):
            ev = {"cat": "kernel", "name": r.name}
        else:
            kind = names.MEMCPY_KINDS[r.copy_kind]
            ev = {"cat": "gpu_memcpy", "name": f"Memcpy {kind} (Device -> Device)"}
        ev.update(ph="X", pid=r.device, tid=r.stream, ts=_us(r.start),
                  dur=_us(r.end) - _us(r.start),
                  args={"device": r.device, "stream": r.stream, "correlation": corr,
                        **({} if isinstance(r, Kernel) else {"bytes": r.nbytes})})
        events.append(ev)
        if r.launch is not None:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                           "pid": r.pid, "tid": r.launch[1], "ts": _us(r.launch[0]),
                           "dur": 1.0, "args": {"correlation": corr}})
    data: dict = {"schemaVersion": 1, "traceEvents": events}
    if rank is not None:
        data["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": rank + 1}
    Path(path).write_text(json.dumps(data))
    return Path(path)


_KERNEL_3_28 = ("start end deviceId contextId greenContextId streamId correlationId globalPid "
                "demangledName shortName mangledName launchType cacheConfig registersPerThread "
                "gridX gridY gridZ blockX blockY blockZ staticSharedMemory dynamicSharedMemory "
                "localMemoryPerThread localMemoryTotal gridId sharedMemoryExecuted graphNodeId "
                "sharedMemoryLimitConfig qmdBulkReleaseDone qmdPreexitDone qmdLastCtaDone graphId "
                "clusterX clusterY clusterZ clusterSchedulingPolicy maxPotentialClusterSize "
                "maxActiveClusters sharedMemoryRequestedPercentage tensorSizeMinusOneElements")
_MEMCPY_3_28 = ("start end deviceId contextId greenContextId streamId correlationId globalPid "
                "bytes copyKind deprecatedSrcId srcKind dstKind srcDeviceId srcContextId "
                "dstDeviceId dstContextId migrationCause graphNodeId virtualAddress copyCount")
_NVTX_3_28 = ("start end eventType rangeId category color text globalTid endGlobalTid textId "
              "domainId uint64Value int64Value doubleValue uint32Value int32Value floatValue")
_RUNTIME = "start end eventClass globalTid correlationId nameId returnValue callchainId"

VARIANTS = {
    "minimal": {"kernel": "start end deviceId streamId shortName",
                "nvtx": "start end text globalTid", "memcpy": None, "runtime": None,
                "version": None, "names": "text"},
    "textid": {"kernel": " ".join(c for c in _KERNEL_3_28.split() if c not in (
                   "greenContextId", "shortName", "mangledName") and not c.startswith(("qmd",
                   "cluster", "maxP", "maxA", "sharedMemoryReq", "tensorSize", "graphId"))),
               "nvtx": _NVTX_3_28, "memcpy": " ".join(c for c in _MEMCPY_3_28.split() if c not in (
                   "greenContextId", "virtualAddress", "copyCount")),
               "runtime": _RUNTIME, "version": None, "names": "textId"},
    "3.28.1": {"kernel": _KERNEL_3_28, "nvtx": _NVTX_3_28, "memcpy": _MEMCPY_3_28,
               "runtime": _RUNTIME, "version": "3.28.1", "names": "text"},
}


def write_nsys(rows: list, path: str | Path, *, variant: str = "3.28.1") -> Path:
    """The rows (any number of processes) as an nsys SQLite export of the given variant.
    Rows the variant cannot hold (copies without a MEMCPY table) are left out."""
    spec = VARIANTS[variant]
    path = Path(path)
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    strings: dict[str, int] = {}

    def sid(text: str) -> int:
        return strings.setdefault(text, len(strings) + 1)

    def table(name: str, cols: str, values: list[dict]) -> None:
        c = cols.split()
        # Untyped columns: TEXT names and INTEGER ids keep their Python types, as nsys's do.
        con.execute(f"CREATE TABLE {name} ({', '.join(c)})")
        con.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(c))})",
                        [[v.get(x) for x in c] for v in values])

    nvtx, kernels, copies, runtime = [], [], [], []
    for corr, r in enumerate(rows, start=1):
        if isinstance(r, Range):
            if spec["nvtx"] == VARIANTS["minimal"]["nvtx"] and r.event_type not in (59, 60):
                continue  # no eventType column to tell a mark from a range
            row = {"start": r.start, "end": r.end, "eventType": r.event_type,
                   "globalTid": r.pid * _ID + r.tid}
            row["textId" if spec["names"] == "textId" else "text"] = (
                sid(r.name) if spec["names"] == "textId" else r.name)
            nvtx.append(row)
            continue
        row = {"start": r.start, "end": r.end, "deviceId": r.device, "streamId": r.stream,
               "correlationId": corr, "globalPid": r.pid * _ID, "contextId": 1}
        if r.launch is not None:
            runtime.append({"start": r.launch[0], "end": r.launch[0] + 1000,
                            "globalTid": r.pid * _ID + r.launch[1], "correlationId": corr,
                            "nameId": sid("cudaLaunchKernel_v7000"), "returnValue": 0})
        if isinstance(r, Kernel):
            row.update(shortName=sid(r.name), demangledName=sid(r.name), mangledName=sid(r.name))
            kernels.append(row)
        else:
            row.update(bytes=r.nbytes, copyKind=r.copy_kind, srcDeviceId=r.src,
                       dstDeviceId=r.dst, copyCount=1)
            copies.append(row)
    if variant == "3.28.1":  # rows a reader must skip: a domain creation and a mark
        nvtx.append({"start": 0, "end": None, "eventType": 75, "text": "NCCL",
                     "globalTid": 100 * _ID + 100})
        nvtx.append({"start": 5, "end": 10_000_000, "eventType": 34, "text": "comm:mark",
                     "globalTid": 100 * _ID + 100})
        con.execute("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT)")
        con.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', ?)",
                    (spec["version"],))
        con.execute("CREATE TABLE ENUM_CUDA_MEMCPY_OPER (id INTEGER, name TEXT, label TEXT)")
        con.executemany("INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES (?, ?, ?)",
                        [(1, "CUDA_MEMCPY_KIND_HTOD", "Host-to-Device"),
                         (8, "CUDA_MEMCPY_KIND_DTOD", "Device-to-Device"),
                         (10, "CUDA_MEMCPY_KIND_PTOP", "Peer-to-Peer")])
    table("NVTX_EVENTS", spec["nvtx"], nvtx)
    table("CUPTI_ACTIVITY_KIND_KERNEL", spec["kernel"], kernels)
    if spec["memcpy"]:
        table("CUPTI_ACTIVITY_KIND_MEMCPY", spec["memcpy"], copies)
    if spec["runtime"]:
        table("CUPTI_ACTIVITY_KIND_RUNTIME", spec["runtime"], runtime)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(i, s) for s, i in strings.items()])
    con.commit()
    con.close()
    return path


def worked_example() -> list:
    """Two steps of one rank on one GPU, in ns, with metrics that are easy to work out by hand
    (tests/test_profile_nsys.py derives them):

    step 0 [0, 1 ms): a GEMM on stream 7 (200-600 us) under an NCCL all-gather on stream 13
        (150-700 us), launched from ``all_gather_matmul.chunked.gemm[0]`` / ``.comm[1]``;
    step 1 [1, 2 ms): a fused ``_all_gather_matmul_kernel`` (1100-1500 us), then a signal
        wait on stream 20 (1500-1600), a peer-to-peer copy (1600-1650) and a device-to-device
        copy on the compute stream (1650-1700); a device-to-device copy on the comm stream
        (1400-1450) runs under the fused kernel, and a host-to-device copy (1700-1800) is not
        counted.
    """
    k = 1000
    launch = lambda us: (us * k, 100)  # noqa: E731 - (ns, tid) of the launching call
    return [
        Range("step:0", 0, 1000 * k), Range("step:1", 1000 * k, 2000 * k),
        Range("all_gather_matmul.chunked.comm[1]", 100 * k, 110 * k),
        Range("all_gather_matmul.chunked.gemm[0]", 110 * k, 150 * k),
        Kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 200 * k, 600 * k, stream=7,
               launch=launch(120)),
        Kernel("ncclDevKernel_AllGather_RING_LL", 150 * k, 700 * k, stream=13,
               launch=launch(105)),
        Range("all_gather_matmul.triton.fused[0]", 1040 * k, 1080 * k),
        Kernel("_all_gather_matmul_kernel", 1100 * k, 1500 * k, stream=7, launch=launch(1050)),
        Kernel("overlap_signal_wait", 1500 * k, 1600 * k, stream=20, launch=launch(1060)),
        Copy(10, 1600 * k, 1650 * k, stream=20, src=0, dst=1, launch=launch(1070)),
        Copy(8, 1650 * k, 1700 * k, stream=7, launch=launch(1075)),
        Copy(1, 1700 * k, 1800 * k, stream=7, launch=launch(1076)),
        Copy(8, 1400 * k, 1450 * k, stream=20, launch=launch(1077)),
    ]
