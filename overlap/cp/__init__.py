"""Context parallelism: ring attention over a CP group (``ring_attention`` with a ``CPComm``)
and the zig-zag sharding of the sequence it expects. The user's view: docs/cp.md."""

from overlap.cp.comm import CPComm, CPCommFailed
from overlap.cp.ring import ring_attention
from overlap.cp.zigzag import zigzag_chunks, zigzag_shard, zigzag_unshard

__all__ = ["CPComm", "CPCommFailed", "ring_attention", "zigzag_shard", "zigzag_unshard",
           "zigzag_chunks"]
