"""The SymmetricWorkspace base class, its errors and helpers, shared by the backends
(overlap.symm.shm, overlap.symm.cuda); the API and the protocol are described in
overlap.symm.workspace."""

from __future__ import annotations

import abc
from typing import Sequence

import torch
import torch.distributed as dist

from overlap.errors import OverlapError

__all__ = ["SymmetricWorkspace", "SignalTimeout", "PeerDied", "group_name"]


class SignalTimeout(OverlapError, TimeoutError):
    """A signal wait ran out of time. Attributes name what was waited for."""

    def __init__(self, message: str, *, group: str, slot: int, expected: int, seen: int):
        super().__init__(message)
        self.group, self.slot, self.expected, self.seen = group, slot, expected, seen


def recorded_error(op: str, rank: int, group: str, record) -> "SignalTimeout | PeerDied | None":
    """The exception for an error record written by a device-side wait (csrc/signal.cuh
    ErrorWord: code, slot, last seen, aborting rank + 1, peer), or None if it is clear."""
    code, slot, seen, aborted, peer = (int(v) for v in record[:5])
    if code == 0:
        return None
    by = "" if peer < 0 else f" (signalled by rank {peer})"
    if code == 2:
        return PeerDied(f"{op}: rank {rank} in group {group}: rank {aborted - 1} aborted or died "
                        f"while this rank's stream waited on slot {slot}{by}; the op's outputs "
                        "were poisoned (NaN)", group=group, peer=aborted - 1)
    return SignalTimeout(f"{op}: rank {rank} in group {group}: the stream's wait on slot "
                         f"{slot}{by} timed out (last seen {seen}); the op's outputs were "
                         "poisoned (NaN)", group=group, slot=slot, expected=-1, seen=seen)


class PeerDied(OverlapError, RuntimeError):
    """A peer of the workspace's group exited or aborted while this rank waited on it."""

    def __init__(self, message: str, *, group: str, peer: int):
        super().__init__(message)
        self.group, self.peer = group, peer


class SymmetricWorkspace(abc.ABC):
    """Same-size buffers on every rank of ``group``, each mapped by every rank, plus signals.

    Ranks are ranks *within the group* (0..world-1). Concurrency contract: the workspace is a
    plain memory window; the ops built on it (they own their workspace) state their own rules,
    typically "one op in flight per workspace". ``close()`` is collective-free and idempotent.
    """

    group: dist.ProcessGroup
    group_name: str
    rank: int
    world: int
    nbytes: int
    num_signals: int
    timeout: float
    device: torch.device

    def __init__(self, group: dist.ProcessGroup, nbytes: int, *, num_signals: int,
                 timeout: float, device: torch.device):
        self.group = group
        self.group_name = group_name(group)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.nbytes = nbytes
        self.num_signals = num_signals
        self.timeout = timeout
        self.device = device

    # -- memory ---------------------------------------------------------------------------
    @abc.abstractmethod
    def buffer(self, r: int) -> torch.Tensor:
        """Rank r's whole data buffer as a uint8 tensor (writable)."""

    def local(self) -> torch.Tensor:
        return self.buffer(self.rank)

    def view(self, r: int, dtype: torch.dtype, shape: Sequence[int], offset: int = 0) -> torch.Tensor:
        """A typed view of rank r's buffer at byte ``offset``; bounds and alignment checked.
        Made once per (r, dtype, shape, offset) and reused (an op asks for the same views on
        every call); ``close`` drops them before the memory goes."""
        key = (r, dtype, *shape, offset)
        views = self.__dict__.setdefault("_views", {})
        view = views.get(key)
        if view is None:
            view = views[key] = self._make_view(r, dtype, shape, offset)
        return view

    def _forget_views(self) -> None:
        self.__dict__.pop("_views", None)

    def _make_view(self, r: int, dtype: torch.dtype, shape: Sequence[int], offset: int
                   ) -> torch.Tensor:
        self._check_rank("view", r)
        itemsize = dtype.itemsize
        numel = 1
        for s in shape:
            numel *= int(s)
        end = offset + numel * itemsize
        if offset < 0 or offset % itemsize:
            raise ValueError(f"SymmetricWorkspace.view: offset {offset} must be a non-negative "
                             f"multiple of {itemsize} (itemsize of {dtype}) (rank {self.rank})")
        if end > self.nbytes:
            raise ValueError(
                f"SymmetricWorkspace.view: {tuple(shape)} {dtype} at offset {offset} needs "
                f"{end} bytes but the workspace of group {self.group_name} has {self.nbytes} "
                f"(rank {self.rank}); create a larger workspace")
        return self.buffer(r)[offset:end].view(dtype).view(tuple(int(s) for s in shape))

    def peer(self, r: int) -> torch.Tensor:
        return self.buffer(r)

    @abc.abstractmethod
    def data_ptr(self, r: int) -> int:
        """Address of rank r's data buffer *in this process* (for kernels taking raw pointers)."""

    @abc.abstractmethod
    def signal_ptr(self, r: int) -> int:
        """Address of rank r's flags[0] in this process; flag s is at signal_ptr(r) + 8*s."""

    def ptr_table(self) -> torch.Tensor:
        """int64 tensor [world] of data addresses, on the workspace device (kernel argument)."""
        return torch.tensor([self.data_ptr(r) for r in range(self.world)], dtype=torch.int64,
                            device=self.device)

    def signal_ptr_table(self) -> torch.Tensor:
        return torch.tensor([self.signal_ptr(r) for r in range(self.world)], dtype=torch.int64,
                            device=self.device)

    # -- signals --------------------------------------------------------------------------
    @abc.abstractmethod
    def signal(self, peer: int, slot: int, value: int) -> None:
        """Release-store ``value`` into ``peer``'s flag ``slot`` (after this rank's prior writes)."""

    @abc.abstractmethod
    def signal_add(self, peer: int, slot: int, value: int = 1) -> None:
        """Atomically add ``value`` to ``peer``'s flag ``slot`` (several producers, one slot)."""

    @abc.abstractmethod
    def wait(self, slot: int, value: int, timeout: float | None = None, *,
             peer: int | None = None) -> None:
        """Wait until this rank's flag ``slot`` >= ``value`` (acquire), or raise SignalTimeout /
        PeerDied within ``timeout`` seconds (default: the workspace's timeout). ``peer``: the
        rank expected to signal the slot, named in the error."""

    # -- poisoned outputs -----------------------------------------------------------------
    # A wait that blocks the host (shared memory) raises at the wait itself, before the op can
    # produce anything. A wait enqueued on a device stream (CUDA) cannot raise: it records the
    # error and returns, and the stream goes on. So every op poisons its outputs (NaN bytes)
    # when the record is set, and the next op on the workspace raises, naming the op, the slot
    # and the peer, without a host sync (the record is mapped host memory).

    # The error record device-side waits write (csrc/signal.cuh ErrorWord), as a host-readable
    # int64 array, in workspaces whose waits do not raise themselves; None in the others.
    _error_np = None
    # Called by a wait's slow path (a wait not satisfied within a slice) on the host twin;
    # may raise to end the wait (overlap.tp.stamps.HeaderBlock.watch). A device-side wait has
    # no host to call it.
    watch = None

    def raise_pending(self, op: str) -> None:
        """Raise the first error a device-side wait recorded, naming ``op``: a read of host
        memory, no sync. The record stays set: the workspace is unusable after it."""
        if self._error_np is None:
            return
        error = recorded_error(op, self.rank, self.group_name, self._error_np)
        if error is not None:
            raise error

    def pending(self) -> bool:
        """True once a device-side wait has recorded an error (a host read, no sync; on a GPU
        it turns True only after the stream has run the wait)."""
        return self._error_np is not None and bool(self._error_np[0])

    def poison_if_error(self, out: torch.Tensor) -> None:
        """Make ``out`` all NaN, in stream order, if a device-side wait has failed."""

    @abc.abstractmethod
    def barrier(self, timeout: float | None = None) -> None:
        """All ranks of the group reach this point; runs over the workspace, not the group."""

    @abc.abstractmethod
    def abort(self, reason: str = "") -> None:
        """Tell every peer to stop waiting: their pending and future waits raise PeerDied."""

    @abc.abstractmethod
    def close(self, *, wait_for_peers: bool = True, timeout: float | None = None) -> None:
        """Free this rank's buffer and unmap the peers'. Idempotent. With ``wait_for_peers``
        (the default) the free waits, at most ``timeout`` (default: the workspace's), until
        every peer has started to close too, so no peer still reads memory that is gone: every
        rank must close the workspace. ``wait_for_peers=False`` (error paths, after ``abort``)
        frees at once."""

    def peer_problem(self) -> PeerDied | None:
        """A PeerDied (not raised) if a peer aborted or its process is gone, else None. Cheap
        and host-only: a watchdog polls it while device-side waits spin."""
        return None

    def __enter__(self) -> "SymmetricWorkspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers for subclasses -----------------------------------------------------------
    _closed: bool = False

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"SymmetricWorkspace.{op}: the workspace of group "
                               f"{self.group_name} is closed (rank {self.rank})")

    def _check_rank(self, op: str, r: int) -> None:
        if not 0 <= r < self.world:
            raise ValueError(f"SymmetricWorkspace.{op}: rank {r} is outside group "
                             f"{self.group_name} of size {self.world} (rank {self.rank})")

    def _check_slot(self, op: str, slot: int) -> None:
        if not 0 <= slot < self.num_signals:
            raise ValueError(f"SymmetricWorkspace.{op}: slot {slot} is outside 0..{self.num_signals - 1} "
                             f"(group {self.group_name}, rank {self.rank}); create the workspace "
                             "with more num_signals")


def group_name(group: dist.ProcessGroup) -> str:
    """A readable name for error messages: the group's ranks."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) > 8:
        return f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)} ranks)"
    return str(ranks)
