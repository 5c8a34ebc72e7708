"""Per-call agreement of the quantized collectives (overlap.dist.stamp applied to a group).

Every call on a group of more than one rank carries a stamp of ``WORDS`` int64 words: the op,
the group's call number and what every rank must pass alike (numel, dim, rows, dtype,
comm_dtype, op, block_size, the caller's ``tag``). It rides in the data the call exchanges
anyway (``STAMP_BYTES`` at the end of each byte row, or a tail of small integers in a SUM
reduction) and is compared where it is received, before the result is used. A mismatch raises
``Disagreement`` (op, call, both ranks' values) on every rank. Sizes the transport refuses are
named through the job's store (``exchange_on_failure``), on that error path only.
The narrative: docs/design/quantized.md.
"""

from __future__ import annotations

import time

import torch

from overlap.comm.quant.checks import COMM_DTYPES, OPS
from overlap.dist.stamp import DTYPE_CODES, Agreement, Disagreement, Schema, dtype_name

__all__ = ["SCHEMA", "WORDS", "STAMP_BYTES", "values", "agreement", "check_table",
           "exchange_on_failure"]

SCHEMA = Schema("quant", ("quant.all_reduce", "quant.reduce_scatter", "quant.all_gather"),
                (("numel", 1, "int"), ("dim", 1, "int"), ("rows", 1, "int"),
                 ("dtype", 1, "dtype"), ("comm_dtype", 1, COMM_DTYPES), ("op", 1, OPS),
                 ("block_size", 1, "int"), ("tag", 1, "int")))
WORDS = 3 + 8  # MAGIC, call, op code, the fields: the rest of a stamp's 16 words is zero
STAMP_BYTES = WORDS * 8  # what a byte row carries (88)

_EXCHANGE_S = 1.0  # how long a failing rank looks for its peers' stamps in the store


def values(t: torch.Tensor, comm_dtype: str, op: str, block_size: int, tag: int = 0) -> dict:
    return {"numel": t.numel(), "dim": t.dim(), "rows": t.shape[0] if t.dim() else 1,
            "dtype": DTYPE_CODES.get(t.dtype, 0), "comm_dtype": COMM_DTYPES.index(comm_dtype),
            "op": OPS.index(op), "block_size": int(block_size), "tag": int(tag)}


_NAMED = (("the op", 2, None), ("the call number", 1, None), ("t.numel()", 3, None),
          ("t.dim()", 4, None), ("t.shape[0]", 5, None), ("t.dtype", 6, "dtype"),
          ("comm_dtype", 7, COMM_DTYPES), ("op", 8, OPS), ("block_size", 9, None),
          ("tag", 10, None))


def check_table(op: str, rank: int, table: list[list[int]]) -> None:
    """The named first-call check: ``table`` holds every rank's stamp words in rank order;
    raise a ValueError naming the first field that differs with every rank's value."""
    for name, col, kind in _NAMED:
        column = [row[col] for row in table]
        if len(set(column)) == 1:
            continue
        shown = [SCHEMA.ops[v] if col == 2 and 0 <= v < len(SCHEMA.ops) else
                 dtype_name(v) if kind == "dtype" else
                 kind[v] if isinstance(kind, tuple) and 0 <= v < len(kind) else v
                 for v in column]
        raise ValueError(f"{op}: rank {rank}: {name} differs across the ranks of the group "
                         f"(rank order): {shown}; every rank must pass the same")


def agreement(state, device: torch.device) -> Agreement:
    """The group's Agreement (call counter and stamp buffers) on ``device``; a new device keeps
    the count (ranks count every call of the group alike)."""
    agree = state.agree
    if agree is None or agree.device != torch.device(device):
        calls = agree.calls if agree is not None else 0
        agree = state.agree = Agreement(
            SCHEMA, rank=state.rank, world=state.world, device=torch.device(device),
            where=f" (group {state.name!r}, global ranks {state.global_ranks})")
        agree.calls = calls
    return agree


def exchange_on_failure(state, op: str, mine: list[int], transport: BaseException) -> None:
    """Sizes differed, so the transport refused the call on every rank and no stamp crossed:
    publish ours in the store, read the peers' (up to ``_EXCHANGE_S``) and raise Disagreement
    naming both, with the transport's message; or, if none arrives, a Disagreement naming this
    rank's call only. A group fails once, so one key per rank suffices."""
    where = f" (group {state.name!r}, global ranks {state.global_ranks})"
    key = f"{state._key}/stamp/"
    state._store_call(lambda s: s.set(f"{key}{state.rank}", ",".join(map(str, mine))))
    theirs: dict[int, list[int]] = {}
    deadline = time.monotonic() + _EXCHANGE_S
    waiting = [q for q in range(state.world) if q != state.rank]
    while waiting and time.monotonic() < deadline:
        for q in list(waiting):
            k = f"{key}{q}"
            if state._store_call(lambda s: s.check([k])):
                raw = state._store_call(lambda s: s.get(k))
                if raw:
                    theirs[q] = [int(w) for w in raw.decode().split(",")]
                    waiting.remove(q)
        if waiting:
            time.sleep(0.01)
    tail = f" [the transport refused the call: {transport}]"
    try:
        SCHEMA.check(op, mine, theirs, rank=state.rank, where=where)
    except Disagreement as exc:
        exc.args = (str(exc) + tail,)
        raise
    raise Disagreement(
        f"{op}: call {mine[1]}: the ranks passed different sizes{where}: this rank "
        f"(rank {state.rank}): {SCHEMA.describe(mine)}; "
        + (f"ranks {sorted(theirs)} made the same call, " if theirs else "")
        + (f"ranks {waiting} did not publish theirs" if waiting else "") + tail,
        op=op, call=mine[1], ranks=(state.rank, waiting[0] if waiting else state.rank))
