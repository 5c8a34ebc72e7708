"""What a pipeline rank posts, waits for and computes, step by step, and a proof that it cannot
deadlock under NCCL's ordering rules.

The executor interprets exactly the steps :func:`rank_plan` returns and :func:`check_nccl_order`
simulates the same steps of every rank (raising ``NcclOrderDeadlock`` if any could hang), so the
validator and the executor cannot drift apart. A channel ``(src, dst)`` is one direction of one
link, a communicator of its own (``channels="single"``: the old shared layout, for tests).

Steps (tuples): ``("post", channel, items)`` posts one batch, items ``(part, msg, is_send)``
with part "hdr" (shape header) or "data" and msg ``(kind, stage of the receiver, micro-batch)``;
``("wait", (part, msg))`` blocks until the batch holding that receive completes;
``("compute", action)`` runs a compute action; ``("end",)`` waits for every posted batch.
``header_mode=True`` gives the plan of a first step with new shapes.

The narrative: docs/design/pp.md.
"""

from __future__ import annotations

import collections
from typing import Literal

from overlap.pp.check import ScheduleError
from overlap.pp.schedules import (Action, Payload, PipelineSchedule, message_of, messages,
                                   msg_src_dst)

__all__ = ["rank_plan", "channels_of", "check_nccl_order", "check_all", "NcclOrderDeadlock"]

Channels = Literal["per_direction", "single"]


class NcclOrderDeadlock(ScheduleError):
    """The per-rank plans deadlock under NCCL's rules; the message shows where each rank is."""


def _channel(a: Action, rank: int, channels: Channels) -> tuple:
    if channels == "single":
        return ("pp",)
    return (rank, a.peer) if a.kind.startswith("SEND") else (a.peer, rank)


def channels_of(schedule: PipelineSchedule, rank: int) -> list[tuple[int, int]]:
    """The (src, dst) channels rank ``rank`` uses, in the creation order every rank agrees on
    (both ends of a channel see it in their programs)."""
    used = {_channel(a, rank, "per_direction") for a in schedule.actions[rank]
            if not a.is_compute}
    return sorted(used, key=lambda c: (min(c), max(c), c[0] != min(c)))


def rank_plan(schedule: PipelineSchedule, rank: int, *, header_mode: bool,
              channels: Channels = "per_direction") -> list[tuple]:
    """The steps of rank ``rank`` for one pipeline step (see the module docstring)."""
    p, num_stages = schedule.pp_size, schedule.num_stages
    steps: list[tuple] = []
    pending: list[Action] = []
    deferred: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    posted: set[tuple] = set()

    def flush() -> None:
        batches: dict[tuple, list] = {}
        for a in pending:
            c, msg = _channel(a, rank, channels), message_of(a)
            if a.kind.startswith("SEND"):
                items = [("hdr", msg, True)] if header_mode and a.kind == "SEND_F" else []
                items.append(("data", msg, True))
            elif header_mode:
                deferred[c].append(msg)
                continue
            else:
                items = [("data", msg, False)]
                posted.add(msg)
            batches.setdefault(c, []).extend(items)
        steps.extend(("post", c, tuple(items)) for c, items in batches.items())
        pending.clear()

    for a in schedule.actions[rank]:
        if not a.is_compute:
            pending.append(a)
            continue
        flush()
        consumed = messages(a, num_stages)[0]
        if consumed is not None:
            src, dst = msg_src_dst(consumed, p)
            if src != dst:
                c = ("pp",) if channels == "single" else (src, dst)
                while consumed not in posted:
                    if not deferred[c]:
                        raise NcclOrderDeadlock(
                            f"pp schedule {schedule.name}: rank {rank} consumes {consumed} "
                            f"but never posts its receive")
                    m = deferred[c].popleft()
                    if m.payload == Payload.ACT:
                        steps += [("post", c, (("hdr", m, False),)), ("wait", ("hdr", m))]
                    steps.append(("post", c, (("data", m, False),)))
                    posted.add(m)
                steps.append(("wait", ("data", consumed)))
        steps.append(("compute", a))
    flush()
    steps.append(("end",))
    return steps


def check_nccl_order(schedule: PipelineSchedule, *, header_mode: bool,
                     channels: Channels = "per_direction") -> None:
    """Simulate every rank's plan under NCCL's rules; raise NcclOrderDeadlock if it can hang.

    Rules: per (rank, channel) one batch at a time in post order; a batch starts when it heads
    its queue and completes when every item has been transferred; an item transfers once the
    sender's and the receiver's batches holding it have both started (rendezvous: no send
    completes before its receive has started). Hosts never block on a post, only on a wait
    (until the batch holding the receive completes) and at the end (until all their batches
    complete). Compute takes no time: only the order matters.
    """
    p = schedule.pp_size
    plans = [rank_plan(schedule, r, header_mode=header_mode, channels=channels)
             for r in range(p)]
    pc = [0] * p
    queues: dict[tuple, collections.deque] = {}
    ops: list[dict] = []
    where: dict[tuple, dict[bool, int]] = collections.defaultdict(dict)  # item -> side -> op
    open_ops = [0] * p
    recv_op: list[dict[tuple, int]] = [{} for _ in range(p)]

    def head(op_id: int) -> bool:
        op = ops[op_id]
        return op["done"] or queues[(op["rank"], op["channel"])][0] == op_id

    changed = True
    while changed:
        changed = False
        for r in range(p):
            while pc[r] < len(plans[r]):
                step = plans[r][pc[r]]
                if step[0] == "post":
                    op_id = len(ops)
                    ops.append({"rank": r, "channel": step[1], "items": step[2], "done": False})
                    queues.setdefault((r, step[1]), collections.deque()).append(op_id)
                    for part, msg, is_send in step[2]:
                        where[(part, msg)][is_send] = op_id
                        if not is_send:
                            recv_op[r][(part, msg)] = op_id
                    open_ops[r] += 1
                elif step[0] == "wait":
                    if not ops[recv_op[r][step[1]]]["done"]:
                        break
                elif step[0] == "end" and open_ops[r]:
                    break
                pc[r] += 1
                changed = True
        for (r, _), q in queues.items():
            while q:
                op = ops[q[0]]
                sides = [where[(part, msg)] for part, msg, _ in op["items"]]
                if not all(len(s) == 2 and head(s[True]) and head(s[False]) for s in sides):
                    break
                op["done"] = True
                q.popleft()
                open_ops[r] -= 1
                changed = True
    stuck = {r: plans[r][pc[r]] for r in range(p) if pc[r] < len(plans[r])}
    if stuck:
        lines = []
        for r, step in stuck.items():
            heads = [f"channel {c}: {_describe(ops[q[0]])}" for (rr, c), q in queues.items()
                     if rr == r and q]
            lines.append(f"rank {r} blocked at {_describe_step(step)}; its communicators are "
                         f"at {'; '.join(heads) or 'nothing'}")
        mode = "header mode" if header_mode else "steady state"
        raise NcclOrderDeadlock(
            f"pp schedule {schedule.name} (p={p}, m={schedule.num_microbatches}, "
            f"v={schedule.num_virtual}, {channels} channels, {mode}): deadlock under NCCL "
            "ordering (one batch at a time per communicator, rendezvous sends): "
            + " | ".join(lines))


def _describe(op: dict) -> str:
    return "{" + ", ".join(f"{'send' if s else 'recv'} {part} {msg}"
                           for part, msg, s in op["items"]) + "}"


def _describe_step(step: tuple) -> str:
    if step[0] == "post":
        return f"post {step[1]}"
    if step[0] == "wait":
        return f"wait for {step[1]}"
    return "the end of the step (waiting for its sends)"


def check_all(schedule: PipelineSchedule, channels: Channels = "per_direction") -> None:
    """Both modes the executor runs: the first step with new shapes and every later one."""
    for header_mode in (False, True):
        check_nccl_order(schedule, header_mode=header_mode, channels=channels)
