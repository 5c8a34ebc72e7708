"""What a pipeline rank posts, waits for and computes, step by step, and a proof that it cannot
deadlock under NCCL's ordering rules, with the expert-parallel (EP) collectives in it.

The executor runs exactly the steps :func:`rank_plan` returns and :func:`check_nccl_order`
simulates them on every rank (``NcclOrderDeadlock`` if any could hang). A channel
``(src, dst)`` is one direction of one link, a communicator of its own. Steps:
``("post", channel, items)`` posts one batch, items ``(part, msg, is_send)`` with part "hdr"
or "data" and msg ``(kind, stage of the receiver, micro-batch)``; ``("wait", (part, msg))``
blocks until the batch holding that receive completes; ``("compute", action)``;
``("pair", a, b, b_inputs, a_sends)`` runs two actions that hand the host to each other at
every EP wait (:mod:`overlap.pp.interleave`), b after its input steps, a then its sends;
``("end",)`` waits for every posted batch. ``header_mode=True``: a first step with new shapes.
The narrative: docs/design/pp.md.
"""

from __future__ import annotations

import collections
from typing import Callable, Literal, Mapping

from overlap.pp.check import DEFAULT_COSTS, ScheduleError
from overlap.pp.schedules import (Action, Kind, Payload, PipelineSchedule, message_of, messages,
                                   msg_src_dst)

__all__ = ["rank_plan", "channels_of", "check_nccl_order", "check_all", "check_plans",
           "NcclOrderDeadlock", "ep_pairs", "candidate_pairs", "expand", "DEFAULT_EP_OPS"]

Channels = Literal["per_direction", "single"]
# EP collectives (host waits) per compute action of a stage with MoE layers, for the proof: the
# order argument does not depend on the count, and the tests run several.
DEFAULT_EP_OPS: Mapping[str, int] = {"F": 2, "B": 2, "I": 2, "W": 0}


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


def candidate_pairs(schedule: PipelineSchedule, rank: int) -> list[tuple[Action, Action]]:
    """Adjacent compute actions of rank ``rank`` that may overlap: a forward next to a backward
    (B, I or W) of another micro-batch, in program order (one action may be in two)."""
    comp = [a for a in schedule.actions[rank] if a.is_compute]
    out = []
    for a, b in zip(comp, comp[1:]):
        kinds = {a.kind, b.kind}
        if Kind.F in kinds and kinds & {Kind.B, Kind.I, Kind.W} and a.microbatch != b.microbatch:
            out.append((a, b))
    return out


# The EP time of an action, as a fraction of its compute, in the cost model that picks pairs
# (overlap.plan models it per layout; only the sign of a pair's gain depends on it here).
EP_FRACTION = 0.5


def _units(schedule: PipelineSchedule, pairs) -> list[list[tuple]]:
    out = []
    for r in range(schedule.pp_size):
        second = {a: b for a, b in pairs[r]}
        paired = set(second.values())
        out.append([(a, second[a]) if a in second else (a,)
                    for a in schedule.actions[r] if a.is_compute and a not in paired])
    return out


def _makespan(schedule: PipelineSchedule, pairs, costs=DEFAULT_COSTS,
              ep_fraction: float = EP_FRACTION) -> float:
    """The step's length in a cost model (compute ``costs`` per kind; the EP all-to-alls of a
    F, B or I take ``ep_fraction`` of its compute, a W has none; exposed unless paired, when
    each hides under the other action's compute); inf if a pair waits on its own outputs."""
    p, num_stages = schedule.pp_size, schedule.num_stages
    units = _units(schedule, pairs)
    ready: dict = {}
    free, pc = [0.0] * p, [0] * p
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pc[r] < len(units[r]):
                unit = units[r][pc[r]]
                need = [messages(a, num_stages)[0] for a in unit]
                if any(m is not None and m not in ready for m in need):
                    break
                start = max([free[r]] + [ready[m] for m in need if m is not None])
                if len(unit) == 2 and unit[0].kind == Kind.W:
                    unit = (unit[1], unit[0])  # run as the executor does: the forward first
                c = [costs[str(a.kind)] for a in unit]
                e = [0.0 if a.kind == Kind.W else ep_fraction * x for a, x in zip(unit, c)]
                if len(unit) == 1:
                    ends = [start + c[0] + e[0]]
                else:
                    end = start + c[0] + c[1] + max(0.0, e[0] - c[1]) + max(0.0, e[1] - c[0])
                    ends = [start + c[0] + min(e[0], c[1]), end]
                for a, t in zip(unit, ends):
                    produced = messages(a, num_stages)[1]
                    if produced is not None:
                        ready[produced] = t
                free[r] = max(ends)
                pc[r] += 1
                progressed = True
    if any(pc[r] < len(units[r]) for r in range(p)):
        return float("inf")
    return max(free)


def _disjoint(pairs) -> list:
    used: set = set()
    out = []
    for a, b in pairs:
        if a not in used and b not in used:
            used |= {a, b}
            out.append((a, b))
    return out


def ep_pairs(schedule: PipelineSchedule, *, ep_fraction: float = EP_FRACTION
             ) -> tuple[tuple[tuple[Action, Action], ...], ...]:
    """Per rank, the pairs the executor overlaps: the set with the shortest step in the cost
    model of :func:`_makespan` (a pair whose second action waits for a neighbour's output
    can cost more than it hides) among a few families (backward then forward, forward then
    backward, weight pass next to a forward, any), each made feasible and extended one pair at
    a time; proven by :func:`check_all`. No pairs if none shortens the step."""
    p = schedule.pp_size
    cands = [candidate_pairs(schedule, r) for r in range(p)]

    def cost(pairs) -> float:
        return _makespan(schedule, pairs, ep_fraction=ep_fraction)

    families = [lambda a, b: a.kind != Kind.F, lambda a, b: a.kind == Kind.F,
                lambda a, b: Kind.W in (a.kind, b.kind), lambda a, b: True]
    best, best_t = [[] for _ in range(p)], cost([[] for _ in range(p)])
    for keep in families:
        pairs = [_disjoint([pr for pr in cands[r] if keep(*pr)]) for r in range(p)]
        t = cost(pairs)
        while t == float("inf"):  # a pair waits on its own outputs: drop the highest stage's
            r = max(r for r in range(p) if pairs[r])
            pairs[r].pop(0)
            t = cost(pairs)
        for r in range(p):  # add the free candidates that help
            for pr in cands[r]:
                used = {x for q in pairs[r] for x in q}
                if pr[0] in used or pr[1] in used:
                    continue
                pairs[r].append(pr)
                pairs[r].sort(key=cands[r].index)
                t2 = cost(pairs)
                if t2 < t - 1e-9:
                    t = t2
                else:
                    pairs[r].remove(pr)
        if t < best_t - 1e-9:
            best, best_t = pairs, t
    check_all(schedule, pairs=best)
    return tuple(tuple(prs) for prs in best)


def rank_plan(schedule: PipelineSchedule, rank: int, *, header_mode: bool,
              channels: Channels = "per_direction",
              pairs: tuple[tuple[Action, Action], ...] | list = ()) -> list[tuple]:
    """The steps of rank ``rank`` for one pipeline step (see the module docstring). ``pairs``
    (from :func:`ep_pairs`): adjacent compute actions run as one ``pair`` step; the receives
    between them are posted before it, the sends between them after it."""
    p, num_stages = schedule.pp_size, schedule.num_stages
    steps: list[tuple] = []
    pending: list[Action] = []
    deferred: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    posted: set[tuple] = set()

    def flush() -> None:
        steps.extend(posts())

    def posts() -> list[tuple]:
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
        pending.clear()
        return [("post", c, tuple(items)) for c, items in batches.items()]

    def inputs(a: Action) -> list[tuple]:
        out: list[tuple] = []
        consumed = messages(a, num_stages)[0]
        if consumed is None:
            return out
        src, dst = msg_src_dst(consumed, p)
        if src == dst:
            return out
        c = ("pp",) if channels == "single" else (src, dst)
        while consumed not in posted:
            if not deferred[c]:
                raise NcclOrderDeadlock(f"pp schedule {schedule.name}: rank {rank} consumes "
                                        f"{consumed} but never posts its receive")
            m = deferred[c].popleft()
            if m.payload == Payload.ACT:
                out += [("post", c, (("hdr", m, False),)), ("wait", ("hdr", m))]
            out.append(("post", c, (("data", m, False),)))
            posted.add(m)
        out.append(("wait", ("data", consumed)))
        return out

    second = {a: b for a, b in pairs}
    program = schedule.actions[rank]
    i = 0
    while i < len(program):
        a = program[i]
        if not a.is_compute:
            pending.append(a)
            i += 1
            continue
        if a not in second:
            flush()
            steps += inputs(a)
            steps.append(("compute", a))
            i += 1
            continue
        j = program.index(second[a], i + 1)
        between = program[i + 1:j]
        if any(x.is_compute for x in between):
            raise ScheduleError(f"pp schedule {schedule.name}: rank {rank} pairs {a} with "
                                f"{second[a]}, which is not the next compute action")
        flush()
        if a.kind == Kind.W:
            # A weight pass has no EP wait and no input: the forward runs first, and the weight
            # pass fills its first wait; the forward's sends (after it) go when it ends.
            fwd = program[j]
            steps += inputs(fwd)
            pending.extend(between)
            flush()
            k = j + 1
            while k < len(program) and program[k].kind.startswith("SEND"):
                pending.append(program[k])
                k += 1
            steps.append(("pair", fwd, a, (), tuple(posts())))
            i = k
            continue
        steps += inputs(a)
        # Receives placed between the two go in batches of their own: a batch completes as a
        # whole, and theirs may need the pair's own outputs first.
        pending.extend(x for x in between if not x.kind.startswith("SEND"))
        flush()
        # The second action waits for its input when it first gets the host (at the first
        # action's first EP wait), so the transfer runs under the first action's compute; the
        # first action's sends go as soon as it ends (the next stage need not wait for the
        # second), ahead of the second's sends on every channel whichever ends first.
        b_inputs = tuple(inputs(second[a]))
        pending.extend(x for x in between if x.kind.startswith("SEND"))
        steps.append(("pair", a, second[a], b_inputs, tuple(posts())))
        i = j + 1
    flush()
    steps.append(("end",))
    return steps


def expand(steps: list[tuple], ep_ops: Callable[[Action], int] | None) -> list[tuple]:
    """``steps`` with each compute's EP collectives made explicit (``("ep_post", label)`` then
    ``("ep_wait", label)``, label ``(action, k)``) and each pair flattened in the order the
    executor's interleaver runs it: an action runs until an EP wait, then the other one runs
    until its next one (a finished action hands over for good)."""
    def ops(a: Action) -> list[tuple]:
        out: list[tuple] = []
        for k in range(ep_ops(a) if ep_ops is not None else 0):
            out += [("ep_post", (a, k)), ("switch",), ("ep_wait", (a, k))]
        return out + [("compute", a)]

    flat: list[tuple] = []
    for st in steps:
        if st[0] == "compute":
            flat += [x for x in ops(st[1]) if x[0] != "switch"]
            continue
        if st[0] != "pair":
            flat.append(st)
            continue
        tasks = [collections.deque([*ops(st[1]), *st[4]]),
                 collections.deque([*st[3], *ops(st[2])])]
        turn = 0
        while tasks[0] or tasks[1]:
            if not tasks[turn]:
                turn = 1 - turn
            x = tasks[turn].popleft()
            if x[0] != "switch":
                flat.append(x)
            elif tasks[1 - turn]:
                turn = 1 - turn
    return flat


def _stage_ops(ep_ops: Mapping[str, int], moe_stages) -> Callable[[Action], int]:
    def n(a: Action) -> int:
        return ep_ops.get(str(a.kind), 0) if moe_stages is None or a.stage in moe_stages else 0
    return n


def check_nccl_order(schedule: PipelineSchedule, *, header_mode: bool | tuple[bool, ...],
                     channels: Channels = "per_direction", pairs=None,
                     ep_ops: Mapping[str, int] | None = None, moe_stages=None) -> None:
    """Simulate every rank's plan under NCCL's rules; raise NcclOrderDeadlock if it can hang.

    ``header_mode`` may be a tuple: one pipeline replica per entry, each in that mode (the
    replicas of a data-parallel job learn shapes independently). With ``ep_ops`` (EP waits
    per compute kind, on ``moe_stages`` or every stage) the same pp rank of every replica shares
    one EP communicator; see :func:`check_plans` for the rules."""
    p = schedule.pp_size
    modes = header_mode if isinstance(header_mode, tuple) else (header_mode,)
    count = _stage_ops(ep_ops, moe_stages) if ep_ops is not None else None
    plans = {(g, r): expand(rank_plan(schedule, r, header_mode=mode, channels=channels,
                                      pairs=pairs[r] if pairs else ()), count)
             for g, mode in enumerate(modes) for r in range(p)}
    mode = "/".join("header mode" if m else "steady state" for m in modes)
    check_plans(plans, where=(f"pp schedule {schedule.name} (p={p}, "
                              f"m={schedule.num_microbatches}, v={schedule.num_virtual}, "
                              f"{channels} channels, {mode})"))


def check_plans(plans: dict[tuple[int, int], list[tuple]], *, where: str) -> None:
    """Simulate expanded plans keyed (replica, pp rank) under NCCL's rules.

    Rules: per (replica, rank, channel) one batch at a time in post order; a batch starts when
    it heads its queue and completes when every item has been transferred; an item transfers
    once the sender's and the receiver's batches holding it have both started (rendezvous: no
    send completes before its receive has started). The EP communicator of pp rank r joins
    rank r of every replica: its n-th operation completes once every member has posted its n-th
    operation, with the same label (a different one is an NCCL mismatch: a hang or corrupt
    data), and operation n-1 has completed. Hosts never block on a post, only on a wait and at
    the end. Compute takes no time: only the order matters."""
    keys = sorted(plans)
    replicas = {g for g, _ in keys}
    pc = {k: 0 for k in keys}
    queues: dict[tuple, collections.deque] = {}
    ops: list[dict] = []
    where_item: dict[tuple, dict[bool, int]] = collections.defaultdict(dict)
    open_ops = {k: 0 for k in keys}
    recv_op: dict[tuple, dict[tuple, int]] = {k: {} for k in keys}
    ep_posted: dict[int, dict[int, list]] = collections.defaultdict(
        lambda: collections.defaultdict(list))  # pp rank -> replica -> labels
    ep_done: dict[int, int] = collections.defaultdict(int)  # pp rank -> completed ops

    def head(op_id: int) -> bool:
        op = ops[op_id]
        return op["done"] or queues[(op["key"], op["channel"])][0] == op_id

    def name(k) -> str:
        return f"rank {k[1]}" if len(replicas) == 1 else f"replica {k[0]} rank {k[1]}"

    changed = True
    while changed:
        changed = False
        for k in keys:
            plan = plans[k]
            while pc[k] < len(plan):
                step = plan[pc[k]]
                if step[0] == "post":
                    op_id = len(ops)
                    ops.append({"key": k, "channel": step[1], "items": step[2], "done": False})
                    queues.setdefault((k, step[1]), collections.deque()).append(op_id)
                    for part, msg, is_send in step[2]:
                        where_item[(k[0], part, msg)][is_send] = op_id
                        if not is_send:
                            recv_op[k][(part, msg)] = op_id
                    open_ops[k] += 1
                elif step[0] == "wait":
                    if not ops[recv_op[k][step[1]]]["done"]:
                        break
                elif step[0] == "ep_post":
                    ep_posted[k[1]][k[0]].append(step[1])
                elif step[0] == "ep_wait":
                    if ep_done[k[1]] <= ep_posted[k[1]][k[0]].index(step[1]):
                        break
                elif step[0] == "end" and open_ops[k]:
                    break
                pc[k] += 1
                changed = True
        for (k, _), q in queues.items():
            while q:
                op = ops[q[0]]
                sides = [where_item[(k[0], part, msg)] for part, msg, _ in op["items"]]
                if not all(len(s) == 2 and head(s[True]) and head(s[False]) for s in sides):
                    break
                op["done"] = True
                q.popleft()
                open_ops[k] -= 1
                changed = True
        for r, by_replica in ep_posted.items():
            while all(len(by_replica[g]) > ep_done[r] for g in replicas):
                labels = {g: by_replica[g][ep_done[r]] for g in replicas}
                if len(set(labels.values())) > 1:
                    raise NcclOrderDeadlock(
                        f"{where}: EP order mismatch on the EP communicator of pp rank {r}: "
                        f"its operation {ep_done[r]} is "
                        + ", ".join(f"{_label(v)} on replica {g}" for g, v in labels.items())
                        + " (NCCL matches collectives by position: this hangs or mixes data)")
                ep_done[r] += 1
                changed = True
    stuck = {k: plans[k][pc[k]] for k in keys if pc[k] < len(plans[k])}
    if stuck:
        lines = []
        for k, step in stuck.items():
            heads = [f"channel {c}: {_describe(ops[q[0]])}" for (kk, c), q in queues.items()
                     if kk == k and q]
            lines.append(f"{name(k)} blocked at {_describe_step(step)}; its communicators are "
                         f"at {'; '.join(heads) or 'nothing'}")
        raise NcclOrderDeadlock(
            f"{where}: deadlock under NCCL ordering (one batch at a time per communicator, "
            "rendezvous sends): " + " | ".join(lines))


def _label(label: tuple) -> str:
    a, k = label
    return f"EP op {k} of {a}"


def _describe(op: dict) -> str:
    return "{" + ", ".join(f"{'send' if s else 'recv'} {part} {msg}"
                           for part, msg, s in op["items"]) + "}"


def _describe_step(step: tuple) -> str:
    if step[0] == "post":
        return f"post {step[1]}"
    if step[0] == "wait":
        return f"wait for {step[1]}"
    if step[0] == "ep_wait":
        return f"wait for {_label(step[1])}"
    return "the end of the step (waiting for its sends)"


def check_all(schedule: PipelineSchedule, channels: Channels = "per_direction", *,
              pairs=None, ep_ops: Mapping[str, int] | None = None) -> None:
    """Every mode the executor runs: the first step with new shapes and every later one; with
    ``pairs`` also two data-parallel replicas sharing EP communicators, in equal and in
    different modes, with ``ep_ops`` EP waits per compute (``DEFAULT_EP_OPS`` if None)."""
    if not pairs and ep_ops is None:
        for header_mode in (False, True):
            check_nccl_order(schedule, header_mode=header_mode, channels=channels)
        return
    for modes in ((False, False), (True, True), (True, False)):
        check_nccl_order(schedule, header_mode=modes, channels=channels, pairs=pairs,
                         ep_ops=DEFAULT_EP_OPS if ep_ops is None else ep_ops)
