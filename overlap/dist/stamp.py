"""Per-call agreement: a compact signature of every call travels with the data the call
exchanges anyway, and the receiver compares it with its own.

A *stamp* is ``STAMP_WORDS`` int64 words ``[MAGIC, call, op code, field words...]``: the op,
a per-communicator call counter (so a rank that skipped or repeated a call is caught too) and
the parameters every rank must pass alike (shapes, dtype, options), laid out by a
:class:`Schema`. Every path carries it in its own exchange: a header slot written before the
signal (userbuffers), the front of the first message (P2P rings), the same message
(collectives). A mismatch raises :class:`Disagreement` on every rank that receives a foreign
stamp, naming the op, the call number and both ranks' values of the first field that differs.

The cross-rank check that gathers every rank's signature (one collective) still runs where an
op family had it, on a call every rank reaches in the same state; stamps catch the rest at no
extra collective, message or host sync.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from overlap.errors import OverlapError

__all__ = ["STAMP_WORDS", "MAGIC", "Agreement", "Disagreement", "Schema", "device_mismatch",
           "DTYPE_CODES", "dtype_name", "shape_words", "float_word", "sum_tail_bits",
           "sum_tail_chunks", "pack_sum_tail", "unpack_sum_tail", "agree_on"]

STAMP_WORDS = 16
MAGIC = 0x0F1A_57A3_0000_0001  # marks a written stamp (a zeroed slot is never one)
_HEAD = 3  # MAGIC, call, op code

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4,
               torch.int8: 5, torch.uint8: 6, torch.int32: 7, torch.int64: 8, torch.bool: 9}
_DTYPE_NAMES = {v: str(k).replace("torch.", "") for k, v in DTYPE_CODES.items()}


def dtype_name(code: int) -> str:
    return _DTYPE_NAMES.get(code, f"dtype#{code}")


def shape_words(shape: Sequence[int], n: int) -> list[int]:
    """``shape`` as exactly ``n`` words (-1 pads; a longer shape keeps its numel in the last)."""
    dims = [int(d) for d in shape]
    if len(dims) > n:
        tail = 1
        for d in dims[n - 1:]:
            tail *= d
        dims = dims[:n - 1] + [tail]
    return dims + [-1] * (n - len(dims))


def float_word(x: float) -> int:
    """A float64's bits as one stamp word (exact: two values agree only if they are equal)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _fmt_float(words: Sequence[int]) -> str:
    return repr(struct.unpack("<d", struct.pack("<q", int(words[0])))[0])


def _choice(names: tuple[str, ...]) -> Callable[[Sequence[int]], str]:
    return lambda w: names[w[0]] if 0 <= w[0] < len(names) else f"#{w[0]}"


def _fmt_shape(words: Sequence[int]) -> str:
    return str(tuple(int(w) for w in words if w >= 0))


class Disagreement(OverlapError, ValueError):
    """Ranks passed different calls to one op (found in the data the op exchanged)."""

    def __init__(self, message: str, *, op: str, call: int, ranks: tuple[int, int]):
        super().__init__(message)
        self.op, self.call, self.ranks = op, call, ranks


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    words: int
    show: Callable[[Sequence[int]], str]


class Schema:
    """The stamp layout of one op family: ops by code, then named fields of fixed width.

    ``fields``: (name, words, kind) with kind "int", "shape", "dtype", "bool", "float" (a
    float64's bits: :func:`float_word`) or a tuple of names (the word indexes it): how a
    message shows it. Every rank of a communicator uses the same schema, so a peer's words
    decode alike.
    """

    def __init__(self, family: str, ops: Sequence[str],
                 fields: Sequence[tuple[str, int, str]]):
        shows = {"int": lambda w: str(int(w[0])), "shape": _fmt_shape, "float": _fmt_float,
                 "dtype": lambda w: dtype_name(int(w[0])),
                 "bool": lambda w: str(bool(w[0]))}
        self.family = family
        self.ops = tuple(ops)
        self.fields = tuple(Field(n, k, shows[kind] if isinstance(kind, str) else
                                  _choice(tuple(kind))) for n, k, kind in fields)
        if _HEAD + sum(f.words for f in self.fields) > STAMP_WORDS:
            raise ValueError(f"Schema {family}: fields need more than {STAMP_WORDS - _HEAD} "
                             "words")

    def words(self, op: str, call: int, values: Mapping[str, int | Sequence[int]]) -> list[int]:
        """The stamp of call number ``call`` of ``op`` with these field values."""
        out = [MAGIC, int(call), self.ops.index(op)]
        for f in self.fields:
            v = values[f.name]
            seq = [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]
            if len(seq) != f.words:
                raise ValueError(f"Schema {self.family}: field {f.name} takes {f.words} words, "
                                 f"got {seq}")
            out += seq
        return out + [0] * (STAMP_WORDS - len(out))

    def tensor(self, words: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(list(words), dtype=torch.int64, device=device)

    def describe(self, words: Sequence[int]) -> str:
        """``op call c: name=value, ...`` for messages."""
        words = [int(w) for w in words]
        if words[0] != MAGIC:
            return "no stamp (the peer did not send one: a different op or an older call)"
        parts, at = [], _HEAD
        for f in self.fields:
            parts.append(f"{f.name}={f.show(words[at:at + f.words])}")
            at += f.words
        return f"{self._op(words[2])} call {words[1]}: " + ", ".join(parts)

    def _op(self, code: int) -> str:
        return self.ops[code] if 0 <= code < len(self.ops) else f"op#{code}"

    def _first_difference(self, a: list[int], b: list[int]) -> tuple[str, str, str]:
        if a[0] != MAGIC or b[0] != MAGIC:
            return "stamp", self.describe(a), self.describe(b)
        if a[2] != b[2]:
            return "op", self._op(a[2]), self._op(b[2])
        if a[1] != b[1]:
            return "call number", str(a[1]), str(b[1])
        at = _HEAD
        for f in self.fields:
            wa, wb = a[at:at + f.words], b[at:at + f.words]
            if wa != wb:
                return f.name, f.show(wa), f.show(wb)
            at += f.words
        return "padding", str(a[at:]), str(b[at:])

    def check(self, op: str, mine: Sequence[int], theirs: Mapping[int, Sequence[int]], *,
              rank: int, where: str) -> None:
        """Raise Disagreement if any peer's stamp differs from ``mine`` (host values)."""
        mine = [int(w) for w in mine]
        for peer in sorted(theirs):
            other = [int(w) for w in theirs[peer]]
            if other == mine:
                continue
            field, a, b = self._first_difference(mine, other)
            raise Disagreement(
                f"{op}: call {mine[1]}: ranks disagree on {field}: rank {rank}={a}, "
                f"rank {peer}={b}{where}; every rank of the group must make the same call "
                f"(rank {rank}: {self.describe(mine)}; rank {peer}: {self.describe(other)})",
                op=op, call=mine[1], ranks=(rank, peer))

    def check_tensors(self, op: str, mine: torch.Tensor, theirs: Mapping[int, torch.Tensor], *,
                      rank: int, where: str) -> None:
        """Compare received stamp tensors with ours. On the CPU the words are host memory and
        are compared here; on a device this would be a host sync, so callers there compare with
        :func:`device_mismatch` instead and poison / record."""
        self.check(op, mine.tolist(), {p: t.tolist() for p, t in theirs.items()}, rank=rank,
                   where=where)


def device_mismatch(mine: torch.Tensor, theirs: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor on the stamps' device: True if any received stamp differs from ours.
    No host sync: the caller poisons outputs with it and keeps it for the next host-visible
    point."""
    flag = torch.zeros((), dtype=torch.bool, device=mine.device)
    for t in theirs:
        flag = flag | (t != mine).any()
    return flag


class Agreement:
    """One communicator's stamps: its call counter, the buffers stamps travel in, and the
    comparison where they are received.

        agree = Agreement(schema, rank=r, world=n, device=dev, where=" (rank r of group g)")
        words = agree.next(op, {"x shape": ..., ...})   # every call, on every rank
        ... send agree.send, receive into agree.recv[q] (or read a peer's header slot) ...
        agree.verify(op, peers)                          # once the stamps have landed

    CPU: the received words are host memory; ``verify`` compares them at once (a read of host
    memory through numpy views made once, so no tensor method: on a GPU this path does not
    exist) and raises Disagreement. GPU: the comparison runs on the device into a sticky record
    (the first mismatch wins) that an async copy mirrors into pinned host memory; ``verify``
    and every later call read that host mirror without a sync and raise once it shows the
    mismatch, and ``poison`` turns the call's outputs to NaN on the device meanwhile, so no
    output computed from mismatched data is ever returned as valid.
    """

    def __init__(self, schema: Schema, *, rank: int, world: int, device: torch.device,
                 where: str):
        from overlap.profile.syncs import not_a_device_sync

        self.schema, self.rank, self.world, self.where = schema, rank, world, where
        self.device = torch.device(device)
        self.calls = 0
        self._layouts: dict[tuple, tuple[list[int], np.ndarray]] = {}
        self.transport: dict[str, object] = {}  # what a transport builds once for the stamps
        self.mine: list[int] = [0] * STAMP_WORDS
        self.send = torch.zeros(STAMP_WORDS, dtype=torch.int64, device=self.device)
        self.recv = torch.zeros(world, STAMP_WORDS, dtype=torch.int64, device=self.device)
        self._gpu = self.device.type == "cuda"
        with not_a_device_sync("views of host memory made once: on a GPU these are pinned "
                               "host buffers, read without a sync"):
            if self._gpu:
                self._init_device_record()
            else:
                self._send_np = self.send.numpy()
                self._recv_np = self.recv.numpy()
                # Host addresses for byte moves by a transport (chunked's first message).
                self.send_address = self.send.data_ptr()
                self._recv_address = self.recv.data_ptr()

    @property
    def device_path(self) -> bool:
        """True when stamps are compared on the device (GPU, or the tests that emulate it)."""
        return self._gpu

    def recv_address(self, q: int) -> int:
        """Host address of ``recv[q]`` (CPU path only)."""
        return self._recv_address + q * STAMP_WORDS * 8

    def _init_device_record(self) -> None:
        """The device path's state (also built on CPU tensors by the tests that check it):
        a sticky record [flag, peer, mine x16, theirs x16] on the device and its host mirror
        (pinned on a GPU), read through a numpy view made once."""
        self._peer_ids: dict[tuple[int, ...], torch.Tensor] = {}
        self._record = torch.zeros(2 + 2 * STAMP_WORDS, dtype=torch.int64, device=self.device)
        host = torch.zeros(2 + 2 * STAMP_WORDS, dtype=torch.int64)
        self._record_host = host.pin_memory() if self.device.type == "cuda" else host
        self._record_np = self._record_host.numpy()
        self._flag = torch.zeros((), dtype=torch.bool, device=self.device)

    def next(self, op: str, values: Mapping[str, int | Sequence[int]] | None = None, *,
             key: tuple | None = None,
             make: Callable[[], Mapping[str, int | Sequence[int]]] | None = None) -> list[int]:
        """Count the call and write its stamp into ``send``. Either ``values``, or a hashable
        ``key`` of them with ``make()`` building them on a key's first call (the layout is
        then reused: the per-call host work is a copy and the call number)."""
        self.calls += 1
        if values is None:
            layout = self._layouts.get(key)
            if layout is None:
                words = self.schema.words(op, 0, make())
                layout = self._layouts[key] = (words, np.array(words, dtype=np.int64))
            self.mine = list(layout[0])
            self.mine[1] = self.calls
            if not self._gpu:  # a copy of 16 words and the call number, no list conversion
                self._send_np[:] = layout[1]
                self._send_np[1] = self.calls
                return self.mine
        else:
            self.mine = self.schema.words(op, self.calls, values)
        if self._gpu:
            # A fresh pinned block from torch's caching host allocator: it is not handed out
            # again before this async copy has run, however far the host runs ahead.
            staged = torch.tensor(self.mine, dtype=torch.int64).pin_memory()
            self.send.copy_(staged, non_blocking=True)
        else:
            self._send_np[:] = self.mine
        return self.mine

    def clear_received(self) -> None:
        """Zero the receive rows (no stale stamp of an earlier call can pass for this one)."""
        if self._gpu:
            self.recv.zero_()
        else:
            self._recv_np[:] = 0

    def verify(self, op: str, peers: Sequence[int], rows=None, *,
               arrived_only: bool = False,
               mine: tuple[list[int], torch.Tensor | None] | None = None) -> None:
        """Compare the stamps received from ``peers`` (``recv[q]``, or ``rows[q]``: arrays or
        tensors of STAMP_WORDS words, e.g. views of a peer's header slot) with ours.
        ``arrived_only`` (after a failed transfer, CPU): ignore rows no stamp has reached,
        so a peer that never sent is reported by the transport error, not as a disagreement.
        ``mine``: (words, device copy of ``send`` or None on CPU) of an earlier call still in
        flight when several overlap (GradReducer buckets); default: this call's ``send``."""
        if self._gpu:
            self._verify_on_device(peers, rows, None if mine is None else mine[1])
            self.raise_recorded(op)
            return
        if rows is None and mine is None and not arrived_only:  # the common case: all agree
            ref, recv = self._send_np.tobytes(), self._recv_np
            if all(recv[q].tobytes() == ref for q in peers):
                return
        got = {q: (self._recv_np[q] if rows is None else rows[q]) for q in peers}
        if arrived_only:
            got = {q: w for q, w in got.items() if int(w[0]) == MAGIC}
        if mine is None:
            words, ref = self.mine, self._send_np.tobytes()  # ``send``: this call's words
            bad = {q: w for q, w in got.items() if w.tobytes() != ref}
        else:
            words = list(mine[0])
            bad = {q: w for q, w in got.items() if [int(v) for v in w] != words}
        if bad:
            self.schema.check(op, words, {q: list(w) for q, w in bad.items()},
                              rank=self.rank, where=self.where)

    def _verify_on_device(self, peers: Sequence[int], rows, send=None) -> None:
        send = self.send if send is None else send
        theirs = torch.stack([self.recv[q] if rows is None else rows[q] for q in peers])
        bad_rows = (theirs != send).any(dim=1)
        first = torch.argmax(bad_rows.to(torch.int64))
        key = tuple(peers)
        peer_ids = self._peer_ids.get(key)
        if peer_ids is None:  # once per peer set: a host-to-device copy of a few ints
            peer_ids = self._peer_ids[key] = torch.tensor(key, device=self.device)
        new = torch.cat([bad_rows.any().to(torch.int64).view(1), peer_ids[first].view(1),
                         send, theirs[first]])
        self._record = torch.where(self._record[0] != 0, self._record, new)
        self._flag = self._record[0] != 0
        self._record_host.copy_(self._record, non_blocking=True)

    def poison(self, *outs: torch.Tensor | None) -> None:
        """GPU: NaN the outputs of a call whose stamps disagreed (device-side; CPU raised)."""
        if not self._gpu:
            return
        for t in outs:
            if t is not None and t.is_floating_point():
                t.masked_fill_(self._flag, float("nan"))

    def raise_recorded(self, op: str) -> None:
        """Raise a mismatch the device recorded, once the host mirror shows it (no sync)."""
        if not self._gpu or not self._record_np[0]:
            return
        rec = [int(v) for v in self._record_np]
        self.schema.check(op, rec[2:2 + STAMP_WORDS], {rec[1]: rec[2 + STAMP_WORDS:]},
                          rank=self.rank, where=self.where)


# ---- stamps in the tail of a SUM-reduced buffer ---------------------------------------------
# A reduction cannot carry bytes, but it carries small integers exactly: each rank writes its
# stamp, split into ``bits``-bit chunks, into its own row of a [world, words * chunks] tail and
# zeros into every other row, so after the SUM every rank holds every rank's stamp (a sum of one
# chunk and zeros is exact in any dtype that holds the chunk). Ops that reduce (the plain
# all-reduce and reduce-scatter) append such a tail to the buffer they reduce anyway.

_EXACT_INT = {torch.float32: 2**24, torch.float64: 2**53, torch.bfloat16: 2**8,
              torch.float16: 2**11, torch.uint8: 255, torch.int8: 127, torch.int16: 2**15 - 1,
              torch.int32: 2**31 - 1, torch.int64: 2**63 - 1, torch.bool: 1}


def sum_tail_bits(dtype: torch.dtype) -> int:
    """Bits per chunk of a stamp in a SUM tail of ``dtype``: the largest of 32, 16, 8, 4, 2, 1
    whose chunks (< 2^bits) the dtype holds exactly (0 if none: a dtype that cannot carry one).
    fp32/int32 16, bf16/fp16/uint8 8, int8 4, fp64/int64 32, bool 1."""
    top = _EXACT_INT.get(dtype, 0)
    for bits in (32, 16, 8, 4, 2, 1):
        if 2**bits - 1 <= top:
            return bits
    return 0


def sum_tail_chunks(bits: int) -> int:
    """Chunks per 64-bit word."""
    return -(-64 // bits)


def pack_sum_tail(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 words [W] -> their chunks [W * chunks] (least significant first), int64 values in
    [0, 2^bits), on the words' device (no host sync); copy them into the tail in its dtype."""
    k = sum_tail_chunks(bits)
    shifts = torch.arange(k, dtype=torch.int64, device=words.device) * bits
    return ((words.view(-1, 1) >> shifts) & (2**bits - 1)).view(-1)


def unpack_sum_tail(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Reduced tail values [..., W * chunks] (any dtype) -> int64 words [..., W] (inverse of
    :func:`pack_sum_tail`; values are rounded, so a division by the world size and back is
    harmless). Device-side, no host sync."""
    k = sum_tail_chunks(bits)
    chunks = values.to(torch.float64).round().to(torch.int64)
    chunks = chunks.view(*chunks.shape[:-1], -1, k)
    shifts = torch.arange(k, dtype=torch.int64, device=values.device) * bits
    return (chunks << shifts).sum(-1)


# ---- a one-off agreement of settings (not per call: at construction, at start) ---------------

def agree_on(what: str, values: Mapping, device, *, group=None,
             error: type[Exception] = ValueError) -> None:
    """Raise the same ``error`` on every rank of ``group`` (default: the default group) if its
    ranks hold different ``values``: one all-gather of an 8-byte digest on ``device`` (a CUDA
    one on NCCL); only on a mismatch the values themselves are gathered, to name the first that
    differs with every rank's value (rank order)."""
    import hashlib

    import torch.distributed as dist

    blob = repr(sorted(values.items())).encode()
    digest = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little", signed=True)
    n = dist.get_world_size(group)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = torch.empty(n, dtype=torch.int64, device=device)
    # all_gather_single where torch has it (all_gather_into_tensor warns there, deprecated)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(every, mine,
                                                                           group=group)
    if len(set(every.tolist())) == 1:
        return
    tables: list = [None] * n
    dist.all_gather_object(tables, dict(values), group=group)
    rank = dist.get_rank()
    for key in values:
        column = [t.get(key) for t in tables]
        if len(set(map(repr, column))) > 1:
            raise error(f"{what}: ranks hold different {key!r} (rank order): {column}; every "
                        f"rank must pass the same (rank {rank})")
    raise error(f"{what}: ranks hold different settings: {tables} (rank {rank})")
