"""Contexts of the workspace backends ("symmetric", "triton"): who owns the userbuffers.

A :class:`TPContext` owns, for one fused op over one TP group, a SymmetricWorkspace, the phase
counter that orders its signals, and (symmetric backend) the copier (overlap.tp.copier).

Concurrency contract: **one op in flight per context.** Every rank of the group must call the
ops of a context in the same order (each call takes the next phase). Back-to-back calls are
safe: the workspace is double-buffered by phase parity. A call whose shapes need more bytes than
its context has raises ValueError before touching the workspace. On any error inside an op the
comm fails, and with it every context: ``fail`` aborts the workspace (peers waiting on this
rank raise PeerDied) and closes it. A TPComm keeps one context per op and shape.
The narrative: docs/design/tp.md.
"""

from __future__ import annotations

import itertools
import threading
import warnings

import torch
import torch.distributed as dist

from overlap.defaults import TIMEOUT_S
from overlap.dist.communicator import Communicator
from overlap.dist.streams import StreamStillRunning
from overlap.symm.workspace import PeerDied, SignalTimeout, create_workspace, group_name
from overlap.tp.copier import Copier

__all__ = ["TPContext"]

_ids = itertools.count()
# (workspace, copier) of contexts closed while their copy worker was still running: kept
# mapped for the life of the process, since that worker may still touch them.
_KEPT: list[tuple] = []


class TPContext(Communicator):
    """Workspace, phase counter and copier of one fused op over one group. See module doc.
    Its failure and close are the Communicator's; ``_abort_peers`` and ``_release`` are its
    own."""

    def __init__(self, *, op: str, backend: str, group: dist.ProcessGroup, nbytes: int,
                 num_signals: int, device: torch.device, timeout: float = TIMEOUT_S):
        super().__init__(group, timeout=timeout)
        self.op = op
        self.backend = backend
        self.device = device
        self.phase = 0
        # slot -> value every peer must reach before our buffers may be released (AG readers).
        self.quiesce: dict[int, int] = {}
        self.scratch: dict = {}  # an op's small buffers kept between calls (defaults.kept)
        self.ws = create_workspace(group, nbytes, num_signals=num_signals, device=device,
                                   timeout=timeout)
        self.copier = None
        if backend == "symmetric":
            self.copier = Copier(device, f"overlap-copier-{op}-{next(_ids)}", timeout)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"phase {self.phase}"
        return (f"TPContext({self.op}, {self.backend}, group {group_name(self.group)}, "
                f"{self.ws.nbytes if not self.closed else 0} bytes, {state})")

    def next_phase(self) -> int:
        if self.closed:
            raise RuntimeError(f"{self.op}: the context {self!r} is closed (rank {self.rank}); "
                               "create a new one")
        self.phase += 1
        return self.phase

    def require(self, op: str, nbytes: int, what: str) -> None:
        """ValueError if this call needs more workspace than the context has."""
        if op != self.op:
            raise ValueError(f"{op}: context= was made for {self.op}, not {op} (rank "
                             f"{self.rank})")
        if nbytes > self.ws.nbytes:
            raise ValueError(f"{op}: {what} needs a workspace of {nbytes} bytes per rank but "
                             f"the context's workspace has {self.ws.nbytes} (rank {self.rank} "
                             f"of group {group_name(self.group)}); make the context with "
                             f"nbytes >= {nbytes}")

    def _place(self) -> str:
        return f"rank {self.rank} of group {group_name(self.group)}"

    def _abort_peers(self, exc: BaseException) -> None:
        """The op (or its communicator) failed: wake the peers with the reason, then release
        everything once they have let go of this rank's buffers (a peer may still be reading
        it for an earlier, successful call; the wait is bounded and ends at once for dead
        peers)."""
        if self.closed:
            return
        try:
            self.ws.abort(f"{self.op} failed on rank {self.rank}: {exc}")
        except Exception:
            pass
        # The error goes to the caller now; the free waits for the peers on a thread of its own.
        threading.Thread(target=self.close, kwargs={"wait_for_peers": True}, daemon=True,
                         name=f"overlap-deferred-free-{self.op}").start()

    def _release(self, wait_for_peers: bool) -> None:
        """Free the workspace and stop the copier. With ``wait_for_peers`` the workspace is
        freed only once every peer has closed it too (at most min(5 s, timeout)): every rank
        closes a context, as every rank created it. Error paths pass False."""
        self.scratch.clear()
        free = True
        try:
            if self.copier is not None:
                try:
                    self.copier.close()
                except StreamStillRunning as exc:
                    # The copy worker is still inside a copy (a bounded signal wait that has
                    # not ended): freeing now would change bytes under it, which a GPU's free
                    # would not (it waits for the stream). Keep the workspace for good.
                    free = False
                    _KEPT.append((self.ws, self.copier))
                    warnings.warn(f"{self.op}: rank {self.rank}: the {self.ws.nbytes}-byte "
                                  f"workspace over group {group_name(self.group)} is not "
                                  f"freed: {exc}", RuntimeWarning, stacklevel=2)
                    return
            if wait_for_peers:
                limit = min(5.0, self.timeout)
                for slot, value in self.quiesce.items():
                    _host_wait(self.ws, slot, value, limit)
        except (SignalTimeout, PeerDied, TimeoutError):
            pass  # peers are gone or out of step: nobody will read our memory any more
        finally:
            if free:
                self.ws.close(wait_for_peers=wait_for_peers, timeout=min(5.0, self.timeout))

    def __del__(self) -> None:
        # A forgotten explicit context must not leave its copy thread running.
        try:
            self.close(wait_for_peers=False)
        except Exception:
            pass


def _host_wait(ws, slot: int, value: int, timeout: float) -> None:
    if ws.device.type == "cuda":
        ws.wait(slot, value, timeout, blocking=True)
    else:
        ws.wait(slot, value, timeout)
