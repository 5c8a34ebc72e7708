"""Pipeline schedules as data: per-rank lists of actions, built by a function, then validated.

Legend: ``p`` pipeline ranks, ``v`` virtual stages (model chunks) per rank, ``S = v*p`` stages,
``m`` micro-batches; stage ``s`` lives on pp rank ``s % p``.
Compute kinds (``Action.kind``): ``F`` forward (with the loss on the last stage), ``B`` full
backward, ``I`` / ``W`` input- / weight-gradient halves of a split backward (W after its I).
Comm kinds, inserted only by :func:`lower`: ``SEND_F`` / ``RECV_F`` (stage s's output to the
rank of s+1 / its input from the rank of s-1), ``SEND_B`` / ``RECV_B`` (the gradient of s's
input to the rank of s-1 / of s's output from the rank of s+1).

Contract: on every ordered rank pair receives are posted in the sender's order, and a schedule
from ``build_schedule`` has passed :func:`overlap.pp.check.check_schedule` and
:func:`overlap.pp.programs.check_nccl_order`, so no rank can deadlock, even on NCCL.

The narrative: docs/design/pp.md.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, NamedTuple

__all__ = ["Action", "Kind", "Message", "Payload", "PipelineSchedule", "SCHEDULES",
           "SCHEDULE_NAMES", "SCHEDULE_ALIASES", "schedule_key", "lower",
           "stage_rank", "messages", "message_of", "msg_src_dst",
           "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "COMPUTE_KINDS", "COMM_KINDS"]


class Kind(enum.StrEnum):
    """What an action does (see the module docstring). A ``StrEnum``: each member equals its
    one-word name, so schedules written as text ("F", "SEND_B") and tables keyed by it agree."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the zero-bubble papers' name for the input-gradient half
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __repr__(self) -> str:  # as the text it equals, in messages and tuples
        return repr(self.value)


class Payload(enum.StrEnum):
    """What a pipeline message carries."""

    ACT = "act"  # a stage's output activation, to the next stage
    GRAD = "grad"  # the gradient of a stage's input, to the previous stage

    def __repr__(self) -> str:
        return repr(self.value)


class Message(NamedTuple):
    """One tensor between stages: its payload, the stage that receives it, the micro-batch."""

    payload: Payload
    stage: int
    microbatch: int

    def __repr__(self) -> str:  # ('act', 1, 0): short, in schedule errors and NCCL-order proofs
        return repr(tuple(self))


COMPUTE_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W)
COMM_KINDS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's program. ``peer`` is the pp rank at the other end (comm only)."""

    kind: Kind
    stage: int
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))  # "F" and Kind.F alike; others refused

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind}{self.microbatch}s{self.stage}"
        arrow = "->" if self.kind.startswith("SEND") else "<-"
        return f"{self.kind}{self.microbatch}s{self.stage}{arrow}{self.peer}"


def stage_rank(stage: int, pp_size: int) -> int:
    """The pp rank that owns ``stage`` (looping placement)."""
    return stage % pp_size


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """A validated schedule: ``actions[r]`` is pp rank r's program (compute and comm)."""

    name: str
    pp_size: int
    num_virtual: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    peak_live_activations: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.num_virtual

    @property
    def split_backward(self) -> bool:
        return any(a.kind == "I" for a in self.actions[0])

    def stages_of(self, rank: int) -> list[int]:
        return [rank + j * self.pp_size for j in range(self.num_virtual)]

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]



# --------------------------------------------------------------------------- builders
# Each returns compute actions only: list (per pp rank) of list of Action.

def gpipe(pp_size: int, num_microbatches: int, num_virtual: int = 1) -> list[list[Action]]:
    """All forwards, then all backwards: peak live activations = m on every rank."""
    p, m = pp_size, num_microbatches
    return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
            for r in range(p)]


def one_f_one_b(pp_size: int, num_microbatches: int, num_virtual: int = 1) -> list[list[Action]]:
    """p-r-1 warm-up forwards, then alternate F and B: peak live = p - r <= p on rank r."""
    p, m = pp_size, num_microbatches
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        prog = [Action("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            prog += [Action("F", r, warm + i), Action("B", r, i)]
        prog += [Action("B", r, i) for i in range(m - warm, m)]
        out.append(prog)
    return out


def interleaved_1f1b(pp_size: int, num_microbatches: int,
                     num_virtual: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (v chunks per rank, m a multiple of p).

    Forward unit k (of m*v) on rank r runs chunk ``(k mod pv) div p`` for micro-batch
    ``(k div pv)*p + k mod p``: groups of p micro-batches sweep through the chunks in order.
    Backward units sweep the chunks in reverse. Rank r warms up with ``2(p-r-1) + (v-1)p``
    forward units, then alternates, so its ideal bubble shrinks v-fold versus 1F1B.
    """
    p, m, v = pp_size, num_microbatches, num_virtual
    if v == 1:
        return one_f_one_b(p, m)
    total = m * v

    def unit(r: int, k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        if not forward:
            chunk = v - 1 - chunk
        return chunk * p + r, (k // (p * v)) * p + k % p

    out = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        prog = [Action("F", *unit(r, k, True)) for k in range(warm)]
        for i in range(total - warm):
            prog += [Action("F", *unit(r, warm + i, True)), Action("B", *unit(r, i, False))]
        prog += [Action("B", *unit(r, k, False)) for k in range(total - warm, total)]
        out.append(prog)
    return out


def zb_h1(pp_size: int, num_microbatches: int, num_virtual: int = 1) -> list[list[Action]]:
    """Zero-bubble H1: 1F1B's forward order with the backward split into I then W.

    Rank r delays each W by r slots (W of micro-batch i runs after I of micro-batch i+r), so
    every rank keeps p micro-batches in flight, the same peak as 1F1B on rank 0, while I passes
    (the only backward work on the critical path) reach upstream ranks sooner; the delayed W
    passes fill the tail. With equal F, I, W times the bubble is (p-1)/(3m + p-1) of the step
    instead of 1F1B's (p-1)/(m + p-1).
    """
    p, m = pp_size, num_microbatches
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        prog = [Action("F", r, i) for i in range(warm)]
        w_next = 0
        for i in range(m):
            if warm + i < m:
                prog.append(Action("F", r, warm + i))
            prog.append(Action("I", r, i))
            if i - w_next >= r:
                prog.append(Action("W", r, w_next))
                w_next += 1
        prog += [Action("W", r, i) for i in range(w_next, m)]
        out.append(prog)
    return out


SCHEDULES: dict[str, Callable[..., list[list[Action]]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "zb_h1": zb_h1,
}

# Each schedule's one spelling for people (overlap-train/-plan --schedule, the planner's tables,
# checkpoint metadata) -> its key above. Either is accepted wherever a schedule is named, in
# any case, with "-" or "_".
SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b",
                  "zb-h1": "zb_h1"}
SCHEDULE_ALIASES = {key: name for name, key in SCHEDULE_NAMES.items() if key != name}


def schedule_key(name: str) -> str | None:
    """The SCHEDULES key of ``name`` in any accepted spelling, or None if it names none."""
    if not isinstance(name, str):
        return None
    folded = name.strip().lower().replace("_", "-")
    return next((key for spelled, key in SCHEDULE_NAMES.items()
                 if folded in (spelled, key.replace("_", "-"))), None)


# --------------------------------------------------------------------------- lowering

def messages(a: Action, num_stages: int) -> tuple[Message | None, Message | None]:
    """(message this compute consumes, message it produces)."""
    s, mb = a.stage, a.microbatch
    if a.kind == Kind.F:
        consumed = Message(Payload.ACT, s, mb) if s > 0 else None
        produced = Message(Payload.ACT, s + 1, mb) if s < num_stages - 1 else None
    elif a.kind in (Kind.B, Kind.I):
        consumed = Message(Payload.GRAD, s, mb) if s < num_stages - 1 else None
        produced = Message(Payload.GRAD, s - 1, mb) if s > 0 else None
    else:
        consumed = produced = None
    return consumed, produced


def msg_src_dst(msg: Message, pp_size: int) -> tuple[int, int]:
    """(sending rank, receiving rank) of ``msg``."""
    if msg.payload == Payload.ACT:
        return stage_rank(msg.stage - 1, pp_size), stage_rank(msg.stage, pp_size)
    return stage_rank(msg.stage + 1, pp_size), stage_rank(msg.stage, pp_size)


def message_of(a: Action) -> Message:
    """The message a SEND/RECV action transfers."""
    payload, stage = {Kind.SEND_F: (Payload.ACT, a.stage + 1),
                      Kind.RECV_F: (Payload.ACT, a.stage),
                      Kind.SEND_B: (Payload.GRAD, a.stage - 1),
                      Kind.RECV_B: (Payload.GRAD, a.stage)}[a.kind]
    return Message(payload, stage, a.microbatch)


def lower(compute: list[list[Action]], pp_size: int, num_stages: int) -> list[list[Action]]:
    """Insert SEND/RECV actions (see the module docstring for the placement rule)."""
    p = pp_size
    # Send order of every channel (src, dst) = program order of the producers on src.
    channel: dict[tuple[int, int], list[Message]] = {}
    for src in range(p):
        for a in compute[src]:
            msg = messages(a, num_stages)[1]
            if msg is not None:
                s, d = msg_src_dst(msg, p)
                if s != d:
                    channel.setdefault((s, d), []).append(msg)
    out = []
    for dst in range(p):
        deadline = {}
        for i, a in enumerate(compute[dst]):
            msg = messages(a, num_stages)[0]
            if msg is not None:
                deadline[msg] = i
        post_at: dict[int, list[Action]] = {}
        for (src, d), msgs in channel.items():
            if d != dst:
                continue
            missing = [m_ for m_ in msgs if m_ not in deadline]
            if missing:
                raise ValueError(f"pp lower: rank {src} sends {missing[0]} to rank {dst}, "
                                 "which never consumes it")
            # One compute ahead of the consumer, but never after a later message of the
            # same channel (the suffix minimum keeps receives in the channel's send order).
            pos, positions = len(compute[dst]), []
            for msg in reversed(msgs):
                pos = min(pos, max(deadline[msg] - 1, 0))
                positions.append(pos)
            for msg, pos in zip(msgs, reversed(positions)):
                kind = Kind.RECV_F if msg.payload == Payload.ACT else Kind.RECV_B
                post_at.setdefault(pos, []).append(Action(kind, msg.stage, msg.microbatch,
                                                          peer=src))
        prog: list[Action] = []
        for i, a in enumerate(compute[dst]):
            prog += post_at.get(i, [])
            prog.append(a)
            msg = messages(a, num_stages)[1]
            if msg is not None:
                src_, d = msg_src_dst(msg, p)
                if src_ != d:
                    act = msg.payload == Payload.ACT
                    stage = msg.stage - 1 if act else msg.stage + 1
                    kind = Kind.SEND_F if act else Kind.SEND_B
                    prog.append(Action(kind, stage, msg.microbatch, peer=d))
        out.append(prog)
    return out
