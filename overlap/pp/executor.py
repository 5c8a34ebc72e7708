"""Run a validated PipelineSchedule on this rank's stages: ``Pipeline(...).step(inputs, targets)``.

The executor runs its rank's plan (``overlap.pp.programs.rank_plan``) on per-direction channel
communicators; ``build_schedule`` proved those plans deadlock-free under NCCL's rules. Pp ranks
that disagree on the schedule get a ``ValueError`` at construction. Shapes need no user input:
the first step with new micro-batch shapes sends shape headers, later steps reuse the cached
ones; a stage whose output shape changes while its input shapes do not raises ``ValueError``.

Loss and gradients, for every schedule: the last stage computes ``loss_fn(output_mb,
target_mb)`` per micro-batch and backpropagates it scaled by ``1/m``; ``step`` returns the mean
loss on the rank holding the last stage (None elsewhere), and ``param.grad`` accumulates the
gradient of that mean loss (the caller zeroes it between steps).

The narrative: docs/design/pp.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import uuid
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from overlap.defaults import TIMEOUT_S
from overlap.dist.host import host_id, pid_alive
from overlap.pp.p2p import HEADER_LEN, P2P, POLL_S, P2PError, decode_header, encode_header
from overlap.pp.interleave import Interleaver
from overlap.pp.programs import channels_of, ep_pairs, rank_plan
from overlap.pp.schedules import Action, Kind, Message, Payload, PipelineSchedule, stage_rank
from overlap.pp.stage import PipelineStage
from overlap.profile import names, nvtx

__all__ = ["Pipeline", "StepResult", "Timeline", "bubble_fractions"]

_FAILED = b"failed"  # a step's digest key, set by a rank whose previous step failed
# How often a pp rank polls the store for the next step's digest: from 1 ms, doubling to 20 ms
_DIGEST_POLL_S = (0.001, 0.02)


@dataclasses.dataclass(slots=True)
class Timeline:
    """This rank's step: ``events`` = (kind, stage, micro-batch, t_start, t_end) of each
    compute action, excluding the time spent waiting for its input (perf_counter seconds)."""

    start: float
    end: float
    events: list[tuple[str, int, int, float, float]]

    @property
    def busy(self) -> float:
        return sum(t1 - t0 for *_, t0, t1 in self.events)


def bubble_fractions(timelines: Sequence[Timeline]) -> list[float]:
    """Per rank ``1 - busy / window`` over the common window [earliest start, latest end]
    (perf_counter is the system-wide monotonic clock, so ranks on one host share it)."""
    window = max(t.end for t in timelines) - min(t.start for t in timelines)
    return [1.0 - t.busy / window for t in timelines]


@dataclasses.dataclass(slots=True)
class StepResult:
    loss: torch.Tensor | None
    """Mean loss over the micro-batches on the rank holding the last stage, else None."""
    losses: list[torch.Tensor] | None
    timeline: Timeline


def _split(name: str, value, m: int, rank: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != m:
            raise ValueError(f"pp Pipeline.step: {name} has {len(value)} micro-batches on pp "
                             f"rank {rank}; the schedule was built for num_microbatches={m}")
        return list(value)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % m:
            raise ValueError(f"pp Pipeline.step: {name} of shape {tuple(value.shape)} on pp "
                             f"rank {rank}: dim 0 must be divisible by num_microbatches={m}")
        return list(value.chunk(m))
    raise TypeError(f"pp Pipeline.step: {name} must be a tensor or a list of {m} micro-batches "
                    f"on pp rank {rank}, got {type(value).__name__}")


def _agree(schedule: PipelineSchedule, pp_group, rank: int) -> str:
    """Every pp rank must run the same schedule (a mismatch would hang, so it fails here);
    returns pp rank 0's token, which names this pipeline's channel communicators."""
    mine = {"schedule": schedule.name, "num_microbatches": schedule.num_microbatches,
            "num_virtual": schedule.num_virtual}
    if schedule.pp_size == 1:
        return ""
    every: list = [None] * schedule.pp_size
    dist.all_gather_object(every, dict(mine, token=uuid.uuid4().hex), group=pp_group)
    for key in mine:
        values = {r: e[key] for r, e in enumerate(every)}
        if len(set(values.values())) > 1:
            raise ValueError(f"pp Pipeline: the pp ranks disagree on {key}: "
                             + ", ".join(f"pp rank {r} has {v!r}" for r, v in values.items())
                             + f" (seen on pp rank {rank}); every rank must build the same "
                             "schedule")
    return every[0]["token"]


class Pipeline:
    """This rank's part of a pipeline: its stages (ordered by stage index) and a schedule.

    Construction is collective over ``pp_group``: the ranks check that they agree on the
    schedule, then create one two-rank communicator per direction of each pipeline link this
    rank uses (see ``overlap.pp.programs``); ``close()`` releases them."""

    def __init__(self, stages: Sequence[PipelineStage], schedule: PipelineSchedule, *,
                 loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
                 pp_group: dist.ProcessGroup, timeout: float = TIMEOUT_S,
                 ep_comms: Sequence = ()):
        p, rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        if not isinstance(schedule, PipelineSchedule):
            raise TypeError(f"pp Pipeline: schedule must be a PipelineSchedule (from "
                            f"build_schedule), got {type(schedule).__name__}")
        if schedule.pp_size != p:
            raise ValueError(f"pp Pipeline: schedule pp_size={schedule.pp_size} but pp_group "
                             f"has {p} ranks (pp rank {rank})")
        want = schedule.stages_of(rank)
        got = [s.stage_index for s in stages]
        if got != want or any(s.num_stages != schedule.num_stages for s in stages):
            raise ValueError(f"pp Pipeline: pp rank {rank} must hold stages {want} of "
                             f"{schedule.num_stages} for {schedule.name}, got stages {got} of "
                             f"{[s.num_stages for s in stages]}")
        if not callable(loss_fn):
            raise TypeError(f"pp Pipeline: loss_fn must be callable, got {loss_fn!r}")
        self.stages = {s.stage_index: s for s in stages}
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.pp_group, self.pp_rank, self.pp_size = pp_group, rank, p
        self.program: tuple[Action, ...] = schedule.actions[rank]
        params = [q for s in stages for q in s.module.parameters()]
        self.device = params[0].device if params else torch.device("cpu")
        token = _agree(schedule, pp_group, rank)
        # With expert parallelism a forward and a backward next to each other run as a pair
        # whose EP all-to-alls hide under each other's compute (overlap.pp.interleave).
        self.interleaver = Interleaver()
        self.pairs: tuple = ()
        for c in ep_comms:
            if not getattr(c, "pairable", False):
                raise ValueError(f"pp Pipeline: {c!r} cannot overlap across micro-batches (its "
                                 "symmetric exchange has one workspace: make it with lanes=2, "
                                 "or pass it without ep_comms= to keep its overlap inside the "
                                 "layer)")
            c.interleaver = self.interleaver
        self._ep_comms = list(ep_comms)
        if ep_comms:
            self.pairs = ep_pairs(schedule)[rank]
            # The EP ranks (this pp rank in other pipeline replicas) must issue their EP
            # collectives in one order: the same pairs of the same program, or NCCL would match
            # a forward's all-to-all with a backward's. One small all-gather per EP group, here.
            desc = repr((schedule.name, schedule.num_microbatches, schedule.num_virtual,
                         [(str(a), str(b)) for a, b in self.pairs])).encode()
            digest = int.from_bytes(hashlib.blake2b(desc, digest_size=6).digest(), "little")
            for c in ep_comms:
                c.check_same("pp Pipeline(ep_comms=...)", schedule_and_pairs=digest,
                             num_microbatches=schedule.num_microbatches)
        # The steps this rank runs, exactly as check_nccl_order proved them deadlock-free.
        self._plans = {mode: rank_plan(schedule, rank, header_mode=mode, pairs=self.pairs)
                       for mode in (False, True)}
        self._index = {a: i for i, a in enumerate(self.program) if a.is_compute}
        self.p2p = P2P(pp_group, timeout=timeout, device=self.device,
                       channels=channels_of(schedule, rank), token=token)
        self._token, self._steps = token, 0
        self._leader_pid: int | None = None  # pp rank 0's pid, if it runs on this host
        if self.pp_size > 1:
            dist.distributed_c10d._get_default_store().set(
                f"overlap_pp/{token}/pid/{self.pp_rank}", f"{host_id()}|{os.getpid()}")
        self._shapes: dict[int, dict[tuple, tuple]] = {}
        # Index of each stage's final gradient-accumulating action (see PipelineStage).
        self._last_grad_action: dict[int, int] = {}
        for i, a in enumerate(self.program):
            first = a.stage == 0
            if a.kind == Kind.B or (a.kind == Kind.I and first) or (a.kind == Kind.W
                                                                    and not first):
                self._last_grad_action[a.stage] = i

    def _digest(self, mbs: list | None) -> int:
        """pp rank 0's 63-bit digest of this step's micro-batch shapes, on every pp rank.

        It travels host to host through the job's store (rank 0 sets a key per step, the
        others read it, the last reader deletes it), not as a device collective: reading a
        broadcast tensor on the host would stall it until the device caught up, every step.
        A rank whose step fails sets the next step's key to ``_FAILED``, waking the ranks that
        finished the step and wait here (no rank can be further ahead)."""
        digest = 0
        if mbs is not None:
            desc = repr([(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor)
                         else type(x).__name__ for x in mbs]).encode()
            digest = int.from_bytes(hashlib.blake2b(desc, digest_size=8).digest(), "little") >> 1
        if self.pp_size == 1:
            return digest
        self._steps += 1
        key = f"overlap_pp/{self._token}/digest/{self._steps}"
        store = dist.distributed_c10d._get_default_store()
        what = f"its wait for step {self._steps}'s micro-batch shape digest"
        self.p2p.check_failed(what)  # a failed pipeline fails every later step at once
        try:
            if self.pp_rank == 0:
                store.set(key, str(digest))
                return digest
            self._wait_digest(store, key, what)
            value = store.get(key)
            if value == _FAILED:
                self.p2p.check_failed(what)
            digest = int(value)
            if store.add(f"{key}/read", 1) == self.pp_size - 1:
                store.delete_key(key)
                store.delete_key(f"{key}/read")
        except P2PError:
            raise
        except (RuntimeError, ValueError) as exc:
            raise P2PError(f"pp Pipeline.step on pp rank {self.pp_rank}: the micro-batch shape "
                           f"digest of step {self._steps} from {self.p2p.describe(0)} did not "
                           f"arrive within {self.p2p.timeout.total_seconds():g}s: {exc}") from exc
        return digest

    def _wait_digest(self, store, key: str, what: str) -> None:
        """Wait for pp rank 0's digest within the P2P timeout, polling the key (every
        ``_DIGEST_POLL_S``, backing off; a store wait with a short timeout stalled 5 s when
        a rank died during it, and printed a warning per timeout): every ``POLL_S``, a
        failure recorded elsewhere, or pp rank 0's process gone (on this host; no transfer
        is in flight to fail between steps), ends the wait naming it."""
        deadline = time.monotonic() + self.p2p.timeout.total_seconds()
        pause = _DIGEST_POLL_S[0]
        while True:
            watch = time.monotonic() + POLL_S
            while time.monotonic() < watch:
                if store.check([key]):
                    return
                time.sleep(pause)
                pause = min(2 * pause, _DIGEST_POLL_S[1])  # a long wait polls the store less
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no digest within {self.p2p.timeout.total_seconds():g}s")
            self.p2p.check_failed(what)
            if self._leader_pid is None:
                host, _, pid = store.get(f"overlap_pp/{self._token}/pid/0").decode(
                    errors="replace").rpartition("|")
                self._leader_pid = int(pid) if host == host_id() and pid.isdigit() else 0
            if self._leader_pid and not pid_alive(self._leader_pid):
                self.p2p.publish(0, f"its process (pid {self._leader_pid}) exited")
                self.p2p.check_failed(what)

    def _fail_next_digest(self) -> None:
        key = f"overlap_pp/{self._token}/digest/{self._steps + 1}"
        try:
            dist.distributed_c10d._get_default_store().set(key, _FAILED)
        except RuntimeError:
            pass  # the store is gone: the waiters' own timeout still holds

    def close(self) -> None:
        """Release this rank's channel communicators (no collective; safe to call twice)."""
        for c in self._ep_comms:
            c.interleaver = None
        self.p2p.close()

    def step(self, inputs=None, targets=None) -> StepResult:
        """Run one schedule: forward and backward of every micro-batch on every stage.

        ``inputs`` (needed on the rank holding stage 0) and ``targets`` (on the rank holding
        the last stage) are a tensor split along dim 0, or a list of micro-batches.
        """
        m, rank = self.schedule.num_microbatches, self.pp_rank
        has_first, has_last = 0 in self.stages, self.schedule.num_stages - 1 in self.stages
        if has_first and inputs is None:
            raise ValueError(f"pp Pipeline.step: pp rank {rank} holds stage 0 and needs inputs")
        if has_last and targets is None:
            raise ValueError(f"pp Pipeline.step: pp rank {rank} holds the last stage and "
                             "needs targets")
        mbs = _split("inputs", inputs, m, rank) if has_first else None
        tgts = _split("targets", targets, m, rank) if has_last else None
        for s in self.stages.values():
            s.reset()
        t_start = time.perf_counter()
        key = self._digest(mbs)
        header_mode = key not in self._shapes
        run = _StepRun(self, self._shapes.setdefault(key, {}), header_mode, mbs, tgts)
        try:
            run.execute()
        except BaseException as exc:
            if self.pp_size > 1:
                # Tell the other pp ranks, which may be waiting for this one (a no-op when a
                # transfer's failure was recorded first): they raise within POLL_S, naming it.
                first = str(exc).splitlines()[0] if str(exc) else ""
                self.p2p.publish(rank, f"its step raised {type(exc).__name__}: {first}")
                self._fail_next_digest()
            if header_mode:
                self._shapes.pop(key, None)  # never keep a half-learned shape table
            for s in self.stages.values():
                s.reset()
            raise
        timeline = Timeline(start=t_start, end=time.perf_counter(), events=run.events)
        if not has_last:
            return StepResult(loss=None, losses=None, timeline=timeline)
        losses = [run.losses[i] for i in range(m)]
        return StepResult(loss=torch.stack(losses).mean(), losses=losses, timeline=timeline)


class _StepRun:
    """The mutable state of one step on one rank: interprets ``rank_plan``'s steps."""

    def __init__(self, pipe: Pipeline, shapes: dict, header_mode: bool, mbs, tgts):
        self.pipe, self.shapes, self.header_mode = pipe, shapes, header_mode
        self.mbs, self.tgts = mbs, tgts
        self.p2p = pipe.p2p
        self.num_stages = pipe.schedule.num_stages
        self.posted: dict[tuple, tuple[torch.Tensor, Any, int]] = {}  # (part, msg) -> recv
        self.inbox: dict[tuple, torch.Tensor] = {}
        self.outbox: dict[tuple, torch.Tensor] = {}
        self.local: dict[tuple, torch.Tensor] = {}
        self.sent: list[tuple[Any, torch.Tensor, str, int]] = []
        self.losses: dict[int, torch.Tensor] = {}
        self.events: list[tuple[str, int, int, float, float]] = []

    def execute(self) -> None:
        plan = self.pipe._plans[self.header_mode]
        for step in plan:
            if step[0] == "post":
                self.post(step[1], step[2])
            elif step[0] == "wait":
                self.receive(*step[1])
            elif step[0] == "compute":
                self.compute(self.pipe._index[step[1]], step[1])
            elif step[0] == "pair":
                self.pair(*step[1:])
        for work, _, what, peer in self.sent:
            self.p2p.wait(work, what=what, peer=peer)
        leftovers = [k for k in (*self.posted, *self.inbox, *self.outbox, *self.local)]
        leftovers += [(s.stage_index, s.pending()) for s in self.pipe.stages.values()
                      if s.pending()]
        if leftovers:
            raise RuntimeError(f"pp Pipeline.step: pp rank {self.pipe.pp_rank} finished the "
                               f"schedule with unconsumed state {leftovers[:4]}")

    # ------------------------------------------------------------------ communication
    def post(self, channel: tuple[int, int], items: tuple) -> None:
        """Post one batch on ``channel`` (src, dst): sends of this rank's outputs, or receives
        into fresh buffers whose shapes are known (from the cache or a received header)."""
        src, dst = channel
        sends, recvs, recv_keys, send_what = [], [], [], []
        for part, msg, is_send in items:
            act, s, mb = msg.payload == Payload.ACT, msg.stage, msg.microbatch
            if is_send:
                t = self.outbox[msg] if part == "hdr" else self.outbox.pop(msg)
                sends.append((encode_header(t) if part == "hdr" else t, dst))
                noun = "shape of the activation" if part == "hdr" else (
                    "activation" if act else "input gradient")
                send_what.append(f"send of the {noun} for stage {s} micro-batch {mb}")
                continue
            if part == "hdr":
                shape, dtype = (HEADER_LEN,), torch.int64
            else:
                shape, dtype = self.shapes[("in", s, mb) if act else ("out", s, mb)]
            recvs.append((torch.empty(shape, dtype=dtype, device=self.pipe.device), src))
            recv_keys.append((part, msg))
        send_works, recv_works = self.p2p.post(channel, sends, recvs)
        # Drop finished sends so their buffers can be freed (1F1B's memory bound must hold);
        # wait() on a completed work only surfaces its error, it does not block.
        still = []
        for entry in self.sent:
            if entry[0].is_completed():
                self.p2p.wait(entry[0], what=entry[2], peer=entry[3])
            else:
                still.append(entry)
        self.sent = still
        for (t, peer), work, what in zip(sends, send_works, send_what):
            self.sent.append((work, t, what, peer))
        for key, (buf, peer), work in zip(recv_keys, recvs, recv_works):
            self.posted[key] = (buf, work, peer)

    def receive(self, part: str, msg: Message) -> None:
        """Wait for a posted receive; a header fills the shape table for the payload's post."""
        buf, work, peer = self.posted.pop((part, msg))
        s, mb = msg.stage, msg.microbatch
        noun = "shape header" if part == "hdr" else (
            "activation" if msg.payload == Payload.ACT else "gradient")
        self.p2p.wait(work, what=f"receive of the {noun} of stage {s} micro-batch {mb}",
                      peer=peer)
        if part == "hdr":
            self.shapes[("in", s, mb)] = decode_header(buf)
        else:
            self.inbox[msg] = buf

    def take(self, key: Message, peer: int) -> torch.Tensor:
        if peer == self.pipe.pp_rank:
            return self.local.pop(key)
        return self.inbox.pop(key)

    def give(self, key: Message, t: torch.Tensor, peer: int) -> None:
        (self.local if peer == self.pipe.pp_rank else self.outbox)[key] = t.detach().contiguous()

    # ------------------------------------------------------------------ compute
    def pair(self, a: Action, b: Action, b_inputs: tuple, a_sends: tuple) -> None:
        """Run ``a`` then its sends, and ``b`` after its input steps, interleaved at their EP
        waits (the forward on this thread)."""
        index = self.pipe._index

        def steps(sts: tuple) -> None:
            for st in sts:
                if st[0] == "post":
                    self.post(st[1], st[2])
                else:
                    self.receive(*st[1])

        def second() -> None:
            steps(b_inputs)
            self.compute(index[b], b)

        def first() -> None:
            self.compute(index[a], a)
            steps(a_sends)

        fwd_first = a.kind == Kind.F
        tasks, labels = ((first, second), (str(a), str(b))) if fwd_first else (
            (second, first), (str(b), str(a)))
        self.pipe.interleaver.run(*tasks, helper_first=not fwd_first, labels=labels)

    def compute(self, index: int, a: Action) -> None:
        pipe, s, mb = self.pipe, a.stage, a.microbatch
        stage, p = pipe.stages[s], pipe.pp_size
        # The action's range (names.pp_action) covers its compute only: the wait for its input
        # is a comm_wait range of its own, before it.
        span = nvtx.range(names.pp_action(a.kind, stage=s, micro_batch=mb))
        if a.kind == Kind.F:
            x = self.mbs[mb] if s == 0 else self.take(Message(Payload.ACT, s, mb),
                                                      stage_rank(s - 1, p))
            t0 = time.perf_counter()
            with span:
                if stage.is_last:
                    self.losses[mb] = stage.forward(
                        mb, x, target=self.tgts[mb], loss_fn=pipe.loss_fn,
                        loss_scale=1.0 / pipe.schedule.num_microbatches)
                else:
                    out = stage.forward(mb, x)
            if not stage.is_last:
                self._check_out_shape(s, mb, out)
                self.give(Message(Payload.ACT, s + 1, mb), out, stage_rank(s + 1, p))
        elif a.kind in (Kind.B, Kind.I):
            g = None if stage.is_last else self.take(Message(Payload.GRAD, s, mb),
                                                     stage_rank(s + 1, p))
            t0 = time.perf_counter()
            stage.last_backward = pipe._last_grad_action.get(s) == index
            with span:
                grad_in = stage.backward(mb, g, split=a.kind == Kind.I)
            if s > 0:
                self.give(Message(Payload.GRAD, s - 1, mb), grad_in, stage_rank(s - 1, p))
        else:
            t0 = time.perf_counter()
            stage.last_backward = pipe._last_grad_action.get(s) == index
            with span:
                stage.backward_weight(mb)
        stage.last_backward = False
        self.events.append((a.kind, s, mb, t0, time.perf_counter()))

    def _check_out_shape(self, s: int, mb: int, out: torch.Tensor) -> None:
        meta = (tuple(out.shape), out.dtype)
        known = self.shapes.get(("out", s, mb))
        if known is None and self.header_mode:
            self.shapes[("out", s, mb)] = meta
        elif known != meta:
            raise ValueError(f"pp Pipeline.step: stage {s} micro-batch {mb} output is "
                             f"{meta} but was {known} in an earlier step with the same input "
                             "shapes; stages must have shapes determined by the input shapes")
