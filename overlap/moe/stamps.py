"""Per-call agreement of the EP exchanges (overlap.dist.stamp applied to an EPComm).

Every all-to-all of a layer's exchange on more than one rank carries a stamp of ``WORDS`` int64
words: the op, the communicator's call number (forward and backward counted apart) and what
every rank must pass alike (the layer's creation index on the communicator, the expert count,
the hidden size, the activation dtype, the mode and capacity, the piece). The chunked backend
puts it in ``stamp_rows`` extra rows at the end of each destination's block of the rows it
sends anyway (split sizes are host integers, so this costs no sync and no collective); the
dropless counts exchange appends it to each destination's counts; the symmetric backend writes
it into a slot of the peer's workspace before the signal that publishes the rows. The receiver
compares every peer's stamp before it uses the rows: a mismatch raises ``Disagreement`` (op,
call, both ranks' signatures) on every rank, and the EPComm stays failed. On a GPU the
comparison is recorded on the device, the call's outputs are NaN and the next call raises
(overlap.dist.stamp).
The narrative: docs/moe.md ("Per-call agreement").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from overlap.dist.stamp import DTYPE_CODES, Agreement, Disagreement, Schema

__all__ = ["SCHEMA", "WORDS", "STAMP_BYTES", "DISAGREE", "Signature", "EPStamps", "stamp_rows"]

SCHEMA = Schema("ep", ("moe counts", "moe dispatch", "moe combine", "moe combine grad",
                       "moe dispatch grad"),
                (("layer", 1, "int"), ("experts", 1, "int"), ("hidden", 1, "int"),
                 ("dtype", 1, "dtype"), ("mode", 1, ("capacity", "dropless")),
                 ("capacity", 1, "int"), ("piece", 1, "int")))
WORDS = 3 + 7  # MAGIC, call, op code, the fields: the rest of a stamp's 16 words is zero
STAMP_BYTES = WORDS * 8  # 80
_BACKWARD = ("moe combine grad", "moe dispatch grad")
DISAGREE = "disagree on the call"  # ends the abort reason a disagreement fails an EPComm with


class Signature(NamedTuple):
    """What a layer's exchange calls must agree on (besides the op, piece and call number)."""
    layer: int      # the layer's creation index on its EPComm (-1: an exchange called directly)
    experts: int    # E
    dropless: bool
    capacity: int   # C slots per (source, expert) of the chunked capacity mode; else 0 (the
                    # symmetric backend takes ranks with different capacities)


def stamp_rows(row_bytes: int) -> int:
    """Rows of ``row_bytes`` bytes that hold one stamp."""
    return -(-STAMP_BYTES // row_bytes)


class Tick(NamedTuple):
    """One stamped call: its op, agreement, words and the stamp on the data's device (on the
    CPU ``send`` itself, valid until the next call: it is written at once)."""
    op: str
    agree: Agreement
    words: list[int]
    send: torch.Tensor


class EPStamps:
    """One EPComm's stamps: a forward and a backward call counter, the writes and the checks."""

    def __init__(self, comm):
        self.comm = comm
        self.peers = [q for q in range(comm.world) if q != comm.rank]
        self._agree: dict[bool, Agreement] = {}

    def _agreement(self, backward: bool, device: torch.device) -> Agreement:
        agree = self._agree.get(backward)
        if agree is None or agree.device != device:
            calls = agree.calls if agree is not None else 0  # a new device keeps the count
            agree = self._agree[backward] = Agreement(
                SCHEMA, rank=self.comm.rank, world=self.comm.world, device=device,
                where=f" (EP group of {self.comm.world}, global rank {self.comm.global_rank})")
            agree.calls = calls
        return agree

    def begin(self, op: str, sign: Signature, hidden: int, dtype: torch.dtype, piece: int,
              device: torch.device, *, keep: bool = False) -> Tick:
        """Count the call (on every rank alike) and stamp it; raise a disagreement an earlier
        call recorded on the device. ``keep``: the stamp is written after the next call's
        (the symmetric backend's answers), so the CPU keeps a copy too."""
        self.comm.check_usable(op)
        for agree in self._agree.values():
            self._guard(agree.raise_recorded, op)
        agree = self._agreement(op in _BACKWARD, torch.device(device))
        words = agree.next(op, key=(op, sign, hidden, dtype, piece), make=lambda: {
            "layer": sign.layer, "experts": sign.experts, "hidden": hidden,
            "dtype": DTYPE_CODES.get(dtype, 0), "mode": int(sign.dropless),
            "capacity": sign.capacity, "piece": piece})
        send = agree.send.clone() if agree.device_path or keep else agree.send
        return Tick(op, agree, list(words), send)

    def write(self, tick: Tick, buf: torch.Tensor, at: torch.Tensor) -> None:
        """The stamp into the bytes ``at`` [peers, STAMP_BYTES] of ``buf`` (rows it sends)."""
        buf.view(torch.uint8).view(-1).index_put_((at,), tick.send[:WORDS].view(torch.uint8))

    def verify(self, tick: Tick, buf: torch.Tensor, at: torch.Tensor, *outs) -> None:
        """Compare the stamps in bytes ``at`` of received ``buf`` (row q from rank q) with
        ``tick``'s before anything reads the rows; on a GPU, NaN ``outs`` on a mismatch."""
        got = buf.view(torch.uint8).view(-1)[at]
        tick.agree.recv[:, :WORDS].copy_(got.view(torch.int64))
        self._guard(tick.agree.verify, tick.op, self.peers, mine=(tick.words, tick.send))
        tick.agree.poison(*outs)

    def verify_row(self, tick: Tick, q: int, row: torch.Tensor) -> None:
        """Compare the stamp ``row`` (STAMP_WORDS int64 words, e.g. a slot of a workspace)
        that rank ``q`` wrote with ``tick``'s."""
        tick.agree.recv[q].copy_(row)
        self._guard(tick.agree.verify, tick.op, [q], mine=(tick.words, tick.send))

    def check_host(self, tick: Tick, theirs: dict[int, list[int]]) -> None:
        """Compare stamps the caller already read on the host (the dropless counts)."""
        mine = tick.words[:WORDS]
        self._guard(SCHEMA.check, tick.op, mine, theirs, rank=self.comm.rank,
                    where=tick.agree.where)

    def _guard(self, check, *args, **kw) -> None:
        try:
            check(*args, **kw)
        except Disagreement as exc:
            self.comm.fail(RuntimeError(f"{exc.op}: EP ranks {exc.ranks[0]} and "
                                        f"{exc.ranks[1]} {DISAGREE}"))
            raise
