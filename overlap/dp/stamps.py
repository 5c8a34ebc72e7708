"""Per-call agreement of GradReducer buckets and ShardedOptimizer gathers (overlap.dist.stamp
applied to the DP group).

Every fp32 bucket collective on more than one rank carries a stamp (bucket index, sizes, dtype,
parameter signature, op, call counter) in the data it exchanges anyway: the all-reduce in a
tail of the bucket's flat buffer (``Bucket.tail``, ``dp * 36`` fp32 or ``dp * 72`` 16-bit
elements), the reduce-scatter of ``shard=True`` in such a tail after every shard of a staged
send buffer, summed by the collective; ShardedOptimizer's parameter all-gather in 64 bytes at
the end of each rank's row (``GatherStamps``, with the step count). No extra collective or
host sync; the extra bytes and copies: docs/dp.md.

Errors: a rank whose call differs (other parameters or sizes, a skipped, repeated or reordered
call, another optimizer step) raises ``Disagreement`` naming the op, the bucket, the first
differing field and both ranks' values. bf16 / int8 buckets: ``overlap.comm.quant`` with
``tag=bucket_tag(...)``. The narrative: docs/design/dp.md.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch

from overlap.dist.stamp import (DTYPE_CODES, Agreement, Schema, pack_sum_tail, sum_tail_bits,
                                sum_tail_chunks, unpack_sum_tail)

__all__ = ["SCHEMA", "WORDS", "OP", "OP_SCATTER", "tail_elements", "BucketStamps", "bucket_tag",
           "GATHER_SCHEMA", "GATHER_OP", "GATHER_BYTES", "GatherStamps"]

SCHEMA = Schema("dp", ("GradReducer bucket all_reduce", "GradReducer bucket reduce_scatter"),
                (("bucket", 1, "int"), ("numel", 1, "int"), ("padded", 1, "int"),
                 ("dtype", 1, "dtype"), ("params", 1, "int"), ("op", 1, ("avg", "sum")),
                 ("backward passes", 1, "int")))
OP, OP_SCATTER = SCHEMA.ops
WORDS = 3 + 7  # MAGIC, call, op code and the fields; the rest of the 16 words is zero

GATHER_SCHEMA = Schema("dp", ("ShardedOptimizer parameter all_gather",),
                       (("bucket", 1, "int"), ("padded", 1, "int"), ("dtype", 1, "dtype"),
                        ("params", 1, "int"), ("step", 1, "int")))
GATHER_OP = GATHER_SCHEMA.ops[0]
GATHER_WORDS = 3 + 5
GATHER_BYTES = GATHER_WORDS * 8  # after each rank's payload, at an 8-byte boundary


def tail_elements(dtype: torch.dtype, world: int) -> int:
    """Elements a bucket of ``dtype`` reserves for the stamps of ``world`` ranks (after the
    bucket for the all-reduce, after each shard for the reduce-scatter)."""
    return world * WORDS * sum_tail_chunks(sum_tail_bits(dtype))


def _params_signature(ids: Sequence[int], params: Sequence[torch.Tensor]) -> int:
    text = ";".join(f"{i}:{tuple(params[i].shape)}" for i in ids)
    return zlib.crc32(text.encode()) & 0x7FFF_FFFF


def bucket_tag(bucket, params: Sequence[torch.Tensor]) -> int:
    """The ``tag`` a quantized bucket collective carries in its stamp: the bucket's index and
    parameter signature (what its sizes alone do not show)."""
    return (bucket.index << 31) | _params_signature(bucket.params, params)


class BucketStamps:
    """The stamps of one reducer's bucket collectives (several may be in flight at once)."""

    def __init__(self, *, rank: int, world: int, device: torch.device, where: str):
        self.rank, self.world = rank, world
        self.agree = Agreement(SCHEMA, rank=rank, world=world, device=device, where=where)
        self.peers = [q for q in range(world) if q != rank]
        self._gpu = torch.device(device).type == "cuda"
        self._version = 0
        self._mine: dict[int, tuple[str, list[int], torch.Tensor | None]] = {}
        self.passes = 1  # backward passes in the reduction being stamped (set by the reducer)

    def new_layout(self) -> None:
        self._version += 1
        self._mine.clear()

    def _next(self, name: str, bucket, params: Sequence[torch.Tensor],
              op: str) -> torch.Tensor:
        """Count the call; this rank's stamp as SUM-tail chunks of the bucket's dtype. The
        backward passes summed since the last reduction (``passes``) tell a rank that stepped
        out of ``no_sync`` at another time (its call numbers stay in step)."""
        passes = self.passes
        words = self.agree.next(name, key=(self._version, bucket.index, name, passes),
                                make=lambda: {
            "bucket": bucket.index, "numel": bucket.numel, "padded": bucket.padded,
            "dtype": DTYPE_CODES.get(bucket.dtype, 0),
            "params": _params_signature(bucket.params, params),
            "op": ("avg", "sum").index(op), "backward passes": passes})
        self._mine[bucket.index] = (name, list(words),
                                    self.agree.send.clone() if self._gpu else None)
        return pack_sum_tail(self.agree.send[:WORDS], sum_tail_bits(bucket.dtype))

    def write(self, bucket, tail: torch.Tensor, params: Sequence[torch.Tensor], op: str) -> None:
        """All-reduce: count bucket ``bucket``'s call and write this rank's stamp row into
        ``tail`` (the bucket's ``[world * row]`` tail; the other rows zero)."""
        chunks = self._next(OP, bucket, params, op)
        rows = tail.view(self.world, -1)
        rows.zero_()
        rows[self.rank].copy_(chunks)

    def write_scatter(self, bucket, tails: torch.Tensor, params: Sequence[torch.Tensor],
                      op: str) -> None:
        """Reduce-scatter: ``tails`` [world, tail] are the tails of the world send rows (one per
        destination shard); each gets this rank's stamp in row ``rank`` of its table, so every
        rank receives every rank's stamp."""
        chunks = self._next(OP_SCATTER, bucket, params, op)
        table = tails.view(self.world, self.world, -1)
        table.zero_()
        table[:, self.rank].copy_(chunks)

    def verify(self, bucket, tail: torch.Tensor, grads: torch.Tensor) -> None:
        """After the collective: compare every rank's row of the summed ``tail`` with this
        rank's stamp. CPU: raises Disagreement. GPU: the comparison is recorded on the device
        and raised at the next host-visible point, and the bucket's reduced ``grads`` are NaN
        on the device meanwhile (the optimizer never steps on mismatched sums as if they were
        valid)."""
        name, words, send = self._mine.pop(bucket.index)
        rows = unpack_sum_tail(tail.view(self.world, -1), sum_tail_bits(bucket.dtype))
        self.agree.recv[:, :WORDS].copy_(rows)
        try:
            self.agree.verify(name, self.peers, mine=(words, send))
        finally:
            self.agree.poison(grads)  # device path only; a no-op where verify raised at once


class GatherStamps:
    """The stamps of one ShardedOptimizer's parameter all-gathers: ``GATHER_BYTES`` at the end
    of each rank's send row (the gathered rows carry every rank's)."""

    def __init__(self, *, rank: int, world: int, device: torch.device, where: str):
        self.agree = Agreement(GATHER_SCHEMA, rank=rank, world=world, device=device,
                               where=where)
        self.peers = [q for q in range(world) if q != rank]
        self._gpu = torch.device(device).type == "cuda"
        self._mine: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        self._signatures: dict[int, int] = {}

    def new_layout(self) -> None:
        self._mine.clear()
        self._signatures.clear()

    def write(self, bucket, dtype: torch.dtype, params: Sequence[torch.Tensor], step: int,
              slot: torch.Tensor) -> None:
        """Count bucket ``bucket``'s gather (parameters of ``dtype``, after optimizer step
        ``step``) and write the stamp into ``slot`` (``GATHER_BYTES`` uint8 of the send row)."""
        words = self.agree.next(GATHER_OP, {
            "bucket": bucket.index, "padded": bucket.padded, "dtype": DTYPE_CODES.get(dtype, 0),
            "params": self._signature(bucket, params), "step": step})
        slot.copy_(self.agree.send[:GATHER_WORDS].view(torch.uint8))
        self._mine[bucket.index] = (list(words), self.agree.send.clone() if self._gpu else None)

    def _signature(self, bucket, params) -> int:
        sig = self._signatures.get(bucket.index)
        if sig is None:
            sig = self._signatures[bucket.index] = _params_signature(bucket.params, params)
        return sig

    def verify(self, bucket, slots: torch.Tensor, out: torch.Tensor) -> None:
        """``slots`` [world, GATHER_BYTES] uint8: the gathered stamps; compare them with this
        rank's before ``out`` is used. CPU: raises Disagreement. GPU: recorded on the device,
        raised at the next host-visible point; call ``poison(out)`` after filling ``out``."""
        words, send = self._mine.pop(bucket.index)
        self.agree.recv[:, :GATHER_WORDS].copy_(slots.view(torch.int64))
        self.agree.verify(GATHER_OP, self.peers, mine=(words, send))

    def poison(self, out: torch.Tensor) -> None:
        self.agree.poison(out)
