"""Per-call agreement for the fused TP ops (overlap.dist.stamp applied to a TPComm).

Contract: every op call on a communicator of more than one rank publishes a stamp (the op, the
communicator's call number, the 2-D shapes the backend sees, the dtype, ``chunks``, flags and
the backend), and every rank compares every peer's stamp before the call returns; a
disagreement raises overlap.dist.stamp's error (``Agreement.verify``) on every rank. The stamp
travels in data exchanged anyway: ``chunked`` in front of the first piece sent, ``symmetric``
and ``triton`` in a :class:`HeaderBlock` (a small userbuffer the communicator maps once),
``unfused`` (and the backward's plain gather/scatter) in its collective: stamped rows of the
all-gather, a SUM tail of the reduce-scatter and all-reduce (overlap.tp.backends). A
data wait that is slow compares the stamps already published (``watch``), so a peer that took
another path is named at once instead of waited for. The region collectives of overlap.nn
(``REGION_OPS``) count and stamp on the same communicator, through unfused's collectives.
The narrative: docs/design/tp.md.
"""

from __future__ import annotations

import threading

import torch

from overlap import _C
from overlap.dist.stamp import STAMP_WORDS, Agreement, Schema, shape_words
from overlap.symm.workspace import create_workspace

__all__ = ["SCHEMA", "REGION_OPS", "WORDS", "HeaderBlock", "stamp_values"]

# The region collectives (overlap.nn.regions, the column layer's dgrad all-reduce) share the
# communicator's counter: their ops follow, so the fused ops' codes are unchanged.
REGION_OPS = ("copy_to_tp backward", "reduce_from_tp", "scatter_to_tp backward",
              "gather_from_tp", "reduce_scatter_to_sp", "reduce_scatter_to_sp backward",
              "gather_from_sp", "gather_from_sp backward",
              "ColumnParallelLinear dgrad all_reduce")
SCHEMA = Schema("tp", ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                       "all_gather (tp backward)", "reduce_scatter (tp backward)") + REGION_OPS,
                (("x shape", 3, "shape"), ("w shape", 2, "shape"), ("dtype", 1, "dtype"),
                 ("chunks", 1, "int"), ("flags", 1, "int"),
                 ("backend", 1, ("auto", "chunked", "symmetric", "triton", "unfused"))))

WORDS = 3 + sum(f.words for f in SCHEMA.fields)  # what a SUM tail carries (the rest is zero)
_RING = 4  # a rank is at most one call ahead of any peer (every call settles all stamps)


def stamp_values(x: torch.Tensor, w: torch.Tensor | None, chunks: int, flags: int,
                 backend_code: int) -> dict:
    from overlap.dist.stamp import DTYPE_CODES

    return {"x shape": shape_words(x.shape, 3),
            "w shape": shape_words(() if w is None else w.shape, 2),
            "dtype": DTYPE_CODES.get(x.dtype, 0), "chunks": chunks, "flags": flags,
            "backend": backend_code}


class HeaderBlock:
    """A ring of stamp slots per rank in a userbuffer, with one signal per peer (slot q: the
    last call whose stamp rank q has published). Collective to create, like any workspace."""

    def __init__(self, group, *, device: torch.device, timeout: float):
        from overlap.profile.syncs import not_a_device_sync

        self.ws = create_workspace(group, _RING * STAMP_WORDS * 8, num_signals=max(
            1, torch.distributed.get_world_size(group)), device=device, timeout=timeout)
        self.rank, self.world = self.ws.rank, self.ws.world
        self.peers = [q for q in range(self.world) if q != self.rank]
        self._rings = [self.ws.view(q, torch.int64, (_RING, STAMP_WORDS))
                       for q in range(self.world)]
        self._gpu = self.ws.device.type == "cuda"
        self._lock = threading.Lock()
        self._closed = False
        self._open: tuple | None = None  # (op, agreement, call, timeout) published, not settled
        if not self._gpu:
            with not_a_device_sync("numpy views of shared host memory, made once"):
                self._rings_np = [r.numpy() for r in self._rings]
            # Signal addresses, looked up once: this rank's slot in each peer's flags (where
            # it publishes) and each peer's slot in its own flags (where it reads them).
            self._publish_at = [(q, self.ws.signal_ptr(q) + 8 * self.rank) for q in self.peers]
            self._seen_at = [(q, self.ws.signal_ptr(self.rank) + 8 * q) for q in self.peers]

    def exchange(self, op: str, agree: Agreement, timeout: float | None = None) -> None:
        """Publish this call's stamp, wait for every peer's, compare (raise on mismatch)."""
        self.publish(op, agree, timeout)
        self.settle()

    def publish(self, op: str, agree: Agreement, timeout: float | None = None) -> None:
        """Write this call's stamp into our ring slot and signal every peer; no wait. The call
        is then *open*: ``settle`` (before the call returns, or before it blocks on anything
        but a watched workspace wait) waits for the peers' stamps and compares them, and
        ``watch`` compares the ones already published from a blocked wait's slow path."""
        if self._gpu or self.ws.pending():
            self.ws.raise_pending(op)
        c = agree.calls
        slot = c % _RING
        if self._gpu:
            self._rings[self.rank][slot].copy_(agree.send)
            for q in self.peers:
                self.ws.signal(q, self.rank, c)
        else:
            self._check_open(op)
            self._rings_np[self.rank][slot] = agree._send_np
            for _, addr in self._publish_at:  # shared host memory: a store per peer
                _C.signal_store(addr, c)
        self._open = (op, agree, c, timeout)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"{op}: the communicator's stamp block is closed (rank "
                               f"{self.rank})")

    def settle(self) -> None:
        """Wait for every peer's stamp of the open call and compare (raise on mismatch); a
        no-op when no call is open. A peer publishes its stamp before any signal of the call's
        data, so after the data phase this wait is already satisfied.

        With device-side waits (CUDA; the shm twin with OVERLAP_SHM_DEVICE_WAITS=1) a wait
        that gives up records its error and returns: the stamps are then not compared (they
        are stale), the op's outputs are poisoned with this block's record (``poison``) and
        the next call raises it, as every symmetric op does with its own workspace."""
        if self._open is None:
            return
        op, agree, c, timeout = self._open
        self._open = None
        if self._gpu:  # device waits, in stream order
            for q in self.peers:
                self.ws.wait(q, c, timeout, peer=q)
        else:
            self._check_open(op)
            for q, addr in self._seen_at:
                if _C.signal_load(addr) < c:  # not published yet (after a data phase it is)
                    self.ws.wait(q, c, timeout, peer=q)
            if self.ws.pending():
                return  # a wait gave up (device-wait mode): outputs poisoned, next call raises
        slot = c % _RING
        rows = self._rings if self._gpu else self._rings_np
        agree.verify(op, self.peers, {q: rows[q][slot] for q in self.peers})

    def watch(self) -> None:
        """Called by a workspace wait that has not been satisfied for a while (the slow path
        only): raise if a peer has published its stamp of the open call and it differs from
        ours. A peer that disagrees may be blocked elsewhere (creating another context, or
        waiting on another workspace), so the data this rank waits for would never come."""
        current = self._open
        if current is None or self._gpu or self._closed:
            return
        op, agree, c, _ = current
        slot = c % _RING
        for q, addr in self._seen_at:
            if _C.signal_load(addr) >= c:
                agree.verify(op, [q], {q: self._rings_np[q][slot]})

    def poison(self, out: torch.Tensor) -> None:
        if self._gpu or self.ws.pending():  # on a GPU the record is not visible to the host
            self.ws.poison_if_error(out)

    def abort(self, reason: str) -> None:
        """Wake peers waiting on this rank's stamp (they raise with ``reason``), then free the
        block on a thread of its own once they have let go of it: a peer may still be reading
        this call's stamp, and a freed block is poisoned (as freed GPU memory is reused)."""
        self.ws.abort(reason)
        threading.Thread(target=self.close, kwargs={"wait_for_peers": True}, daemon=True,
                         name="overlap-deferred-free-tp-stamps").start()

    def close(self, *, wait_for_peers: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.ws.close(wait_for_peers=wait_for_peers, timeout=min(5.0, self.ws.timeout))
