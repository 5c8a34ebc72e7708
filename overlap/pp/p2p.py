"""Asynchronous point-to-point transfers between pipeline ranks.

Every transfer is posted with ``dist.batch_isend_irecv`` (one call per group of adjacent comm
actions of a schedule) and returns at once; the executor waits on a receive only right before
the compute that consumes it, and on a send only at the end of the step (send buffers are
fresh tensors that nothing overwrites, so the step end is the first time a buffer could be
reused). On GPU the transfers are issued from a side stream that first waits on an event
recorded on the compute stream after the producing compute; waiting on a receive's work then
makes the compute stream wait for it, so the host never blocks. On CPU (gloo) the transfers
run on gloo's own threads while this process computes.

Shapes travel in a fixed-size header (``HEADER_LEN`` int64: ndim, dtype code, sizes) only when
the receiver does not know them yet; the executor caches them (see ``overlap.pp.executor``).

Every wait has a timeout; a timeout or a dead peer raises ``P2PError`` naming the op, the
pp rank, the peer (pp and global rank) and what was being transferred.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
from overlap.profile.timers import comm_wait

__all__ = ["P2P", "P2PError", "HEADER_LEN", "encode_header", "decode_header"]

MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class P2PError(RuntimeError):
    """A pipeline transfer failed or timed out."""


def encode_header(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES:
        raise TypeError(f"pp p2p: can only send floating activations {_DTYPES}, got {t.dtype}")
    if t.dim() > MAX_DIMS:
        raise ValueError(f"pp p2p: tensors with more than {MAX_DIMS} dims are not supported, "
                         f"got shape {tuple(t.shape)}")
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0], h[1] = t.dim(), _DTYPES.index(t.dtype)
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h.to(t.device)


def decode_header(h: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    vals = h.tolist()
    ndim, code = vals[0], vals[1]
    if not (0 <= ndim <= MAX_DIMS and 0 <= code < len(_DTYPES)):
        raise P2PError(f"pp p2p: corrupt shape header {vals} (sender and receiver disagree on "
                       "the message order?)")
    return tuple(vals[2:2 + ndim]), _DTYPES[code]


class _StreamOrder:
    """GPU: a comm side stream ordered after the compute stream by an event. CPU: nothing."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def issue(self, tensors: list[torch.Tensor]):
        if self.stream is None:
            yield
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        # The comm stream must not read a send buffer before the compute writing it is done.
        self.stream.wait_event(ready)
        for t in tensors:
            t.record_stream(self.stream)  # keep the allocator from reusing it mid-transfer
        with torch.cuda.stream(self.stream):
            yield


class P2P:
    """Transfers between the ranks of ``pp_group`` (peers are given as pp ranks)."""

    def __init__(self, pp_group: dist.ProcessGroup, *, timeout: float, device: torch.device):
        if timeout <= 0:
            raise ValueError(f"pp P2P: timeout must be > 0 seconds, got {timeout}")
        self.group = pp_group
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = dist.get_world_size(pp_group)
        self.global_ranks = [dist.get_global_rank(pp_group, r) for r in range(self.pp_size)]
        self.timeout = timedelta(seconds=timeout)
        self.device = device
        self._order = _StreamOrder(device)

    def describe(self, peer: int) -> str:
        return f"pp rank {peer} (global rank {self.global_ranks[peer]})"

    def post(self, sends: list[tuple[torch.Tensor, int]],
             recvs: list[tuple[torch.Tensor, int]]) -> tuple[list, list]:
        """Post all sends and receives in one batch; returns (send works, recv works).

        Order within the batch = order of the lists, sends first; per peer it must match the
        peer's order (the schedule guarantees it)."""
        ops = [dist.P2POp(dist.isend, t, peer=self.global_ranks[d], group=self.group)
               for t, d in sends]
        ops += [dist.P2POp(dist.irecv, t, peer=self.global_ranks[s], group=self.group)
                for t, s in recvs]
        if not ops:
            return [], []
        try:
            with self._order.issue([t for t, _ in sends] + [t for t, _ in recvs]):
                works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            peers = sorted({p for _, p in sends} | {p for _, p in recvs})
            raise P2PError(f"pp p2p post on pp rank {self.pp_rank}: posting to/from pp ranks "
                           f"{peers} failed: {exc}") from exc
        return works[:len(sends)], works[len(sends):]

    def wait(self, work, *, what: str, peer: int) -> None:
        """Wait for one transfer with the timeout; errors name the transfer and the peer."""
        try:
            with comm_wait("pp.p2p"):
                work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise P2PError(f"pp p2p on pp rank {self.pp_rank}: {what} with "
                           f"{self.describe(peer)} failed or timed out after "
                           f"{self.timeout.total_seconds():g}s: {exc}") from exc

    def recv_now(self, shape, dtype, peer: int, *, what: str) -> torch.Tensor:
        """Post and wait for one receive (used for shape headers)."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        _, (work,) = self.post([], [(buf, peer)])
        self.wait(work, what=what, peer=peer)
        return buf
