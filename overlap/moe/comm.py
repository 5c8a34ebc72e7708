"""EPComm: the expert-parallel communicator of a process group (the MoE layer's ``comm=``).

``backend``: "chunked" (all_to_all pieces; ``chunks`` per exchange, 1 is the sequential
schedule) or "symmetric" (rows written into the owners' userbuffers, overlap.moe.symmetric;
buffers sized for ``max_tokens`` tokens per rank per call; ``kernel`` "torch" or "triton"
stores them; call ``close()`` on every rank).
``dispatch``: "same", "bf16" or "int8" (blockwise, ``quant_block`` values per scale) on the wire
for the forward dispatch only; the combine and every gradient travel in the activation dtype.
``all_to_all(x, out_splits, in_splits)`` (or ``post`` then ``finish``) exchanges rows of ``x``
(split sizes in rows, None for equal splits), posted async and waited at most ``timeout`` s: a
dead or stalled peer becomes a RuntimeError naming the op, the group and the rank.
``check_same(op, **values)`` raises the same ValueError on every rank when ranks disagree on a
setting (one small all-gather on ``device``: the current CUDA device on NCCL, else the CPU).
``stamps`` (overlap.moe.stamps): the per-call agreement every exchange carries; after a
disagreement the communicator stays failed. The narrative: docs/moe.md.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from overlap.defaults import positive_int
from overlap.dist.communicator import CommOptions, Communicator, options_of
from overlap.dist.device import comm_device
from overlap.moe.stamps import DISAGREE, EPStamps
from overlap.profile.timers import comm_wait
from overlap.symm.workspace import PeerDied, SignalTimeout, create_workspace
from overlap.versions import triton_problem
from overlap.tp.collectives import wait

__all__ = ["EPComm", "DISPATCH", "BACKENDS"]

BACKENDS = ("chunked", "symmetric")
# How the symmetric backend stores rows into the peers' buffers: torch ops on the mapped
# buffers, or one Triton kernel (permute + store + signal); "auto": Triton on CUDA devices
# where a supported Triton is installed (overlap.versions), else torch.
KERNELS = ("auto", "torch", "triton")

# What the dispatch puts on the wire: the activations as they are, bf16, or blockwise INT8
# (codes and one fp32 scale per quant_block values; see docs/moe.md for the bound).
DISPATCH = ("same", "bf16", "int8")

_GRACE_S = 2.0  # how long a wait ended by a peer's disagreement still waits for its signal


class EPComm(Communicator):
    """Holds the group, this rank's place in it and the timeout; no state between calls.
    ``options`` (CommOptions): timeout, backend (default "chunked"), device; the keywords,
    when given, override it. A call after a failure raises RuntimeError (not a CommFailed:
    the MoE layer's callers catch that type).

    ``interleaver`` (set by ``overlap.pp.Pipeline(ep_comms=...)``) is told before every
    blocking wait, so another micro-batch's compute can run while this exchange is in flight
    (``pairable``): the chunked backend's exchanges own their buffers; the symmetric one needs
    ``lanes=2``, a workspace for the forward exchanges and one for the backward ones (twice
    the userbuffer memory), so a forward and a backward can be in flight at once."""

    failed_type = RuntimeError
    refused_failed = "{op}: this EPComm failed earlier and cannot be used again: {failure}{where}"
    refused_closed = "{op}: this EPComm is closed{where}"

    def __init__(self, group: dist.ProcessGroup, options: CommOptions | None = None, *,
                 chunks: int = 2, dispatch: str = "same", quant_block: int = 128,
                 timeout: float | None = None, backend: str | None = None,
                 max_tokens: int | None = None, kernel: str = "auto", lanes: int = 1,
                 device: torch.device | str | None = None):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"EPComm: group must be a torch.distributed ProcessGroup, got "
                            f"{type(group).__name__}")
        opts = options_of(options, "EPComm", timeout=timeout, backend=backend, device=device)
        timeout, device = opts.timeout, opts.device
        backend = "chunked" if opts.backend is None else opts.backend
        positive_int(chunks, "EPComm: chunks")
        positive_int(quant_block, "EPComm: quant_block")
        if dispatch not in DISPATCH:
            raise ValueError(f"EPComm: dispatch must be one of {DISPATCH}, got {dispatch!r}")
        if backend not in BACKENDS:
            raise ValueError(f"EPComm: backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "symmetric":
            if max_tokens is None:
                raise ValueError("EPComm: backend='symmetric' needs max_tokens= (tokens per "
                                 "rank per call; its buffers are sized for the worst case)")
            positive_int(max_tokens, "EPComm: max_tokens")
        if kernel not in KERNELS:
            raise ValueError(f"EPComm: kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel != "torch" and (no_triton := triton_problem()):
            if kernel == "triton":
                raise ValueError(f"EPComm: kernel='triton' cannot run here: {no_triton}; the "
                                 "kernels that work here: 'auto' (takes 'torch'), 'torch'")
            kernel = "torch"  # "auto" never picks what cannot run here
        if lanes not in (1, 2):
            raise ValueError(f"EPComm: lanes must be 1 or 2, got {lanes!r}")
        self.backend, self.kernel = backend, kernel
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self.lanes = lanes
        # The symmetric backend's workspaces (made by reserve): lane 0 for the forward
        # exchanges, lane 1 (with lanes=2) for the backward ones; a phase counter each.
        self._lanes: list = [None] * lanes
        self._phases = [0] * lanes
        super().__init__(group, timeout=timeout)
        self.chunks = int(chunks)
        self.dispatch, self.quant_block = dispatch, int(quant_block)
        # Where the small tensors of the settings check travel (NCCL takes device tensors only).
        self.device = torch.device(device) if device is not None else comm_device(group)
        self.interleaver = None
        self.layers = 0  # layers built on this communicator: their identity in the stamps
        self.stamps = EPStamps(self)

    def new_layer(self) -> int:
        """The next layer's index on this communicator (every rank builds its layers in the
        same order: the index is what the stamps name the layer by)."""
        self.layers += 1
        return self.layers - 1

    @property
    def pairable(self) -> bool:
        """Two exchanges may be in flight at once (another micro-batch's between post and
        wait): each chunked exchange owns its buffers; the symmetric ones share one workspace."""
        return self.backend == "chunked" or self.lanes == 2

    def _switch(self) -> None:
        if self.interleaver is not None:
            self.interleaver.switch()

    def __repr__(self) -> str:
        return (f"EPComm(rank {self.rank}/{self.world}, {self.backend}, chunks={self.chunks}, "
                f"dispatch={self.dispatch!r}, timeout={self.timeout:g}s)")

    # -- the symmetric backend's workspace
    def reserve(self, nbytes: int, device) -> None:
        """Make the workspace hold at least ``nbytes`` per rank (collective: every rank
        reserves in the same order, as it builds the same layers)."""
        if self._lanes[0] is not None and self._lanes[0].nbytes >= nbytes:
            return
        for lane, ws in enumerate(self._lanes):
            if ws is not None:
                ws.close()
            self._lanes[lane] = create_workspace(self.group, nbytes, num_signals=2 * self.world,
                                                 device=device, timeout=self.timeout)
            self._phases[lane] = 0

    def lane_of(self, backward: bool) -> int:
        """The workspace lane of an exchange: the backward ones get their own with lanes=2."""
        return int(backward and self.lanes == 2)

    # -- the failure rule (overlap.dist.communicator): EP's text, abort and release
    def _place(self) -> str:
        return f"rank {self.global_rank}"

    def _failure_text(self, exc: BaseException, op: str) -> str:
        """The reason the peers' aborted waits report (the abort reason holds 80 bytes): a
        wait's short cause, else the op and the error's type."""
        short = getattr(exc, "short", None)
        if short or not op:
            return short or f"{exc}"
        return f"{op} failed on EP rank {self.rank}: {type(exc).__name__}"

    def _abort_peers(self, exc: BaseException) -> None:
        for ws in self._lanes:
            if ws is None:
                continue
            try:
                ws.abort(self.failure)
            except Exception:
                pass
            # Freed once the peers let go of this rank's buffer (bounded), off the caller's
            # path.
            threading.Thread(target=ws.close, kwargs={"timeout": min(5.0, self.timeout)},
                             daemon=True, name="overlap-ep-deferred-free").start()

    def _release(self, wait_for_peers: bool) -> None:
        """Free the symmetric workspaces (every rank closes them, as every rank made them); a
        failed communicator's are freed by ``_abort_peers``."""
        lanes, self._lanes = self._lanes, [None] * self.lanes
        for ws in lanes:
            if ws is not None and self.failure is None:
                ws.close(timeout=min(5.0, self.timeout))

    def workspace(self, op: str, lane: int = 0):
        self.check_usable(op)
        if self._lanes[lane] is None:
            raise RuntimeError(f"{op}: the EPComm has no workspace (closed, or no layer "
                               f"reserved one) (rank {self.global_rank})")
        return self._lanes[lane]

    def next_phase(self, op: str, lane: int = 0) -> int:
        self._phases[lane] += 1
        return self._phases[lane]

    def wait_signal(self, ws, slot: int, value: int, peer: int, what: str) -> None:
        try:
            with comm_wait("ep.signal"):  # an EP wait in the exposed-time accounting
                ws.wait(slot, value, self.timeout, peer=peer)
        except (SignalTimeout, PeerDied) as exc:
            if isinstance(exc, PeerDied) and DISAGREE in str(exc) and _grace(ws, slot, value):
                return  # the signal came after all: this rank compares the stamps itself
            # The peers learn the cause from the abort reason, which holds 80 bytes.
            if isinstance(exc, SignalTimeout):
                short = f"no signal from EP rank {peer} within {self.timeout:g}s"
            elif " aborted: " in str(exc):
                short = str(exc).split(" aborted: ", 1)[1]
            else:
                short = f"EP rank {exc.peer} has exited"
            error = RuntimeError(f"{what}: {exc} (rank {self.global_rank}, EP group of "
                                 f"{self.world})")
            error.short = short
            raise error from exc

    def __del__(self) -> None:
        try:
            lanes, self._lanes = self._lanes, [None] * self.lanes
            for ws in lanes:
                if ws is not None:
                    ws.close(wait_for_peers=False)
        except Exception:
            pass

    def all_to_all(self, x: torch.Tensor, out_splits: list[int] | None,
                   in_splits: list[int] | None, *, op: str = "all_to_all") -> torch.Tensor:
        return self.finish(self.post(x, out_splits, in_splits, op=op))

    def post(self, x: torch.Tensor, out_splits: list[int] | None,
             in_splits: list[int] | None, *, op: str = "all_to_all") -> "_Posted":
        """Start the exchange; ``finish`` waits for it and returns the received rows. ``x``
        and the output stay referenced until then (a GPU may still be reading them)."""
        self.check_usable(op)
        rows = sum(out_splits) if out_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        if self.world == 1:
            return _Posted(out.copy_(x), x, None, op)
        x = x.contiguous()
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group,
                                      async_op=True)
        return _Posted(out, x, work, op)

    def finish(self, posted: "_Posted", *, switch: bool = True) -> torch.Tensor:
        """Wait for a posted exchange. ``switch``: let the other action of a pipeline pair run
        first (a fixed choice of the caller, never a test of whether the work is done: every
        EP rank must switch at the same waits)."""
        if posted.work is not None:
            if switch:
                self._switch()
            wait(posted.work, op=posted.op, group=self.group, timeout=self.timeout, axis="ep")
        return posted.out

    def all_gather_ints(self, value: torch.Tensor, *, op: str) -> list[int]:
        """Every rank's scalar ``value``, by EP rank (one small all-gather and a host read)."""
        return [int(t) for t in self._gather(value.reshape(1).to(torch.int64), op)]

    def _gather(self, mine: torch.Tensor, op: str) -> torch.Tensor:
        """Every rank's small ``mine``, stacked by EP rank (waited within the timeout)."""
        every = [torch.empty_like(mine) for _ in range(self.world)]
        work = dist.all_gather(every, mine, group=self.group, async_op=True)
        self._switch()
        wait(work, op=op, group=self.group, timeout=self.timeout, axis="ep")
        return torch.stack(every)

    def check_same(self, op: str, **values: float) -> None:
        """Every rank passed the same ``values`` (numbers), or a ValueError on every rank that
        names each differing argument and what every rank passed."""
        if self.world == 1:
            return
        mine = torch.tensor([float(v) for v in values.values()], dtype=torch.float64,
                            device=self.device)
        table = self._gather(mine, f"{op} settings")
        differ = [name for i, name in enumerate(values) if (table[:, i] != table[0, i]).any()]
        if differ:
            listed = "; ".join(f"{name}: {[_num(v) for v in table[:, values_index].tolist()]}"
                               for values_index, name in enumerate(values) if name in differ)
            raise ValueError(f"{op}: the EP ranks disagree on {', '.join(differ)} (by EP rank: "
                             f"{listed}) (rank {self.global_rank})")


class _Posted(NamedTuple):
    out: torch.Tensor
    source: torch.Tensor
    work: object
    op: str


def _grace(ws, slot: int, value: int) -> bool:
    """A peer aborted on a disagreement while this rank waited for a signal that every rank
    sends before it compares anything: wait for it a little longer (host waits only), so
    this rank raises the Disagreement with both signatures, not the peer's short reason."""
    read = getattr(ws, "read_signal", None)
    deadline = time.monotonic() + _GRACE_S
    while read is not None and time.monotonic() < deadline:
        if read(slot) >= value:
            return True
        time.sleep(0.001)
    return False


def _num(v: float):
    return int(v) if float(v).is_integer() else v
