"""Input validation for the fused TP ops: local checks first (no collective), then an optional
cross-rank agreement check.

Local checks run on every call and raise before any communication starts: wrong types, ranks
other than 2 or 3, K of ``x`` != K of ``w``, dtypes that differ or are unsupported, devices that
differ, an M that does not divide by the group size (reduce-scatter), a bad ``chunks``.

Ranks that pass *different* shapes would hang or mis-pair messages inside the collectives, so
``check_across_ranks`` gathers a small int64 signature ``[op, backend, ndim, x dims, w dims,
dtype, chunks, flags]`` from every rank with one ``all_gather_into_tensor`` and raises on every
rank, naming the ranks that disagree. Cost: one collective of ``16 * world`` int64 words — tens
of microseconds on gloo; on NCCL the result is read on the host, which synchronises the stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.symm.workspace import group_name
from overlap.defaults import positive_int

__all__ = ["DTYPE_CODES", "BACKENDS", "OPS", "validate", "check_across_ranks", "where"]

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
BACKENDS = ("auto", "chunked", "symmetric", "triton", "unfused")
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
_SIG_LEN = 16


def where(group: dist.ProcessGroup) -> str:
    """' (rank r of group [..])' for error messages."""
    return f" (rank {dist.get_rank(group)} of group {group_name(group)})"


def validate(op: str, x: torch.Tensor, w: torch.Tensor, *, group: dist.ProcessGroup,
             backend: str, chunks: int | None) -> None:
    """Raise TypeError/ValueError naming op, argument, rank and expected value; no collective."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: group must be a torch.distributed ProcessGroup (pass it "
                        f"explicitly, e.g. dims.tp_group), got {type(group).__name__}")
    at = where(group)
    xname = "x_shard" if op == "all_gather_matmul" else "x"
    for name, t in ((xname, x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}{at}")
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}{at}")
    if x.dim() not in (2, 3):
        raise ValueError(f"{op}: {xname} must be 2-D [M, K] or 3-D sequence-first [S, B, K], got "
                         f"shape {tuple(x.shape)}{at}")
    if w.dim() != 2:
        raise ValueError(f"{op}: w must be 2-D [K, N] (pass weight.t() for an nn.Linear "
                         f"weight), got shape {tuple(w.shape)}{at}")
    if min(x.shape) == 0 or min(w.shape) == 0:
        raise ValueError(f"{op}: {xname} {tuple(x.shape)} and w {tuple(w.shape)} must be "
                         f"non-empty{at}")
    for name, t in ((xname, x), ("w", w)):
        if t.dtype not in DTYPE_CODES:
            raise TypeError(f"{op}: {name} dtype must be one of float32, bfloat16, float16, "
                            f"float64, got {t.dtype}{at}")
    if x.dtype != w.dtype:
        raise TypeError(f"{op}: {xname} and w must have the same dtype, got {xname} {x.dtype} "
                        f"and w {w.dtype}{at}")
    if x.device != w.device:
        raise ValueError(f"{op}: {xname} and w must be on one device, got {x.device} and "
                         f"{w.device}{at}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"{op}: K mismatch: {xname}.shape[-1] = {x.shape[-1]} but w.shape[0] = "
                         f"{w.shape[0]}; expected w of shape [{x.shape[-1]}, N]{at}")
    world = dist.get_world_size(group)
    if op == "matmul_reduce_scatter" and x.shape[0] % world:
        raise ValueError(f"{op}: x.shape[0] = {x.shape[0]} (the scattered dim M) must be "
                         f"divisible by the group size {world}{at}")
    if chunks is not None:
        positive_int(chunks, f"{op}: chunks", extra=" or None", where=at)
        if op != "matmul_all_reduce" and chunks != 1 and chunks % world:
            raise ValueError(f"{op}: chunks = {chunks} must be 1 (the whole collective) or a "
                             f"multiple of the group size {world} (chunks/world pieces per "
                             f"rank's shard){at}")
    if backend == "triton" and x.dtype == torch.float64:
        raise TypeError(f"{op}: backend='triton' supports float32, bfloat16 and float16, got "
                        f"{x.dtype}{at}")


def signature(op: str, backend: str, x: torch.Tensor, w: torch.Tensor, chunks: int | None,
              flags: int = 0) -> list[int]:
    dims = list(x.shape) + [-1] * (3 - x.dim())
    sig = [OPS.index(op), BACKENDS.index(backend), x.dim(), *dims, *w.shape,
           DTYPE_CODES[x.dtype], chunks or 0, flags]
    return sig + [0] * (_SIG_LEN - len(sig))


def _describe(sig: list[int], field: str) -> str:
    if field == "x shape":
        return str(tuple(d for d in sig[3:6] if d >= 0))
    if field == "w shape":
        return str(tuple(sig[6:8]))
    if field == "dtype":
        return str({v: k for k, v in DTYPE_CODES.items()}[sig[8]]).replace("torch.", "")
    if field == "backend":
        return BACKENDS[sig[1]]
    if field == "op":
        return OPS[sig[0]]
    if field == "chunks":
        return "None" if sig[9] == 0 else str(sig[9])
    return str(sig[10])


_FIELDS = (("op", slice(0, 1)), ("backend", slice(1, 2)), ("x shape", slice(2, 6)),
           ("w shape", slice(6, 8)), ("dtype", slice(8, 9)), ("chunks", slice(9, 10)),
           ("return_gathered", slice(10, 11)))


def check_across_ranks(op: str, sig: list[int], *, group: dist.ProcessGroup,
                       device: torch.device) -> None:
    """One all_gather of every rank's signature; ValueError on every rank if any differ."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor(sig, dtype=torch.int64, device=device)
    every = torch.empty(world * _SIG_LEN, dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(every, mine, group=group)
    rows = every.view(world, _SIG_LEN).tolist()
    for field, sl in _FIELDS:
        vals = [tuple(r[sl]) for r in rows]
        if len(set(vals)) > 1:
            shown = ", ".join(f"rank {r}={_describe(row, field)}" for r, row in enumerate(rows))
            odd = [r for r, v in enumerate(vals) if v != vals[0]]
            raise ValueError(f"{op}: ranks disagree on {field}: {shown} (ranks {odd} differ from "
                             f"rank 0){where(group)}; every rank of the group must pass the same "
                             f"{field}")
