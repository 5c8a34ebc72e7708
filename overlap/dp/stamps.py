"""Per-call agreement of GradReducer buckets (overlap.dist.stamp applied to the DP group).

Every bucket all-reduce on more than one rank carries a stamp (bucket index, sizes, dtype,
parameter signature, op, call counter) in a tail of the bucket's flat buffer (``Bucket.tail``,
``dp * 36`` fp32 or ``dp * 72`` 16-bit elements), summed by the same all-reduce: no extra
collective, message or host sync.

Errors: a rank whose bucket holds other parameters or another size, or that skipped or repeated
a bucket, raises ``Disagreement`` naming the bucket, the first differing field and both ranks'
values (sizes that differ are refused first by the transport). bf16 / int8 buckets are checked
by ``overlap.comm.quant`` with ``tag=bucket_tag(...)``; the fp32 reduce-scatter of
``shard=True`` is not stamped yet.

The narrative: docs/design/dp.md.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from overlap.dist.stamp import (DTYPE_CODES, Agreement, Schema, pack_sum_tail, sum_tail_bits,
                                sum_tail_chunks, unpack_sum_tail)

__all__ = ["SCHEMA", "WORDS", "OP", "tail_elements", "BucketStamps", "bucket_tag"]

SCHEMA = Schema("dp", ("GradReducer bucket all_reduce",),
                (("bucket", 1, "int"), ("numel", 1, "int"), ("padded", 1, "int"),
                 ("dtype", 1, "dtype"), ("params", 1, "int"), ("op", 1, ("avg", "sum"))))
OP = SCHEMA.ops[0]
WORDS = 3 + 6  # MAGIC, call, op code and the fields; the rest of the 16 words is zero


def tail_elements(dtype: torch.dtype, world: int) -> int:
    """Elements a bucket of ``dtype`` reserves for the stamps of ``world`` ranks."""
    return world * WORDS * sum_tail_chunks(sum_tail_bits(dtype))


def _params_signature(ids: Sequence[int], params: Sequence[torch.Tensor]) -> int:
    text = ";".join(f"{i}:{tuple(params[i].shape)}" for i in ids)
    return zlib.crc32(text.encode()) & 0x7FFF_FFFF


def bucket_tag(bucket, params: Sequence[torch.Tensor]) -> int:
    """The ``tag`` a quantized bucket collective carries in its stamp: the bucket's index and
    parameter signature (what its sizes alone do not show)."""
    return (bucket.index << 31) | _params_signature(bucket.params, params)


class BucketStamps:
    """The stamps of one reducer's bucket all-reduces (several may be in flight at once)."""

    def __init__(self, *, rank: int, world: int, device: torch.device, where: str):
        self.rank, self.world = rank, world
        self.agree = Agreement(SCHEMA, rank=rank, world=world, device=device, where=where)
        self.peers = [q for q in range(world) if q != rank]
        self._gpu = torch.device(device).type == "cuda"
        self._version = 0
        self._mine: dict[int, tuple[list[int], torch.Tensor | None]] = {}

    def new_layout(self) -> None:
        self._version += 1
        self._mine.clear()

    def write(self, bucket, tail: torch.Tensor, params: Sequence[torch.Tensor], op: str) -> None:
        """Count bucket ``bucket``'s call and write this rank's stamp row into ``tail``."""
        words = self.agree.next(OP, key=(self._version, bucket.index), make=lambda: {
            "bucket": bucket.index, "numel": bucket.numel, "padded": bucket.padded,
            "dtype": DTYPE_CODES.get(bucket.dtype, 0),
            "params": _params_signature(bucket.params, params),
            "op": ("avg", "sum").index(op)})
        rows = tail.view(self.world, -1)
        rows.zero_()
        rows[self.rank].copy_(pack_sum_tail(self.agree.send[:WORDS],
                                            sum_tail_bits(bucket.dtype)))
        self._mine[bucket.index] = (list(words), self.agree.send.clone() if self._gpu else None)

    def verify(self, bucket, tail: torch.Tensor, grads: torch.Tensor) -> None:
        """After the all-reduce: compare every rank's row with this rank's stamp. CPU: raises
        Disagreement. GPU: the comparison is recorded on the device and raised at the next
        host-visible point, and the bucket's reduced ``grads`` are NaN on the device meanwhile
        (the optimizer never steps on mismatched sums as if they were valid)."""
        mine = self._mine.pop(bucket.index)
        rows = unpack_sum_tail(tail.view(self.world, -1), sum_tail_bits(bucket.dtype))
        self.agree.recv[:, :WORDS].copy_(rows)
        try:
            self.agree.verify(OP, self.peers, mine=mine)
        finally:
            self.agree.poison(grads)  # device path only; a no-op where verify raised at once

