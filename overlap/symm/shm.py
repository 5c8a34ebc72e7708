"""CPU backend of SymmetricWorkspace: POSIX shared memory mapped by every local rank.

Each rank creates one segment ``/dev/shm/overlap_<pid>_<seq>_<token>`` (the creator's pid lets a
launcher find and remove the segments of crashed ranks); every rank maps every segment, and once
all mappings exist each rank unlinks its own, so a crash leaks nothing. Signals are int64 words
set and waited on with the acquire/release atomics of ``overlap._C`` (csrc/signal.cpp); waits
run in 50 ms slices with the GIL released, checking between slices that every peer process is
alive and that nobody called ``abort()``. A wait raises where it gives up (SignalTimeout /
PeerDied); with ``OVERLAP_SHM_DEVICE_WAITS=1`` it records the error and returns instead, like the
CUDA wait kernel (``poison_if_error``, ``raise_pending``).

The narrative: docs/design/dist.md.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import socket
import time

import torch
import torch.distributed as dist

from overlap import _C
from overlap.profile.timers import comm_wait
from overlap.dist.host import boot_id, pid_alive
from overlap.dist.stamp import Disagreement
from overlap.symm.base import PeerDied, SignalTimeout, SymmetricWorkspace

__all__ = ["ShmWorkspace"]

_MAGIC = 0x4F564C5053484D31  # "OVLPSHM1"
# Header words (int64): magic, pid, abort (0, or 1 + aborting rank), barrier counter, closed
# (1 once the rank closed its workspace cleanly: gone, but not dead), closing (1 once the rank
# has started to close: it reads no peer buffer any more), then the rank's own abort reason
# (UTF-8, NUL-padded) that peers read when it aborts them.
_W_MAGIC, _W_PID, _W_ABORT, _W_BARRIER, _W_CLOSED, _W_CLOSING = 0, 1, 2, 3, 4, 5
_REASON_OFF, _REASON_BYTES = 48, 80
# What a freed buffer holds in the twin: memory handed back may be reused at once on a GPU, so a
# peer that still read it would see garbage; here it sees this byte.
POISON = 0xA5
_HEADER_BYTES = 128
_PAGE = 4096
_SLICE_S = 0.05
_seq = itertools.count()


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class ShmWorkspace(SymmetricWorkspace):
    """SymmetricWorkspace over POSIX shared memory (all ranks of the group on one host)."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, *, num_signals: int, timeout: float):
        super().__init__(group, nbytes, num_signals=num_signals, timeout=timeout,
                         device=torch.device("cpu"))
        self._flags_off = _HEADER_BYTES
        self._data_off = _align(_HEADER_BYTES + 8 * num_signals, _PAGE)
        self._seg_bytes = self._data_off + _align(nbytes, _PAGE)
        self._maps: list[mmap.mmap] = []
        self._whole: list[torch.Tensor] = []
        self._barrier_phase = 0
        self._closed = False
        self._name = f"overlap_{os.getpid()}_{next(_seq)}_{secrets.token_hex(4)}"
        self.device_waits = os.environ.get("OVERLAP_SHM_DEVICE_WAITS", "") == "1"
        self._error = torch.zeros(_C.ERROR_WORDS, dtype=torch.int64)
        self._error_np = self._error.numpy()  # host reads without a (counted) tensor sync
        self._pids: list[int] = []
        try:
            self._setup()
        except BaseException:
            self.close(wait_for_peers=False)
            raise

    # -- creation -------------------------------------------------------------------------
    def _setup(self) -> None:
        error = None
        try:
            fd = os.open(f"/dev/shm/{self._name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, self._seg_bytes)
                own = mmap.mmap(fd, self._seg_bytes)
            finally:
                os.close(fd)
            own[:_HEADER_BYTES] = bytes(_HEADER_BYTES)
            self._maps_own = own
        except OSError as exc:
            error = f"could not create a {self._seg_bytes}-byte shared-memory segment: {exc}"
        info = dict(name=self._name, pid=os.getpid(), nbytes=self.nbytes,
                    num_signals=self.num_signals, host=socket.gethostname(), boot=boot_id(),
                    error=error)
        infos: list[dict] = [None] * self.world  # type: ignore[list-item]
        dist.all_gather_object(infos, info, group=self.group)
        self._validate(infos)
        self._pids = [i["pid"] for i in infos]

        error = None
        try:
            for r, i in enumerate(infos):
                if r == self.rank:
                    mm = self._maps_own
                else:
                    fd = os.open(f"/dev/shm/{i['name']}", os.O_RDWR)
                    try:
                        mm = mmap.mmap(fd, self._seg_bytes)
                    finally:
                        os.close(fd)
                self._maps.append(mm)
                self._whole.append(torch.frombuffer(mm, dtype=torch.uint8))
        except OSError as exc:
            error = f"could not map a peer's segment: {exc}"
        errors: list = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        # Every rank has mapped every segment (or failed): the names are no longer needed.
        self._unlink_own()
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            raise RuntimeError(f"SymmetricWorkspace(shm) on group {self.group_name}: " +
                               "; ".join(f"rank {r}: {e}" for r, e in bad))
        header = self._whole[self.rank][:_HEADER_BYTES].view(torch.int64)
        header[_W_PID] = os.getpid()
        header[_W_MAGIC] = _MAGIC
        self._data = [w[self._data_off:self._data_off + self.nbytes] for w in self._whole]
        self._base = [w.data_ptr() for w in self._whole]

    def _validate(self, infos: list[dict]) -> None:
        where = f"SymmetricWorkspace(shm) on group {self.group_name} (rank {self.rank})"
        errs = [f"rank {r}: {i['error']}" for r, i in enumerate(infos) if i["error"]]
        if errs:
            raise RuntimeError(f"{where}: " + "; ".join(errs))
        for key in ("nbytes", "num_signals"):
            vals = [i[key] for i in infos]
            if len(set(vals)) > 1:
                raise ValueError(f"{where}: ranks disagree on {key}: " +
                                 ", ".join(f"rank {r}={v}" for r, v in enumerate(vals)) +
                                 "; every rank must pass the same value")
        hosts = {(i["host"], i["boot"]) for i in infos}
        if len(hosts) > 1:
            where_is = ", ".join(f"rank {r}={i['host']}" for r, i in enumerate(infos))
            raise ValueError(f"{where}: the shm backend needs every rank on one host; ranks are "
                             f"on {where_is}. Use the cuda backend or a chunked (collective) "
                             "backend across hosts")

    def _unlink_own(self) -> None:
        try:
            os.unlink(f"/dev/shm/{self._name}")
        except FileNotFoundError:
            pass

    # -- memory ---------------------------------------------------------------------------
    def buffer(self, r: int) -> torch.Tensor:
        self._check_open("buffer")
        self._check_rank("buffer", r)
        return self._data[r]

    def data_ptr(self, r: int) -> int:
        self._check_open("data_ptr")
        self._check_rank("data_ptr", r)
        return self._base[r] + self._data_off

    def signal_ptr(self, r: int) -> int:
        self._check_open("signal_ptr")
        self._check_rank("signal_ptr", r)
        return self._base[r] + self._flags_off

    def _word(self, r: int, w: int) -> int:
        return self._base[r] + 8 * w

    # -- signals --------------------------------------------------------------------------
    def signal(self, peer: int, slot: int, value: int) -> None:
        self._check_open("signal")
        self._check_slot("signal", slot)
        _C.signal_store(self.signal_ptr(peer) + 8 * slot, value)

    def signal_add(self, peer: int, slot: int, value: int = 1) -> None:
        self._check_open("signal_add")
        self._check_slot("signal_add", slot)
        _C.signal_add(self.signal_ptr(peer) + 8 * slot, value)

    def read_signal(self, slot: int, r: int | None = None) -> int:
        """Current value of rank r's (default: own) flag ``slot``."""
        self._check_slot("read_signal", slot)
        return _C.signal_load(self.signal_ptr(self.rank if r is None else r) + 8 * slot)

    def wait(self, slot: int, value: int, timeout: float | None = None, *,
             peer: int | None = None) -> None:
        self._check_open("wait")
        self._check_slot("wait", slot)
        what = f"slot {slot}" if peer is None else f"slot {slot} (signalled by rank {peer})"
        if self.device_waits and self._error_np[0]:
            return  # an earlier wait gave up: as the CUDA kernel, do not wait again
        with comm_wait("symm.wait"):
            try:
                self._wait_addr(self.signal_ptr(self.rank) + 8 * slot, value, timeout, what,
                                slot)
            except (SignalTimeout, PeerDied) as exc:
                if not self.device_waits:
                    raise
                self._record(exc, slot, -1 if peer is None else peer)
            except Disagreement:  # from ``watch``: a peer's stamp of this call differs
                if not self.device_waits:
                    raise
                # The device wait gives up as on a timeout; the op's own comparison of the
                # stamps raises before the call returns, with both signatures.
                self._record(SignalTimeout("stamps disagree", group=self.group_name, slot=slot,
                                           expected=value, seen=-1), slot,
                             -1 if peer is None else peer)

    def _record(self, exc: Exception, slot: int, peer: int) -> None:
        """Device-wait mode: write the error record as the CUDA wait kernel does."""
        rec = self._error_np
        if rec[0]:
            return
        if isinstance(exc, PeerDied):
            rec[1:5] = (slot, -1, exc.peer + 1, peer)
            rec[0] = 2
        else:
            rec[1:5] = (slot, exc.seen, 0, peer)
            rec[0] = 1

    def poison_if_error(self, out: torch.Tensor) -> None:
        if not out.is_contiguous():
            raise ValueError("ShmWorkspace.poison_if_error: the output must be contiguous")
        _C.poison_if_error(self._error.data_ptr(), out.data_ptr(),
                           out.numel() * out.element_size())

    def _wait_addr(self, addr: int, value: int, timeout: float | None, what: str,
                   slot: int) -> None:
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            reached, seen = _C.signal_wait(addr, value, max(0.0, min(_SLICE_S, remaining)))
            if reached:
                return
            if self.watch is not None:  # first: a peer that disagreed may have aborted since
                self.watch()
            self._check_peers(what)
            if time.monotonic() >= deadline:
                raise SignalTimeout(
                    f"SymmetricWorkspace.wait: {what} of rank {self.rank} in group "
                    f"{self.group_name} did not reach {value} within {limit:g}s "
                    f"(last seen {seen}); a peer is slow, stuck or out of step",
                    group=self.group_name, slot=slot, expected=value, seen=seen)

    def _check_peers(self, what: str) -> None:
        problem = self.peer_problem(what)
        if problem is not None:
            raise problem

    def peer_problem(self, what: str = "watchdog") -> PeerDied | None:
        if self._closed:
            return None
        aborted = _C.signal_load(self._word(self.rank, _W_ABORT))
        if aborted:
            peer = aborted - 1
            reason = self._reason(peer)
            return PeerDied(f"SymmetricWorkspace.wait ({what}, rank {self.rank}, group "
                            f"{self.group_name}): rank {peer} aborted"
                            + (f": {reason}" if reason else ""), group=self.group_name,
                            peer=peer)
        # A peer that died is the cause; one that closed cleanly and left comes second (it
        # may have finished after seeing the death itself).
        gone = [r for r, pid in enumerate(self._pids) if r != self.rank and not pid_alive(pid)]
        dead = [r for r in gone if not _C.signal_load(self._word(r, _W_CLOSED))]
        for r in dead or gone:
            how = "has exited" if r in dead else "closed its workspace and exited"
            return PeerDied(f"SymmetricWorkspace.wait ({what}, rank {self.rank}, group "
                            f"{self.group_name}): peer rank {r} (pid {self._pids[r]}) {how}",
                            group=self.group_name, peer=r)
        return None

    def _reason(self, r: int) -> str:
        raw = bytes(self._whole[r][_REASON_OFF:_REASON_OFF + _REASON_BYTES].tolist())
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def barrier(self, timeout: float | None = None) -> None:
        self._check_open("barrier")
        self._barrier_phase += 1
        for r in range(self.world):
            _C.signal_add(self._word(r, _W_BARRIER), 1)
        with comm_wait("symm.barrier"):
            self._wait_addr(self._word(self.rank, _W_BARRIER), self._barrier_phase * self.world,
                            timeout, "barrier", -1)

    def _closing_barrier(self, timeout: float) -> None:
        """Free only once every peer has started to close too (so reads no buffer of ours any
        more) or has died. Abort flags do not end the wait: a peer that was aborted may still
        be reading our buffer for an earlier, successful call. Bounded by ``timeout``."""
        _C.signal_store(self._word(self.rank, _W_CLOSING), 1)
        deadline = time.monotonic() + timeout
        waiting = [r for r in range(self.world) if r != self.rank]
        with comm_wait("symm.close"):
            while waiting and time.monotonic() < deadline:
                waiting = [r for r in waiting if not _C.signal_load(self._word(r, _W_CLOSING))
                           and pid_alive(self._pids[r])]
                if waiting:
                    time.sleep(0.002)

    def abort(self, reason: str = "") -> None:
        if self._closed:
            return
        # The reason first (peers read it after they see the abort word's release store).
        text = reason.encode("utf-8")[:_REASON_BYTES - 1]
        own = self._whole[self.rank]
        own[_REASON_OFF:_REASON_OFF + _REASON_BYTES] = torch.tensor(
            list(text) + [0] * (_REASON_BYTES - len(text)), dtype=torch.uint8)
        for r in range(self.world):
            _C.signal_store(self._word(r, _W_ABORT), self.rank + 1)

    # -- teardown -------------------------------------------------------------------------
    def close(self, *, wait_for_peers: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            return
        if self._whole and wait_for_peers and self.world > 1 and self._pids:
            self._closing_barrier(self.timeout if timeout is None else timeout)
        if self._whole:  # peers that still map us see a clean exit, not a death
            _C.signal_store(self._word(self.rank, _W_CLOSED), 1)
            # Freed memory may be reused at once on a GPU: the twin makes that visible.
            self._data[self.rank].fill_(POISON)
        self._closed = True
        self._forget_views()
        self._unlink_own()
        self._data, self._whole, self._base = [], [], []
        own = getattr(self, "_maps_own", None)
        self._maps_own = None
        for mm in self._maps or ([own] if own is not None else []):
            try:
                mm.close()
            except BufferError:
                # A caller still holds a view: the mapping is freed with its last view.
                pass
        self._maps = []

    def __del__(self) -> None:
        try:
            self.close(wait_for_peers=False)  # a destructor must not block on peers
        except Exception:
            pass
