"""Asynchronous point-to-point transfers between pipeline ranks.

Every transfer is posted with ``dist.batch_isend_irecv`` on its channel's communicator (one
direction of one link), issued on a comm stream (``overlap.dist.streams``), and returns at once;
the executor waits on a receive right before its consumer and on sends at the end of the step.
Shapes travel in a header of ``HEADER_LEN`` int64 (ndim, dtype code, sizes) only when the
receiver does not know them yet.

Errors: every wait has a timeout; a timeout or a dead peer raises ``P2PError`` naming the op,
the pp rank, the peer (pp and global rank) and what was being transferred. The first rank to
fail publishes a failure record in the job's store (naming the failed rank); every rank polls it
every ``POLL_S`` while it waits, so the ranks not next to the failure raise as fast, naming it.

The narrative: docs/design/pp.md.
"""

from __future__ import annotations

import threading
import time
import warnings
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from overlap.dist.streams import Event, Stream, StreamStillRunning
from overlap.errors import OverlapError
from overlap.profile.timers import comm_wait

__all__ = ["P2P", "P2PError", "HEADER_LEN", "POLL_S", "encode_header", "decode_header"]

MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# How often a waiting rank reads the pipeline's failure record: one store read per waiting rank
# per POLL_S, only while it waits, and the most a failure away from this rank adds to its raise.
POLL_S = 0.05


class P2PError(OverlapError, RuntimeError):
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


class _Posted:
    """A transfer posted on the comm stream: ``event`` marks the post, ``work`` is the backend's
    handle once the stream has run the post."""

    __slots__ = ("event", "work")

    def __init__(self) -> None:
        self.event: Event | None = None
        self.work = None

    def is_completed(self) -> bool:
        """Posted and finished (a query: never blocks, not a host sync)."""
        return self.event.query() and (self.work is None or self.work.is_completed())

    def wait(self, timeout: timedelta, watch: Callable[[], None] | None = None) -> None:
        """Wait up to ``timeout``; on CPU, ``watch`` (which raises to give up) runs every
        ``POLL_S`` until the transfer completes. On CUDA the wait is the stream's, not the
        host's, so there is nothing to watch."""
        seconds = timeout.total_seconds()
        self.event.wait(seconds, "pp p2p post")
        if watch is None or self.event.device.type == "cuda" or self.work.is_completed():
            self.work.wait(timeout=timeout)
            return
        deadline = time.monotonic() + seconds
        waiter = _Waiter(self.work, timeout)
        while not waiter.done.wait(max(min(POLL_S, deadline - time.monotonic()), 0.0)):
            watch()
            if time.monotonic() >= deadline:
                break
        waiter.finish(deadline)


class _Waiter:
    """Wakes ``done`` when a backend work completes, successfully or not; ``finish`` then
    raises its error, or its timeout. nccl_twin's works say so through their future. gloo's send
    and receive have none and complete only inside ``wait`` (whose timeout closes the channel,
    so it cannot be waited on in slices): a helper thread waits for them."""

    def __init__(self, work, timeout: timedelta):
        self.work, self.done = work, threading.Event()
        self.error: BaseException | None = None
        self.helper: threading.Thread | None = None
        try:
            work.get_future().add_done_callback(lambda _: self.done.set())
        except RuntimeError:  # "Work::getFuture not implemented"
            self.helper = threading.Thread(target=self._wait, args=(timeout,), daemon=True,
                                           name="overlap-pp-wait")
            self.helper.start()

    def _wait(self, timeout: timedelta) -> None:
        try:
            self.work.wait(timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            self.error = exc
        self.done.set()

    def finish(self, deadline: float) -> None:
        if self.helper is None:
            # Completed: raises its error, if any; else the backend's own timeout error.
            self.work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            return
        if not self.done.is_set():
            raise TimeoutError("the transfer did not complete in time")
        if self.error is not None:
            raise self.error


class _Channel:
    """A two-rank communicator that carries one direction of one pipeline link.

    Built directly as a backend of the pp group's kind (NCCL, the NCCL-ordering twin, or gloo)
    under a store prefix the pp ranks agreed on, so no world-collective ``new_group`` is
    needed. Transfers are lone send/recv on it: with one sender and one receiver its FIFO on
    both ends holds the same messages in the same order.

    NCCL creates the communicator lazily, at the first transfer, once both ends have issued
    one, and blocks the issuing thread until then: a rank whose first transfers touch two
    channels in the opposite order from a peer's waits forever. ``connect_all`` creates them
    at construction instead, in one global order."""

    def __init__(self, pp_group, store_prefix: str, global_ranks: list[int], me: int,
                 timeout: timedelta, device: torch.device):
        from overlap.dist import nccl_twin

        store = dist.PrefixStore(store_prefix, dist.distributed_c10d._get_default_store())
        self.me, self.device, self.name = me, device, store_prefix
        self.global_ranks = global_ranks
        if nccl_twin.is_twin(pp_group):
            self.backend = nccl_twin.NcclTwinGroup(store, me, 2, timeout, store_prefix,
                                                   global_ranks)
            nccl_twin.label(self.backend, "pp")
        elif device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.backend = dist.ProcessGroupNCCL(store, me, 2, opts)
        else:
            self.backend = dist.ProcessGroupGloo(store, me, 2, timeout)

    def transfer(self, t: torch.Tensor, is_send: bool):
        peer = 1 - self.me
        return (self.backend.send if is_send else self.backend.recv)([t], peer, 0)

    def connect(self, timeout: float) -> None:
        """Create the communicator now: one one-element transfer from src to dst, waited on a
        helper thread (NCCL's creation has no timeout of its own) for at most ``timeout`` s."""
        t = torch.zeros(1, device=self.device)
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # a new thread starts on device 0
                self.transfer(t, self.me == 0).wait(timedelta(seconds=timeout))
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                outcome.append(exc)

        helper = threading.Thread(target=run, daemon=True, name="overlap-channel-connect")
        helper.start()
        helper.join(timeout + 1.0)
        if outcome and outcome[0] is None:
            return
        peer = self.global_ranks[1 - self.me]
        how = f"failed: {outcome[0]}" if outcome else f"timed out after {timeout:g}s"
        raise RuntimeError(f"creating channel {self.name} (global ranks {self.global_ranks[0]} "
                           f"-> {self.global_ranks[1]}) with global rank {peer} {how}; both "
                           "ends create their channels at construction, in one order")

    def close(self) -> None:
        if hasattr(self.backend, "shutdown"):
            self.backend.shutdown()


def connect_all(channels: list[_Channel], timeout: float) -> None:
    """Create ``channels``' communicators in one global order (by their global (src, dst)):
    every channel joins two ranks that both create it, so no two ranks wait on each other."""
    for chan in sorted(channels, key=lambda c: tuple(c.global_ranks)):
        chan.connect(timeout)


class P2P:
    """Transfers between the ranks of ``pp_group`` (peers are given as pp ranks).

    Each ``channel`` (src, dst) in pp ranks is a two-rank communicator of its own, created
    here (collective over the two ranks of each channel; ``token`` must be the same on every
    pp rank and unique to this pipeline). Only src sends on it, so NCCL's
    one-op-at-a-time order per communicator never interleaves the two directions of a link."""

    def __init__(self, pp_group: dist.ProcessGroup, *, timeout: float, device: torch.device,
                 channels: Sequence[tuple[int, int]] = (), token: str = ""):
        if timeout <= 0:
            raise ValueError(f"pp P2P: timeout must be > 0 seconds, got {timeout}")
        self.group = pp_group
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = dist.get_world_size(pp_group)
        self.global_ranks = [dist.get_global_rank(pp_group, r) for r in range(self.pp_size)]
        self.timeout = timedelta(seconds=timeout)
        self.device = device
        # The pipeline's failure record: set once, by the first pp rank to fail (see publish).
        self._store = dist.distributed_c10d._get_default_store()
        self._record_key = f"overlap_pp/{token}/failed"
        self._stream = Stream(device, name=f"pp p2p {token}")
        self.channels: dict[tuple[int, int], _Channel] = {}
        for c in channels:
            if self.pp_rank not in c or c[0] == c[1]:
                raise ValueError(f"pp P2P: channel {c} must join pp rank {self.pp_rank} and "
                                 "another pp rank")
            src, dst = (self.global_ranks[x] for x in c)
            self.channels[tuple(c)] = _Channel(
                pp_group, f"overlap_pp/{token}/{src}->{dst}", [src, dst],
                0 if c[0] == self.pp_rank else 1, self.timeout, device)
        try:
            connect_all(list(self.channels.values()), timeout)
        except RuntimeError as exc:
            self.close()
            raise P2PError(f"pp P2P on pp rank {self.pp_rank}: {exc}") from exc

    def close(self) -> None:
        """Release the channel communicators (local: each end releases its own). A P2P worker
        still inside a transfer after the timeout keeps them (with a RuntimeWarning): it may
        still use them."""
        try:
            self._stream.close(self.timeout.total_seconds())
        except StreamStillRunning as exc:
            warnings.warn(f"pp P2P: pp rank {self.pp_rank}: the channels are not released: "
                          f"{exc}", RuntimeWarning, stacklevel=2)
            return
        for c in self.channels.values():
            c.close()
        self.channels.clear()

    def describe(self, peer: int) -> str:
        return f"pp rank {peer} (global rank {self.global_ranks[peer]})"

    def post(self, channel: tuple[int, int], sends: list[tuple[torch.Tensor, int]],
             recvs: list[tuple[torch.Tensor, int]]) -> tuple[list, list]:
        """Post the sends or receives of one channel as one batch; returns (send works, recv
        works). Order within the batch = order of the lists; it must match the other end's
        (the plan guarantees it)."""
        chan = self.channels[channel]
        if not sends and not recvs:
            return [], []
        ops = [(t, True) for t, _ in sends] + [(t, False) for t, _ in recvs]
        posted = [_Posted() for _ in ops]
        peer = channel[1] if channel[0] == self.pp_rank else channel[0]

        def post() -> None:
            try:
                for (t, is_send), handle in zip(ops, posted):
                    handle.work = chan.transfer(t, is_send)
            except RuntimeError as exc:
                raise self._failed(peer, "post to/from it failed",
                                   f"pp p2p post on pp rank {self.pp_rank}: posting to/from "
                                   f"{self.describe(peer)} failed: {exc}",
                                   f"posting to/from {self.describe(peer)}") from exc

        self._stream.wait_current()
        self._stream.enqueue(post, tuple(t for t, _ in ops))
        event = self._stream.record_event()
        for handle in posted:
            handle.event = event
        return posted[:len(sends)], posted[len(sends):]

    def failure(self) -> str | None:
        """The pipeline's failure record (the rank that failed first, and how), or None. A
        store that does not answer reads as no record: the transfers' own timeouts still hold."""
        try:
            if self._store.check([self._record_key]):
                return self._store.get(self._record_key).decode()
        except RuntimeError:
            pass
        return None

    def publish(self, culprit: int, account: str) -> str:
        """Record that pp rank ``culprit`` failed (``account``: what this rank saw) unless a
        failure is recorded already; returns the record that stands (the first one)."""
        mine = f"{self.describe(culprit)}: {account}"
        try:
            return self._store.compare_set(self._record_key, "", mine).decode()
        except RuntimeError:
            return mine

    def check_failed(self, what: str) -> None:
        """Raise ``P2PError`` if the pipeline has failed (on any rank); ``what``: this rank's
        operation, for the message."""
        record = self.failure()
        if record is not None:
            raise P2PError(f"pp p2p on pp rank {self.pp_rank}: the pipeline failed at {record}; "
                           f"this rank gave up {what}")

    def wait(self, work, *, what: str, peer: int) -> None:
        """Wait for one transfer with the timeout; errors name the transfer and the peer, and
        say whether it failed (at once: a dead peer, a broken connection) or timed out. A
        failure elsewhere in the pipeline (its record) ends the wait within ``POLL_S`` and is
        named instead, as is a failure recorded before this transfer's own (the peer gave up
        because of it)."""
        t0 = time.monotonic()
        gave_up = f"its {what} with {self.describe(peer)}"
        try:
            with comm_wait("pp.p2p"):
                work.wait(self.timeout, watch=lambda: self.check_failed(gave_up))
        except P2PError:
            raise
        except (RuntimeError, TimeoutError) as exc:
            took, limit = time.monotonic() - t0, self.timeout.total_seconds()
            how = (f"timed out after {limit:g}s" if took >= 0.9 * limit else
                   f"failed after {took:.2f}s (the peer died, aborted or closed its connection)")
            raise self._failed(peer, f"{what} with it {how}",
                               f"pp p2p on pp rank {self.pp_rank}: {what} with "
                               f"{self.describe(peer)} {how}: {exc}",
                               f"{gave_up} ({how})") from exc

    def _failed(self, peer: int, saw: str, message: str, gave_up: str) -> P2PError:
        """A transfer with ``peer`` failed here (``saw``: how): record ``peer`` as the culprit
        unless a failure was recorded first. The error: ``message`` when this record stands,
        else the standing record first (the peer most likely gave up because of it)."""
        mine = f"pp rank {self.pp_rank}'s {saw}"
        record = self.publish(peer, mine)
        if record == f"{self.describe(peer)}: {mine}":
            return P2PError(message)
        return P2PError(f"pp p2p on pp rank {self.pp_rank}: the pipeline failed at {record}; "
                        f"this rank gave up {gave_up}")
