"""TPComm: the one object that carries a TP group's settings and owns its fused-op state.

    comm = TPComm(dims.tp_group, backend="auto", timeout=60)   # collective: every TP rank
    y = all_gather_matmul(x_shard, w, comm=comm)
    comm.close()                                               # collective; or `with TPComm(...)`

It owns the backend (resolved once, here), ``chunks`` ("auto" by default on CUDA: autochunk),
``check_inputs`` and ``timeout``, the workspaces of the symmetric/triton backends, the per-call
agreement stamps (overlap.tp.stamps) and the failure state: any error inside an op fails the
communicator, and every later call on every rank raises ``TPCommFailed`` with the first error.
One op in flight per communicator; every rank issues the same ops in the same order. The
functional ops' ``group=`` form uses a default communicator per (group object, backend);
``close_default_comms()`` closes those. The narrative: docs/design/tp.md.
"""

from __future__ import annotations

import collections
import weakref

import torch
import torch.distributed as dist
from overlap.versions import MemberType, OpaqueBase, register_opaque_type, torch_problem

from overlap.defaults import positive_int
from overlap.dist.communicator import CommFailed, CommOptions, Communicator, options_of
from overlap.dist.device import comm_device
from overlap.dist.host import host_id
from overlap.dist.stamp import Agreement
from overlap.symm.workspace import group_name
from overlap.tp import stamps
from overlap.tp.autochunk import AUTO, ChunkRace

__all__ = ["TPComm", "TPCommFailed", "BACKENDS", "MAX_CONTEXTS",
           "default_comm", "owned_comm", "close_default_comms"]

BACKENDS = ("auto", "chunked", "symmetric", "triton", "unfused")
MAX_CONTEXTS = 16
MAX_SIGNATURES = 1024  # validated call signatures remembered (then forgotten and re-checked)


class TPCommFailed(CommFailed):
    """A call on a TP communicator that failed earlier; the message carries the first error."""


class TPComm(Communicator, OpaqueBase):
    """A TP group's fused-op communicator (see the module docstring). Custom ops take it as an
    opaque object (torch.compile passes the object itself; no registry of communicators).
    ``options`` (CommOptions): backend (default "auto"), chunks, timeout, check_inputs, device;
    the keywords, when given, override it."""

    failed_type = TPCommFailed

    def __init__(self, group: dist.ProcessGroup, options: CommOptions | None = None, *,
                 backend: str | None = None, chunks: int | str | None = None,
                 timeout: float | None = None, check_inputs: bool | None = None,
                 device: torch.device | str | None = None):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"TPComm: group must be a torch.distributed ProcessGroup (e.g. "
                            f"dims.tp_group), got {type(group).__name__}")
        opts = options_of(options, "TPComm", backend=backend, chunks=chunks, timeout=timeout,
                          check_inputs=check_inputs, device=device,
                          where=f" (rank {dist.get_rank(group)} of group {group_name(group)})")
        backend = "auto" if opts.backend is None else opts.backend
        chunks, device = opts.chunks, opts.device
        too_old = torch_problem()
        if too_old:
            raise RuntimeError(f"TPComm: {too_old}; no backend runs on it (rank "
                               f"{dist.get_rank(group)})")
        Communicator.__init__(self, group, timeout=opts.timeout)
        at = self.where
        if backend not in BACKENDS:
            raise ValueError(f"TPComm: backend must be one of {BACKENDS}, got {backend!r}{at}")
        if chunks is not None and chunks != AUTO:
            positive_int(chunks, "TPComm: chunks", extra=" or 'auto'", where=at)
        self.device = torch.device(device) if device is not None else comm_device(group)
        if chunks is None:
            # The default: race on a GPU (CUDA events time the device alone); world pieces on
            # the CPU twins, where a race times the OS scheduler of shared cores and measured
            # slower (the main job: 1120 vs 838 ms per step, docs/tp-ops.md).
            chunks = AUTO if self.device.type == "cuda" else self.world
        self.chunks = chunks
        self.check_inputs = bool(opts.check_inputs)
        self.requested_backend = backend
        self.backend = self._resolve(backend, at)
        # A race only where pieces are a choice: more than one rank, a backend that chunks.
        self.auto = (ChunkRace(self) if chunks == AUTO and self.world > 1
                     and self.backend in ("chunked", "symmetric") else None)
        self.default = False  # made by default_comm (the group= form)
        self._contexts: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        # Signatures (op, shapes, dtypes, devices, chunks) whose local checks passed: they are
        # a function of the signature alone, so a call repeats them only for a new one.
        self.validated: set[tuple] = set()
        self.agree: Agreement | None = None
        self.header: stamps.HeaderBlock | None = None
        if self.world > 1:
            self.agree = Agreement(stamps.SCHEMA, rank=self.rank, world=self.world,
                                   device=self.device, where=at)
            if self.backend in ("symmetric", "triton"):
                self.header = stamps.HeaderBlock(group, device=self.device,
                                                 timeout=self.timeout)

    def _resolve(self, backend: str, at: str) -> str:
        from overlap.tp.backends import auto_backend, triton_refusal

        refusal = triton_refusal(at) if backend == "triton" else None
        if refusal:
            raise ValueError(refusal)
        if self.world == 1:
            return "chunked" if backend == "auto" else backend
        # One small collective at construction (which is collective anyway): the ranks must
        # agree on the backend, since each backend exchanges its stamps its own way.
        every: list = [None] * self.world
        dist.all_gather_object(every, (backend, self.chunks, host_id()), group=self.group)
        for field, i in (("backend", 0), ("chunks", 1)):
            values = [e[i] for e in every]
            if len(set(values)) > 1:
                shown = ", ".join(f"rank {r}={v!r}" for r, v in enumerate(values))
                raise ValueError(f"TPComm: ranks disagree on {field}: {shown}{at}; every rank "
                                 f"of the group must pass the same {field}")
        if backend != "auto":
            return backend
        return auto_backend(self.device, len({e[2] for e in every}) == 1, at)

    def __repr__(self) -> str:
        state = ("closed" if self.closed else f"failed: {self.failure}" if self.failure
                 else f"{len(self._contexts)} workspaces")
        return (f"TPComm(group {group_name(self.group)}, rank {self.rank}/{self.world}, "
                f"backend={self.backend!r}, chunks={self.chunks}, timeout={self.timeout:g}s, "
                f"{state})")

    def _place(self) -> str:
        return f"rank {self.rank} of group {group_name(self.group)}"

    # ------------------------------------------------------------------ failure hooks
    def _failure_text(self, exc: BaseException, op: str) -> str:
        return f"{exc}"

    def _refused(self, op: str) -> TPCommFailed:
        if self.closed:
            hint = ("; build a new TPComm" if not self.default else
                    " (close_default_comms); the group= form makes a new one on its next eager "
                    "call, while a torch.compile'd function keeps the one it traced until "
                    "torch._dynamo.reset()")
            return TPCommFailed(f"{op}: the TP communicator was closed{self.where}{hint}")
        return TPCommFailed(f"{op}: communicator failed earlier{self.where}: {self.failure}")

    def _abort_peers(self, exc: BaseException) -> None:
        """Abort every workspace, so peers blocked on this rank raise now (with this reason)
        instead of at their timeout."""
        for context in list(self._contexts.values()):
            context.fail(exc)
        self._contexts.clear()
        if self.header is not None:
            try:
                self.header.abort(f"{exc}")
            except Exception:
                pass

    # ------------------------------------------------------------------ per-op state
    def pick_chunks(self, op: str, requested: int, x: torch.Tensor, w: torch.Tensor):
        """(chunks, race key, timer) for a call: the call's own ``chunks`` (non-zero), else
        the communicator's int, else its race's (``"auto"`` on the backends that chunk,
        overlap.tp.autochunk; world where nothing chunks); key and timer are None unless this
        call is part of a race."""
        if requested:
            return requested, None, None
        if self.auto is not None:
            return self.auto.begin(op, x, w)
        return (self.world if self.chunks == AUTO else self.chunks), None, None

    def remember_valid(self, key: tuple) -> None:
        if len(self.validated) >= MAX_SIGNATURES:
            self.validated.clear()
        self.validated.add(key)

    def first_call(self) -> bool:
        """True before the first op call: the one call every rank reaches in the same state,
        so the full cross-rank check may run there without desynchronising the ranks."""
        return self.agree is None or self.agree.calls == 0

    def stamp(self, op: str, x: torch.Tensor, w: torch.Tensor | None, chunks: int,
              flags: int, timeout: float | None = None) -> None:
        """Count this call and publish its stamp; the workspace backends compare every
        peer's in ``settle`` (the chunked backend compares in its first hop). ``timeout``:
        an explicit context's, which bounds the whole call."""
        if self.agree is None:
            return
        self.agree.next(op, key=(op, x.shape, None if w is None else w.shape, x.dtype, chunks,
                                 flags),
                        make=lambda: stamps.stamp_values(x, w, chunks, flags,
                                                         BACKENDS.index(self.backend)))
        if self.header is not None:
            self.header.publish(op, self.agree, timeout)

    def settle(self) -> None:
        """Wait for every peer's stamp of the open call and compare them (no-op when none is
        open or there is no header block). Called before the call returns, and before it
        blocks on anything a watched workspace wait does not cover (overlap.tp.stamps)."""
        if self.header is not None:
            self.header.settle()

    def find_context(self, key: tuple):
        """The open workspace context for ``key``, or None (nothing collective)."""
        context = self._contexts.get(key)
        if context is not None and not context.closed:
            self._contexts.move_to_end(key)
            return context
        return None

    def context(self, key: tuple, create):
        """The workspace context for ``key``, created (collectively) by ``create()`` once."""
        context = self.find_context(key)
        if context is not None:
            return context
        self.settle()  # creating is collective: a peer on another path must be named first
        context = create()
        if self.header is not None and context.backend == "symmetric":
            context.ws.watch = self.header.watch
        self._contexts[key] = context
        while len(self._contexts) > MAX_CONTEXTS:
            # Every rank evicts the same one (same call sequence), and close() waits until
            # the peers have finished reading this rank's buffers.
            _, old = self._contexts.popitem(last=False)
            old.close()
        return context

    def num_contexts(self) -> int:
        return len(self._contexts)

    # ------------------------------------------------------------------ lifetime
    def _release(self, wait_for_peers: bool) -> None:
        """Free every workspace and stop every copier. Collective: each rank waits (at most
        the timeout, capped at 5 s) until its peers have finished reading its buffers."""
        for context in list(self._contexts.values()):
            context.close(wait_for_peers=wait_for_peers)
        self._contexts.clear()
        if self.header is not None:
            self.header.close(wait_for_peers=wait_for_peers)

    def __deepcopy__(self, memo) -> "TPComm":
        # A handle to live transport state, not a value: a compiled graph that holds the
        # group= form's communicator as a constant is deep-copied by torch.compile's backward.
        return self

    def __del__(self) -> None:
        try:
            for context in list(self._contexts.values()):
                context.close(wait_for_peers=False)
            if self.header is not None:
                self.header.close(wait_for_peers=False)
        except Exception:
            pass


# What torch.compile may read while tracing (constants of a communicator's life).
register_opaque_type(TPComm, typ="reference", members={
    "world": MemberType.USE_REAL, "rank": MemberType.USE_REAL,
    "chunks": MemberType.USE_REAL, "check_inputs": MemberType.USE_REAL,
    "backend": MemberType.USE_REAL, "group": MemberType.USE_REAL})


# ---------------------------------------------------------------------- the group= form

_defaults: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, TPComm]]" = (
    weakref.WeakKeyDictionary())


def default_comm(group, *, backend: str = "auto", op: str = "tp") -> TPComm:
    """The communicator behind ``op(..., group=group, backend=...)``: one per (group object,
    backend), created on first use (collective, like any TPComm). A failed one is replaced
    only by ``close_default_comms()``, so a failure stays a failure."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: group must be a torch.distributed ProcessGroup (pass it "
                        f"explicitly, e.g. dims.tp_group) or pass comm=, got "
                        f"{type(group).__name__}")
    per_group = _defaults.get(group)
    if per_group is None:
        per_group = _defaults[group] = {}
    comm = per_group.get(backend)
    if comm is None or comm.closed:
        comm = per_group[backend] = TPComm(group, backend=backend)
        comm.default = True
    return comm


def owned_comm(group, options: CommOptions) -> TPComm:
    """A new communicator with these settings, registered with the group's default ones so
    that ``close_default_comms()`` closes it too (``ParallelDims.tp_comm``)."""
    comm = TPComm(group, options)
    per_group = _defaults.get(group)
    if per_group is None:
        per_group = _defaults[group] = {}
    per_group[("owned", id(comm))] = comm
    return comm


def close_default_comms() -> None:
    """Close and forget every default communicator (the ``group=`` form's, and those
    ``ParallelDims.tp_comm()`` made) of this process; call it on every rank at teardown.
    Collective-free: each waits at most briefly for its peers. Explicit TPComm objects are
    closed by their owners."""
    for per_group in list(_defaults.values()):
        for comm in list(per_group.values()):
            comm.close()
    _defaults.clear()
