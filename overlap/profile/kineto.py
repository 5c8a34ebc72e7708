"""Read a torch.profiler (Kineto) Chrome-trace JSON into a ``RankTrace``.

What the file holds (``export_chrome_trace``): complete events (``"ph": "X"``, microseconds)
with a category: ``user_annotation`` for ``record_function`` / ``nvtx.range`` ranges and
``cpu_op`` for ``aten::`` ops, both on their OS thread; with CUDA activities also ``kernel``,
``gpu_memcpy`` and ``gpu_memset`` rows (pid = device, tid = stream, ``args.correlation``) and
``cuda_runtime`` / ``cuda_driver`` launch calls that carry the same correlation id.
``gpu_user_annotation`` rows are the host ranges projected onto a stream; they would count the
same time twice, so they are skipped.

The rank comes from ``distributedInfo.rank`` (written when torch.distributed is initialised),
else from a ``rank<r>`` in the file name, else the caller's default.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any, Callable

from overlap.profile import spans as sp

__all__ = ["read_kineto", "spans_from_events", "load_json", "rank_from_name"]

_SKIP_CATS = {"gpu_user_annotation", "Trace", "cuda_runtime", "cuda_driver", "cuda_sync"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)")
_COPY = re.compile(r"Memcpy\s+(\w+)")


def load_json(path: str | Path, progress: Callable[[int, int], None] | None = None) -> Any:
    """Parse a (possibly gzipped) JSON file, reporting bytes read to ``progress``."""
    path = Path(path)
    total = path.stat().st_size
    opener = gzip.open if path.suffix == ".gz" else open
    chunks, done = [], 0
    with opener(path, "rb") as f:
        while True:
            block = f.read(1 << 22)
            if not block:
                break
            chunks.append(block)
            done += len(block)
            if progress is not None:
                progress(min(done, total), total)
    try:
        return json.loads(b"".join(chunks))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a JSON trace ({exc.msg} at line {exc.lineno})") from None


def rank_from_name(path: str | Path, default: int) -> int:
    """The r of a "rank<r>" in a file name (trace_rank3.json, report_rank3.sqlite), else
    ``default``."""
    m = _RANK_IN_NAME.search(Path(path).name)
    return int(m.group(1)) if m else default


def _is_kernel(e: dict) -> bool:
    return e.get("cat") == "kernel" or str(e.get("tid", "")).startswith("stream")


def spans_from_events(events: list[dict]) -> list[sp.Span]:
    """Classified spans from Chrome trace events (complete events only)."""
    launches: dict[Any, tuple[float, str]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = (float(e["ts"]), f"thread {e.get('tid')}")
    out: list[sp.Span] = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e or "dur" not in e:
            continue
        cat = e.get("cat")
        name, ts = str(e.get("name", "")), float(e["ts"])
        end = ts + float(e["dur"])
        args = e.get("args") or {}
        if _is_kernel(e) or cat in ("gpu_memcpy", "gpu_memset"):
            track = f"stream {args.get('device', e.get('pid'))}:{args.get('stream', e.get('tid'))}"
            if cat == "gpu_memcpy":
                m = _COPY.match(name)
                kind = m.group(1) if m else "Unknown"
                nbytes = args.get("bytes")
                label = f"Memcpy {kind}" + ("" if nbytes is None else f" ({nbytes} B)")
                span = sp.copy_span(ts, end, label, track, kind, False)
            elif cat == "gpu_memset":
                span = sp.Span(ts, end, name, None, track, device=True)
            else:
                span = sp.kernel_span(ts, end, name, track)
            launch = launches.get(args.get("correlation"))
            if launch is not None:
                span.launch, span.launch_track = launch
            out.append(span)
        elif cat not in _SKIP_CATS:
            out.append(sp.host_span(ts, end, name, f"thread {e.get('tid')}"))
    return sp.finish(out)


def read_kineto(path: str | Path, *, default_rank: int = 0,
                progress: Callable[[int, int], None] | None = None) -> sp.RankTrace:
    """One rank's trace from a torch.profiler Chrome-trace JSON (``.json`` or ``.json.gz``)."""
    data = load_json(path, progress)
    if isinstance(data, dict):
        if "traceEvents" not in data:
            raise ValueError(f"{path}: a JSON object without 'traceEvents' is not a Chrome trace")
        events = data["traceEvents"]
    elif isinstance(data, list):
        events = data
    else:
        raise ValueError(f"{path}: expected a Chrome trace (an object with 'traceEvents' or a "
                         f"list of events), got {type(data).__name__}")
    info = data.get("distributedInfo") if isinstance(data, dict) else None
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        rank = info["rank"]
    else:
        rank = rank_from_name(path, default_rank)
    return sp.RankTrace(rank=rank, spans=spans_from_events(events), source=str(path),
                        fmt="kineto")
