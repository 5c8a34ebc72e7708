"""CPComm: the context-parallel communicator of a process group (the CP attention ops' ``comm=``).

It owns the ring's two channels, each a two-rank communicator carrying one direction (send
to the next CP rank, receive from the previous one), built like the pipeline's
(``overlap.pp.p2p``) so NCCL's one-op-at-a-time order never mixes the directions, and, from
the first all-gather or Ulysses call, a collective communicator of the group's own. Creating
it is collective over the group; ``close()`` releases them. Every wait is bounded by
``timeout`` s and names the op, the peer (or the group) and this rank. After any error the
communicator is failed: every later call raises ``CPCommFailed`` with the first error. One op
in flight per communicator. ``Packet``: a stamp and tensors in one byte message. The
narrative: docs/design/cp.md.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from overlap.versions import (HAVE_OPAQUE, MemberType, OpaqueBase, compile_problem,
                              register_opaque_type)

from overlap.defaults import TIMEOUT_S, positive_seconds
from overlap.dist.device import comm_device
from overlap.dist.stamp import STAMP_WORDS, Agreement, Schema, float_word
from overlap.profile.timers import comm_wait

__all__ = ["CPComm", "CPCommFailed", "SCHEMA", "Packet", "call_scale"]

# The per-call stamp: what every CP rank must pass alike (checked on every call, in the ring's
# first message; the communicator's first call also all-gathers it and names every rank).
SCHEMA = Schema("cp", ("ring_attention", "ring_attention_backward", "allgather_attention",
                      "allgather_attention_backward", "ulysses_attention",
                      "ulysses_attention_backward"),
                (("q shape", 4, "shape"), ("kv shape", 4, "shape"), ("dtype", 1, "dtype"),
                 ("causal", 1, "bool"), ("scale", 1, "float")))

# Channel store prefixes must be equal on both ends and unique per communicator: every rank
# of a group creates its CPComms in the same order, so a count per group of ranks is both.
_made: dict[tuple[int, ...], int] = {}


class CPCommFailed(RuntimeError):
    """A call on a CP communicator that failed earlier; the message carries the first error."""


class CPComm(OpaqueBase):
    """The ring over ``group``: CP rank ``r`` sends to ``(r + 1) % cp`` and receives from
    ``(r - 1) % cp``. Custom ops take it as an opaque object (no registry of communicators)."""

    def __init__(self, group: dist.ProcessGroup, *, timeout: float = TIMEOUT_S,
                 device: torch.device | str | None = None, token: str = ""):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"CPComm: group must be a torch.distributed ProcessGroup (e.g. "
                            f"dims.cp_group), got {type(group).__name__}")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.world)]
        self.where = f" (rank {self.global_rank}, cp rank {self.rank} of group " \
                     f"{self.global_ranks})"
        self.timeout = positive_seconds(timeout, "CPComm: timeout", where=self.where)
        self.device = torch.device(device) if device is not None else comm_device(group)
        self.next, self.prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self.agree = Agreement(SCHEMA, rank=self.rank, world=self.world, device=self.device,
                               where=self.where)
        self._failed: str | None = None
        self.closed = False
        self._to_next = self._from_prev = None
        self.stamps_first = False
        self._coll = None  # the group's collective communicator, built on first use
        # cp_attention(method="auto"): the method chosen per call shape, and its timings (s)
        self.cp_choices: dict[tuple, str] = {}
        self.cp_timings: dict[tuple, dict[str, float]] = {}
        if self.world > 1:
            key = tuple(self.global_ranks)
            _made[key] = _made.get(key, 0) + 1
            self._token = token or f"{'-'.join(map(str, key))}#{_made[key]}"
            self._build_channels(self._token)

    def _build_channels(self, token: str) -> None:
        from overlap.pp.p2p import _Channel, connect_all

        me, nxt, prv = (self.global_ranks[x] for x in (self.rank, self.next, self.prev))
        wanted = {(me, nxt): "to_next", (prv, me): "from_prev"}
        # Creation pairs the two ends (gloo's construction blocks until both come, NCCL's
        # first transfer does): every rank makes its channels in one global order, sorted by
        # (src, dst), so no two ranks wait on each other's second channel.
        for src, dst in sorted(wanted):
            chan = _Channel(self.group, f"overlap_cp/{token}/{src}->{dst}", [src, dst],
                            0 if src == me else 1, timedelta(seconds=self.timeout),
                            self.device)
            setattr(self, "_" + wanted[(src, dst)], chan)
        # NCCL would create each channel at its first transfer, and the ring's first transfers
        # touch them crossed (each rank's first is on its own to_next channel): create both
        # now, in the same order.
        try:
            connect_all([self._to_next, self._from_prev], self.timeout)
        except RuntimeError as exc:
            self.close()
            raise RuntimeError(f"CPComm: {exc}{self.where}") from exc
        # Plain gloo aborts the process when a message outgrows the receive it meets, so there
        # the ring compares each call's stamps before it posts a block (overlap.cp.ring).
        self.stamps_first = type(self._to_next.backend) is dist.ProcessGroupGloo

    def __repr__(self) -> str:
        return f"CPComm(cp rank {self.rank}/{self.world}, timeout={self.timeout:g}s)"

    def describe(self, cp_rank: int) -> str:
        return f"cp rank {cp_rank} (global rank {self.global_ranks[cp_rank]})"

    # -- state
    def check_usable(self, op: str) -> None:
        if self._failed is not None:
            raise CPCommFailed(f"cp {op}: this CPComm failed earlier and cannot be used again: "
                               f"{self._failed}{self.where}")
        if self.closed:
            raise CPCommFailed(f"cp {op}: this CPComm is closed{self.where}")

    @contextlib.contextmanager
    def guard(self, op: str):
        """Any error inside a call fails the communicator (the first error is kept)."""
        try:
            yield
        except BaseException as exc:
            if self._failed is None:
                self._failed = f"{type(exc).__name__}: {exc}"
            raise

    def close(self) -> None:
        """Release the channels and the collective communicator (local: each end releases
        its own)."""
        self.closed = True
        for name in ("_to_next", "_from_prev", "_coll"):
            chan = getattr(self, name)
            setattr(self, name, None)
            if chan is not None:
                try:
                    chan.close() if name != "_coll" else chan.shutdown()
                except Exception:  # noqa: BLE001 - a channel broken by a dead peer
                    pass

    # -- agreement
    def stamp(self, op: str, q: torch.Tensor, kv: torch.Tensor, causal: bool,
              scale: float) -> None:
        """Count the call and write its stamp; the first call all-gathers every rank's stamp
        and raises the same Disagreement on every rank (a one-time cross-rank check)."""
        key = (op, tuple(q.shape), tuple(kv.shape), q.dtype, causal, scale)
        self.agree.next(op, key=key, make=lambda: {
            "q shape": list(q.shape), "kv shape": list(kv.shape),
            "dtype": _dtype_code(q.dtype), "causal": int(causal),
            "scale": float_word(scale)})
        self.agree.clear_received()
        if self.agree.calls == 1 and self.world > 1:
            self._first_call_check(op)

    def _first_call_check(self, op: str) -> None:
        from overlap.tp.collectives import all_gather_single, wait

        out = self.agree.send.new_empty(self.world * STAMP_WORDS)
        wait(all_gather_single(out, self.agree.send, group=self.group, async_op=True),
             op=f"{op} (first-call check)", group=self.group, timeout=self.timeout, axis="cp")
        rows = out.view(self.world, STAMP_WORDS).tolist()
        SCHEMA.check(op, rows[self.rank], {q: rows[q] for q in range(self.world)
                                           if q != self.rank}, rank=self.rank,
                     where=self.where)

    # -- the ring's transfers (posted async; waited with the timeout)
    def post(self, t: torch.Tensor, *, send: bool, op: str, what: str):
        """Post ``t`` to the next rank (``send``) or into ``t`` from the previous one; returns
        the work to ``wait`` for. A transport that fails at the post (plain gloo, a dead
        peer) raises the same error as a failed wait."""
        chan = self._to_next if send else self._from_prev
        try:
            return chan.transfer(t, send)
        except Exception as exc:  # noqa: BLE001 - reported with the op, the peer and the rank
            raise self._error(exc, op, what, send, "failed when posted") from exc

    def post_stamp(self, *, send: bool, op: str):
        t = self.agree.send if send else self.agree.recv[self.prev]
        return self.post(t, send=send, op=op, what="the stamp")

    def verify_stamp(self, op: str, *, arrived_only: bool = False) -> None:
        self.agree.verify(op, [self.prev], arrived_only=arrived_only)

    def wait(self, work, *, op: str, what: str, send: bool) -> None:
        """Wait for one transfer with the timeout; errors name the op, the transfer, the peer
        and this rank, and say whether it failed at once (a dead peer) or timed out."""
        self._timed_wait(work, op, lambda exc, took: self._error(
            exc, op, what, send, self._how(exc, took, "the two ranks")))

    def _timed_wait(self, work, op: str, error) -> None:
        """``work.wait`` with the timeout, counted as exposed communication; a failure raises
        ``error(exc, seconds waited)`` from it."""
        t0 = time.monotonic()
        try:
            with comm_wait(f"cp.{op}"):
                work.wait(timedelta(seconds=self.timeout))
        except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError
            raise error(exc, time.monotonic() - t0) from exc

    def _how(self, exc: Exception, took: float, who: str) -> str:
        from overlap.dist.nccl_twin import SizeMismatch

        if isinstance(exc, SizeMismatch):
            return f"failed: {who} passed different sizes"
        if took >= 0.9 * self.timeout:
            return (f"timed out after {self.timeout:g}s (a peer stalled, or is in another "
                    "call)")
        return f"failed after {took:.2f}s (a peer died, aborted or closed its connection)"

    def _error(self, exc: Exception, op: str, what: str, send: bool, how: str) -> RuntimeError:
        peer = self.next if send else self.prev
        return RuntimeError(f"cp {op}: {what} {'to' if send else 'from'} "
                            f"{self.describe(peer)} {how}{self.where}: {exc}")


    # -- the group's collectives (all-gather and Ulysses attention, the auto choice)
    def _collectives(self):
        """The CP group's own collective communicator, built on first use (collective over
        the group, like the channels): these ops never queue behind the caller's collectives
        on ``group``, and an error fails this communicator only."""
        if self._coll is None:
            from overlap.dist import nccl_twin

            prefix, t = f"overlap_cp/{self._token}/group", timedelta(seconds=self.timeout)
            store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
            if nccl_twin.is_twin(self.group):
                self._coll = nccl_twin.NcclTwinGroup(store, self.rank, self.world, t, prefix,
                                                     self.global_ranks)
            elif self.device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = t
                self._coll = dist.ProcessGroupNCCL(store, self.rank, self.world, opts)
            else:
                self._coll = dist.ProcessGroupGloo(store, self.rank, self.world, t)
        return self._coll

    def collective(self, kind: str, out: torch.Tensor, inp: torch.Tensor, *, op: str,
                   what: str):
        """Post collective ``kind`` over the CP group and return its work: "all_gather"
        (``out`` is every rank's ``inp`` in CP-rank order), "reduce_scatter" (sum; ``out`` is
        this rank's 1/cp of ``inp``), "all_to_all" (``inp``'s row q goes to CP rank q; ``out``'s
        row q comes from it), "all_reduce_max" (``inp`` is ``out``, in place)."""
        try:
            pg = self._collectives()
            if kind == "all_gather":
                return pg._allgather_base(out, inp)
            if kind == "reduce_scatter":
                return pg._reduce_scatter_base(out, inp, dist.ReduceScatterOptions())
            if kind == "all_to_all":
                return pg.alltoall_base(out, inp, [], [], dist.AllToAllOptions())
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            return pg.allreduce([out], opts)
        except Exception as exc:  # noqa: BLE001 - reported with the op, the group and the rank
            raise self._group_error(exc, op, what, "failed when posted") from exc

    def wait_collective(self, work, *, op: str, what: str) -> None:
        """Wait for a collective with the timeout; errors name the op, the transfer, the
        group's ranks and this rank."""
        self._timed_wait(work, op, lambda exc, took: self._group_error(
            exc, op, what, self._how(exc, took, "the ranks")))

    def _group_error(self, exc: Exception, op: str, what: str, how: str) -> RuntimeError:
        return RuntimeError(f"cp {op}: {what} over the CP group (global ranks "
                            f"{self.global_ranks}) {how}{self.where}: {exc}")

    def stamps_alone(self, op: str) -> None:
        """Plain gloo (``stamps_first``), before a collective whose sizes follow the call:
        all-gather this call's stamp alone (128 bytes a rank) and compare it, so a rank whose
        sizes differ raises a Disagreement instead of gloo aborting the process on a message
        that outgrows its receive. Not on a communicator's first call (its check did this)."""
        if not self.stamps_first or self.agree.calls == 1:
            return
        every, what = self.agree.send.new_empty(self.world * STAMP_WORDS), "the stamps alone"
        self.wait_collective(self.collective("all_gather", every, self.agree.send, op=op,
                                             what=what), op=op, what=what)
        self.verify_rows(op, every.view(self.world, STAMP_WORDS))

    def verify_rows(self, op: str, rows: torch.Tensor) -> None:
        """Compare every rank's stamp (``rows``: (cp, STAMP_WORDS) int64, row q from CP rank
        q, e.g. the head of a gathered packet) with this call's; a Disagreement names the
        field and both ranks. A device copy and the usual verify: no host sync."""
        self.agree.recv.copy_(rows)
        self.agree.verify(op, [q for q in range(self.world) if q != self.rank])


class Packet:
    """The byte layout of one rank's message to one peer: this call's stamp (optional),
    then tensors of fixed shapes and dtypes, each 16-byte aligned, so one collective carries
    the stamp with the data and mixed dtypes. A buffer is (..., nbytes) uint8."""

    def __init__(self, parts: list[tuple[tuple[int, ...], torch.dtype]], *, stamp: bool):
        self.parts, self.offsets, at = parts, [], STAMP_WORDS * 8 if stamp else 0
        self.stamped = stamp
        for shape, dtype in parts:
            self.offsets.append(at)
            n = dtype.itemsize
            for size in shape:
                n *= size
            at += -(-n // 16) * 16
        self.nbytes = at

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty(rows, self.nbytes, dtype=torch.uint8, device=device)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The parts of ``buf`` (rows, nbytes): each (rows, *shape) in its dtype."""
        out = []
        for (shape, dtype), at in zip(self.parts, self.offsets):
            n = dtype.itemsize
            for size in shape:
                n *= size
            out.append(buf[:, at:at + n].view(dtype).view(buf.shape[0], *shape))
        return out

    def stamps(self, buf: torch.Tensor) -> torch.Tensor:
        """The stamp words of every row of ``buf``: (rows, STAMP_WORDS) int64."""
        return buf[:, :STAMP_WORDS * 8].view(torch.int64)


def call_scale(op: str, q, comm, causal, scale) -> float:
    """The checks every CP attention entry point makes before its autograd Function:
    ``comm`` a CPComm, ``causal`` a bool; returns ``scale`` as a float (1/sqrt(d) by
    default; NaN for a non-number, which the op's validation then names)."""
    if not isinstance(comm, CPComm):
        raise TypeError(f"{op}: comm must be a CPComm, got {type(comm).__name__}")
    if not HAVE_OPAQUE and torch.compiler.is_compiling():
        raise RuntimeError(compile_problem(op))
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {causal!r}{comm.where}")
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
    return float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) \
        else float("nan")


def _dtype_code(dtype: torch.dtype) -> int:
    from overlap.dist.stamp import DTYPE_CODES

    return DTYPE_CODES.get(dtype, 0)


# What torch.compile may read while tracing (constants of a communicator's life).
register_opaque_type(CPComm, typ="reference", members={
    "world": MemberType.USE_REAL, "rank": MemberType.USE_REAL,
    "group": MemberType.USE_REAL})
