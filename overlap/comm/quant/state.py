"""What the quantized collectives keep per process group, and the rule that a failure stays one.

A ``GroupState`` holds, for one ``ProcessGroup`` object, the wire scratch buffers, the last
async op (issue order, see ``work``) and the first error seen on the group. It is keyed weakly
by the group object, so it dies with the group; a re-created group starts afresh.

Failure rule: any error in a quantized op on a group, on any rank, local or remote, fails the
group's state; every later quantized call on it raises ``QuantCommFailed`` ("communicator
failed earlier: <first error>") and never returns numbers. Build a new group to continue.
A failing rank publishes its error in the job's TCPStore; a rank waiting in a collective checks
every 50 ms for a published failure or an exited same-host peer and raises naming that peer.
The narrative: docs/design/quantized.md.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from overlap.dist.communicator import CommFailed, Communicator
from overlap.dist.device import plain_gloo
from overlap.dist.host import host_id, pid_alive
from overlap.dist.stamp import Disagreement
from overlap.errors import OverlapError

__all__ = ["QuantCommError", "QuantTimeout", "QuantCommFailed", "GroupState", "state_for",
           "existing_state"]

_PREFIX = "overlap.comm.quant"


class QuantCommError(OverlapError, RuntimeError):
    """A quantized collective failed. ``op``, ``group`` (name), ``rank`` (group rank),
    ``peer`` (group rank of the peer at fault, when known) and ``kind``: "died" (a peer
    exited), "timeout", "peer_failed" (a peer published an error), "transport" (the backend
    raised) or "failed" (the group had failed earlier, or its state was closed)."""

    def __init__(self, message: str, *, op: str, group: str, rank: int, peer: int | None = None,
                 kind: str = "transport"):
        super().__init__(message)
        self.op, self.group, self.rank, self.peer, self.kind = op, group, rank, peer, kind


class QuantTimeout(QuantCommError, TimeoutError):
    """A wait of a quantized collective did not complete within its ``timeout``."""


class QuantCommFailed(QuantCommError, CommFailed):
    """A call on a group whose quantized collectives failed earlier (message carries the first
    error)."""


def _group_name(group: Any) -> str | None:
    try:
        return str(group.group_name)
    except Exception:  # noqa: BLE001 - a backend object outside torch's registry has none
        return None


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group: failures are not shared, only local
        return None


class GroupState(Communicator):
    """Scratch buffers, issue order and failure of the quantized collectives on one group.
    The failure rule is the Communicator's (``guard``, ``fail``, ``check_usable``); the
    messages read "<op>: <place>: ..." (``place``).

    Concurrency: the ops of one group run one at a time (``work`` orders them), so the scratch
    is never shared by two ops; ``lock`` guards ``tail`` and the scratch, which the caller's
    thread and async workers both touch."""

    failed_type = QuantCommFailed
    holds_group = False  # keyed weakly by the group (state_for): the state dies with it

    def __init__(self, group: Any):
        super().__init__(group)
        self.name = _group_name(group) or f"<unnamed, global ranks {self.global_ranks}>"
        self.lock = threading.Lock()
        self.agree: Any = None  # the group's per-call stamps (``stamps.agreement``)
        self.tail: Any = None  # the last async op submitted, until it completes
        self.stream_: Any = None  # the group's communication stream (overlap.dist.streams)
        self._scratch: dict[tuple[str, str], torch.Tensor] = {}
        self._pids: dict[int, int] = {}
        self._store = _default_store() if _group_name(group) is not None else None
        self._key = f"{_PREFIX}/{self.name}"
        self._host = host_id()
        self._store_call(lambda s: s.set(f"{self._key}/pid/{self.rank}",
                                          f"{self._host}|{os.getpid()}"))
        # Plain gloo aborts the process that receives a message larger than it posted (an
        # error on its transport thread): every call there agrees its stamps alone first.
        self.plain_gloo = plain_gloo(group)
        self.joined = self._store is None or self.world == 1  # see first_op()
        self._arrived = False

    def stream(self, device: torch.device):
        """The group's one communication stream for async ops, created on first use."""
        if self.stream_ is None:
            from overlap.dist.streams import Stream

            self.stream_ = Stream(device, name=f"quant {self.name}")
        return self.stream_

    def __del__(self) -> None:
        stream = getattr(self, "stream_", None)
        if stream is not None:
            try:
                stream.close()
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass

    # -- failure (the rule: overlap.dist.communicator)

    def _place(self) -> str:
        return f"rank {self.rank} of group {self.name!r} (global ranks {self.global_ranks})"

    def _refused(self, op: str) -> QuantCommFailed:
        said = (f"communicator failed earlier: {self.failure}" if self.failure is not None
                else "the group's quantized state was closed")
        return QuantCommFailed(f"{op}: {self.place}: {said}", op=op, group=self.name,
                               rank=self.rank, kind="failed")

    def _abort_peers(self, error: BaseException) -> None:
        """Drop the scratch (an abandoned collective may still write into it; later ops must
        never see it) and publish the failure for the peers, unless it is theirs."""
        with self.lock:
            self._scratch = {}
        kind = (error.kind if isinstance(error, QuantCommError) else
                "disagreement" if isinstance(error, Disagreement) else "error")
        if kind in ("peer_failed", "failed"):
            return
        text = self.failure
        self._store_call(lambda s: s.set(f"{self._key}/failed/{self.rank}", f"{kind}|{text}"))

    def _release(self, wait_for_peers: bool) -> None:
        with self.lock:
            self._scratch = {}
        stream, self.stream_ = self.stream_, None
        if stream is not None:
            stream.close()

    def peer_failures(self) -> list[tuple[int, str, str]]:
        """(group rank, kind, error) of every peer that published a failure. Kind "error" is a
        failure of that peer's own (bad input, a kernel error); "disagreement" is that peer
        finding the ranks' calls differ (every rank of the call is at fault alike); "died",
        "timeout" and
        "transport" mean that peer saw someone else fail: it is not the culprit."""
        found = []
        for r in range(self.world):
            key = f"{self._key}/failed/{r}"
            if r != self.rank and self._store_call(lambda s: s.check([key])):
                raw = self._store_call(lambda s: s.get(key))
                if raw is not None:
                    kind, _, msg = raw.decode(errors="replace").partition("|")
                    found.append((r, kind, msg))
        return found

    def first_op(self, *, give_up: bool = False) -> str | None:
        """The group's decision on its first collective, taken once by the store for every
        rank (``work.OpRun._join``): "go" once every rank has arrived at its own first one (the
        last to arrive sets it), "abort" once a rank gave up first; None while undecided. This
        rank arrives at its first call; ``give_up`` proposes "abort" (it wins only if still
        undecided)."""
        state = f"{self._key}/first/state"
        if not self._arrived:
            self._arrived = True
            if self._store_call(lambda s: s.add(f"{self._key}/first/count", 1)) == self.world:
                self._store_call(lambda s: s.compare_set(state, "", "go"))
        if give_up:
            got = self._store_call(lambda s: s.compare_set(state, "", "abort"))
        elif self._store_call(lambda s: s.check([state])):
            got = self._store_call(lambda s: s.get(state))
        else:
            return None
        return got.decode() if isinstance(got, bytes) else got

    def absent_peers(self) -> list[int]:
        """Group ranks that have never called a quantized op on this group (no pid yet)."""
        return [r for r in range(self.world) if r != self.rank and self._store_call(
            lambda s, r=r: s.check([f"{self._key}/pid/{r}"])) is False]

    def dead_peers(self) -> list[tuple[int, int]]:
        """(group rank, pid) of every peer on this host whose process has exited."""
        dead = []
        for r in range(self.world):
            if r == self.rank:
                continue
            if r not in self._pids:
                key = f"{self._key}/pid/{r}"
                if not self._store_call(lambda s: s.check([key])):
                    continue
                raw = self._store_call(lambda s: s.get(key))
                host, _, pid = (raw or b"").decode(errors="replace").rpartition("|")
                # Another host's pid says nothing here: mark it unknown (0) for good.
                self._pids[r] = int(pid) if host == self._host and pid.isdigit() else 0
            pid = self._pids[r]
            if pid and not pid_alive(pid):
                dead.append((r, pid))
        return dead

    def _store_call(self, fn):
        if self._store is None:
            return None
        try:
            return fn(self._store)
        except Exception:  # noqa: BLE001 - diagnosis is best effort; the op's own error stands
            return None

    # -- scratch

    def buffer(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """An uninitialised tensor for ``slot`` of this group's scratch, grown when too small.

        Reused across calls: a fresh multi-MB allocation costs a page fault per 4 KB on every
        call, as much as the quantization itself on a CPU."""
        nbytes = 1
        for d in shape:
            nbytes *= d
        nbytes *= torch.empty(0, dtype=dtype).element_size()
        key = (str(device), slot)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype).view(shape)


_states: "weakref.WeakKeyDictionary[Any, GroupState]" = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def state_for(group: Any) -> GroupState:
    """The state of ``group``, created on first use (no collective: one store write)."""
    with _states_lock:
        state = _states.get(group)
        if state is None or state.closed:
            state = _states[group] = GroupState(group)
        return state


def existing_state(group: Any) -> GroupState | None:
    with _states_lock:
        return _states.get(group)
