"""Context parallelism: attention over a CP group (``ring_attention``, ``allgather_attention``,
``ulysses_attention``, and ``cp_attention`` that dispatches to one of them or picks by
measurement), the ``CPComm`` they run on, and the zig-zag sharding of the sequence they
expect. The user's view: docs/cp.md."""

from overlap.cp.allgather import allgather_attention
from overlap.cp.attention import METHODS, choice_key, cp_attention
from overlap.cp.comm import CPComm, CPCommFailed
from overlap.cp.ring import ring_attention
from overlap.cp.ulysses import ulysses_attention, ulysses_fits
from overlap.cp.zigzag import zigzag_chunks, zigzag_shard, zigzag_unshard

__all__ = ["CPComm", "CPCommFailed", "ring_attention", "allgather_attention",
           "ulysses_attention", "ulysses_fits", "cp_attention", "choice_key", "METHODS",
           "zigzag_shard", "zigzag_unshard", "zigzag_chunks"]
