"""CPComm: the context-parallel communicator of a process group (the CP attention ops' ``comm=``).

It owns the ring's two channels, each a two-rank communicator carrying one direction (send
to the next CP rank, receive from the previous one), built like the pipeline's
(``overlap.pp.p2p``) so NCCL's one-op-at-a-time order never mixes the directions, and, from
the first all-gather or Ulysses call, a collective communicator of the group's own. Creating
it is collective over the group; ``close()`` releases them. Every wait is bounded by
``timeout`` s and names the op, the peer (or the group) and this rank. After any error the
communicator is failed: every later call raises ``CPCommFailed`` with the first error; a
rank's own failure is also written to the job's store, which a CPU wait that outlasts 50 ms
reads (with the stamps of peers stuck in other calls), so every rank raises it. One op in
flight per communicator. ``Packet``: a stamp and tensors in one byte message. The narrative:
docs/design/cp.md.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from overlap.versions import (HAVE_OPAQUE, MemberType, OpaqueBase, compile_problem,
                              register_opaque_type)

from overlap.dist.communicator import CommFailed, CommOptions, Communicator, options_of
from overlap.dist.device import comm_device
from overlap.dist.streams import work_completion
from overlap.dist.stamp import (STAMP_WORDS, Agreement, Disagreement, Schema, float_word,
                                shape_words)
from overlap.profile.timers import comm_wait

__all__ = ["CPComm", "CPCommFailed", "SCHEMA", "Packet", "call_layer", "call_scale"]

# The per-call stamp: what every CP rank must pass alike (checked on every call, in the ring's
# first message; the communicator's first call also all-gathers it and names every rank).
# "layer": the caller's layer id (-1 unknown), so two layers alike in everything else called in
# other orders are told apart. cp_loss / cp_gather_logits: q shape = the logits', kv shape = the
# labels' (cp_loss), ignore_index (cp_loss; 0 elsewhere).
SCHEMA = Schema("cp", ("ring_attention", "ring_attention_backward", "allgather_attention",
                      "allgather_attention_backward", "ulysses_attention",
                      "ulysses_attention_backward", "cp_loss", "cp_gather_logits"),
                (("q shape", 4, "shape"), ("kv shape", 4, "shape"), ("dtype", 1, "dtype"),
                 ("causal", 1, "bool"), ("scale", 1, "float"), ("layer", 1, "int"),
                 ("ignore_index", 1, "int")))
_SLICE_S = 0.05  # a CPU wait longer than this watches the store for a peer's failure

# Channel store prefixes must be equal on both ends and unique per communicator: every rank
# of a group creates its CPComms in the same order, so a count per group of ranks is both.
_made: dict[tuple[int, ...], int] = {}


class CPCommFailed(CommFailed):
    """A call on a CP communicator that failed earlier; the message carries the first error."""


class CPComm(Communicator, OpaqueBase):
    """The ring over ``group``: CP rank ``r`` sends to ``(r + 1) % cp`` and receives from
    ``(r - 1) % cp``. Custom ops take it as an opaque object (no registry of communicators).
    ``options`` (CommOptions): timeout and device; the keywords, when given, override it."""

    failed_type = CPCommFailed
    refused_failed = ("cp {op}: this CPComm failed earlier and cannot be used again: "
                      "{failure}{where}")
    refused_closed = "cp {op}: this CPComm is closed{where}"

    def __init__(self, group: dist.ProcessGroup, options: CommOptions | None = None, *,
                 timeout: float | None = None, device: torch.device | str | None = None,
                 token: str = ""):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"CPComm: group must be a torch.distributed ProcessGroup (e.g. "
                            f"dims.cp_group), got {type(group).__name__}")
        super().__init__(group)
        opts = options_of(options, "CPComm", where=self.where, timeout=timeout, device=device)
        self.timeout, device = opts.timeout, opts.device
        self.device = torch.device(device) if device is not None else comm_device(group)
        self.next, self.prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self.agree = Agreement(SCHEMA, rank=self.rank, world=self.world, device=self.device,
                               where=self.where)
        self._to_next = self._from_prev = None
        self.stamps_first = False
        self._coll = None  # the group's collective communicator, built on first use
        self._store = None  # the job's store: failures and stuck calls published (CPU waits)
        self._announced = 0
        # cp_attention(method="auto"): the method chosen per call shape, and its timings (s)
        self.cp_choices: dict[tuple, str] = {}
        self.cp_timings: dict[tuple, dict[str, float]] = {}
        if self.world > 1:
            key = tuple(self.global_ranks)
            _made[key] = _made.get(key, 0) + 1
            self._token = token or f"{'-'.join(map(str, key))}#{_made[key]}"
            self._key = f"overlap_cp/{self._token}"
            self._store = _default_store()
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

    # -- state (the failure rule: overlap.dist.communicator)
    def _place(self) -> str:
        return f"rank {self.global_rank}, cp rank {self.rank} of group {self.global_ranks}"

    def _abort_peers(self, exc: BaseException) -> None:
        """Tell the peers, through the job's store, that this rank failed on its own (a
        disagreement it found, bad input, an error of its compute): a rank waiting on a
        transfer that will never come reads it (``_raise_if_peer_failed``) instead of timing
        out. Errors this rank only saw (``not_own``: a transport error, a peer's failure)
        are not published."""
        if self._store is None or getattr(exc, "not_own", False) or \
                not isinstance(exc, Exception):
            return
        kind = "disagreement" if isinstance(exc, Disagreement) else "error"
        try:
            self._store.set(f"{self._key}/failed/{self.rank}",
                            f"{kind}|{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - a store gone with the job: the peers time out
            pass

    def _release(self, wait_for_peers: bool) -> None:
        """Release the channels and the collective communicator (local: each end releases
        its own)."""
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
              scale: float, layer: int = -1, ignore_index: int = 0) -> None:
        """Count the call and write its stamp; the first call all-gathers every rank's stamp
        and raises the same Disagreement on every rank (a one-time cross-rank check)."""
        key = (op, tuple(q.shape), tuple(kv.shape), q.dtype, causal, scale, layer,
               ignore_index)
        self.agree.next(op, key=key, make=lambda: {
            "q shape": shape_words(q.shape, 4), "kv shape": shape_words(kv.shape, 4),
            "dtype": _dtype_code(q.dtype), "causal": int(causal),
            "scale": float_word(scale), "layer": layer, "ignore_index": ignore_index})
        self.agree.clear_received()
        if self.agree.calls == 1 and self.world > 1:
            self._first_call_check(op)

    def _first_call_check(self, op: str) -> None:
        from overlap.tp.collectives import all_gather_single, wait

        out = self.agree.send.new_empty(self.world * STAMP_WORDS)
        try:
            wait(all_gather_single(out, self.agree.send, group=self.group, async_op=True),
                 op=f"{op} (first-call check)", group=self.group, timeout=self.timeout,
                 axis="cp")
        except RuntimeError as exc:
            exc.not_own = True  # the transport's error: not published
            raise
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
            self._raise_peer_cause(op, what)
            raise self._error(exc, op, what, send, "failed when posted") from exc

    @property
    def _watches_store(self) -> bool:
        """CPU with a job store: failures and waits are also read from the store."""
        return self._store is not None and self.device.type != "cuda"

    def _raise_peer_cause(self, op: str, what: str) -> None:
        """A transfer that broke (at its post on plain gloo, when the peer already released
        its end, or in its wait) after the peer failed on its own: the peer published why
        before it let go (``fail`` before ``close``), so raise that instead (CPU)."""
        if self._watches_store:
            self._raise_if_peer_failed(op, what)

    def post_stamp(self, *, send: bool, op: str):
        t = self.agree.send if send else self.agree.recv[self.prev]
        return self.post(t, send=send, op=op, what="the stamp")

    def verify_stamp(self, op: str, *, arrived_only: bool = False) -> None:
        self.agree.verify(op, [self.prev], arrived_only=arrived_only)

    def wait(self, work, *, op: str, what: str, send: bool) -> None:
        """Wait for one transfer with the timeout; errors name the op, the transfer, the peer
        and this rank, and say whether it failed at once (a dead peer) or timed out."""
        self._timed_wait(work, op, what, lambda exc, took: self._error(
            exc, op, what, send, self._how(exc, took, "the two ranks")))

    def _timed_wait(self, work, op: str, what: str, error) -> None:
        """``work.wait`` with the timeout, counted as exposed communication; a failure raises
        ``error(exc, seconds waited)`` from it, unless a peer published why (CPU)."""
        t0 = time.monotonic()
        try:
            with comm_wait(f"cp.{op}"):
                if self._watches_store:
                    self._watched_wait(work, op, what, t0)
                else:
                    work.wait(timedelta(seconds=self.timeout))
        except Disagreement:
            raise
        except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError
            if getattr(exc, "not_own", False):
                raise
            # The twin raised on every rank for other sizes: no stamp crossed.
            if self._watches_store and _sizes_differ(exc):
                self._compare_in_store(op, what)
            self._raise_peer_cause(op, what)  # a peer's own failure broke it
            raise error(exc, time.monotonic() - t0) from exc

    def _compare_in_store(self, op: str, what: str) -> None:
        """After a transfer every rank refused for other sizes: announce this call's stamp and
        read the peers' for a short while, so the Disagreement names the field and both
        ranks' signatures (NCCL itself would hang or read garbage: docs/design/cp.md)."""
        self._announce()
        deadline = time.monotonic() + min(2.0, self.timeout)
        while time.monotonic() < deadline:
            self._raise_if_peer_failed(op, what)
            time.sleep(_SLICE_S)

    def _watched_wait(self, work, op: str, what: str, t0: float) -> None:
        """CPU: wait for ``work``; past a short slice, announce this call's stamp in the store
        and poll it every slice for a peer's failure or a peer stuck in another call."""
        done, finish = _completion(work)
        if done.wait(_SLICE_S):  # the steady state: no store traffic
            finish(self.timeout)
            return
        deadline = t0 + self.timeout
        self._announce()
        while not done.wait(max(0.0, min(_SLICE_S, deadline - time.monotonic()))):
            self._raise_if_peer_failed(op, what)
            if time.monotonic() >= deadline:
                break
        finish(max(0.001, deadline - time.monotonic()))

    def _announce(self) -> None:
        """Publish the stamp of the call this rank waits in (once per call)."""
        if self._announced == self.agree.calls:
            return
        self._announced = self.agree.calls
        with contextlib.suppress(Exception):  # a store gone with the job: the timeout stands
            self._store.set(f"{self._key}/waiting/{self.rank}",
                            ",".join(str(int(w)) for w in self.agree.mine))

    def _record(self, kind: str, q: int) -> str | None:
        key = f"{self._key}/{kind}/{q}"
        try:
            return self._store.get(key).decode(errors="replace") \
                if self._store.check([key]) else None
        except Exception:  # noqa: BLE001 - a store gone with the job (its host rank died)
            return None

    def _raise_if_peer_failed(self, op: str, what: str) -> None:
        """Raise what the store says blocks this call: a peer's published failure (a
        Disagreement carrying both ranks' signatures, or the peer's error), or a peer waiting
        in a call of this number whose stamp differs from this rank's (a rank that skipped or
        repeated a call, or called another op: the Disagreement names both)."""
        mine = [int(w) for w in self.agree.mine]
        peers = [q for q in range(self.world) if q != self.rank]
        for q in peers:
            raw = self._record("failed", q)
            if raw is None:
                continue
            kind, _, msg = raw.partition("|")
            how = "found that the ranks' calls disagree" if kind == "disagreement" else "failed"
            text = f"cp {op}: {what} cannot complete: {self.describe(q)} {how}{self.where}: {msg}"
            exc = (Disagreement(text, op=op, call=mine[1], ranks=(self.rank, q))
                   if kind == "disagreement" else RuntimeError(text))
            exc.not_own = True
            raise exc
        for q in peers:
            raw = self._record("waiting", q)
            theirs = [int(w) for w in raw.split(",")] if raw else None
            if theirs is not None and theirs[1] == mine[1] and theirs != mine:
                SCHEMA.check(op, mine, {q: theirs}, rank=self.rank,
                             where=f"{self.where}, found while both waited")

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
        err = RuntimeError(f"cp {op}: {what} {'to' if send else 'from'} "
                           f"{self.describe(peer)} {how}{self.where}: {exc}")
        err.not_own = True
        return err


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
                nccl_twin.label(self._coll, "cp")
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
        row q comes from it), "all_reduce_max" / "all_reduce_sum" (``inp`` is ``out``, in
        place)."""
        try:
            pg = self._collectives()
            if kind == "all_gather":
                return pg._allgather_base(out, inp)
            if kind == "reduce_scatter":
                return pg._reduce_scatter_base(out, inp, dist.ReduceScatterOptions())
            if kind == "all_to_all":
                return pg.alltoall_base(out, inp, [], [], dist.AllToAllOptions())
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM if kind == "all_reduce_sum" else dist.ReduceOp.MAX
            return pg.allreduce([out], opts)
        except Exception as exc:  # noqa: BLE001 - reported with the op, the group and the rank
            self._raise_peer_cause(op, what)
            raise self._group_error(exc, op, what, "failed when posted") from exc

    def wait_collective(self, work, *, op: str, what: str) -> None:
        """Wait for a collective with the timeout; errors name the op, the transfer, the
        group's ranks and this rank."""
        self._timed_wait(work, op, what, lambda exc, took: self._group_error(
            exc, op, what, self._how(exc, took, "the ranks")))

    def _group_error(self, exc: Exception, op: str, what: str, how: str) -> RuntimeError:
        err = RuntimeError(f"cp {op}: {what} over the CP group (global ranks "
                           f"{self.global_ranks}) {how}{self.where}: {exc}")
        err.not_own = True
        return err

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


def call_layer(op: str, layer, comm) -> int:
    """``layer`` as an int (-1: unknown); TypeError for anything else."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"{op}: layer must be an int (the layer's id, -1 if unknown), got "
                        f"{layer!r}{comm.where}")
    return layer


def _sizes_differ(exc: BaseException) -> bool:
    return type(exc).__name__ == "SizeMismatch" or "disagree on the sizes" in str(exc)


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group: failures are only local
        return None


def _completion(work):
    return work_completion(work, name="overlap-cp-wait")


def _dtype_code(dtype: torch.dtype) -> int:
    from overlap.dist.stamp import DTYPE_CODES

    return DTYPE_CODES.get(dtype, 0)


# What torch.compile may read while tracing (constants of a communicator's life).
register_opaque_type(CPComm, typ="reference", members={
    "world": MemberType.USE_REAL, "rank": MemberType.USE_REAL,
    "group": MemberType.USE_REAL})
