"""``build_schedule``: build a schedule's per-rank compute order, lower it (insert the sends and
receives), validate it (compute order and memory, ``overlap.pp.check``) and prove its plans
deadlock-free under NCCL's ordering rules (``overlap.pp.programs``)."""

from __future__ import annotations

from overlap.pp.check import check_schedule
from overlap.pp.programs import check_all
from overlap.pp.schedules import SCHEDULE_NAMES, SCHEDULES, PipelineSchedule, lower, schedule_key
from overlap.defaults import positive_int

__all__ = ["build_schedule"]


def build_schedule(name: str, *, pp_size: int, num_microbatches: int,
                   num_virtual: int = 1) -> PipelineSchedule:
    """Build, lower and validate a schedule; raises ValueError naming the bad argument.
    ``name``: ``gpipe``, ``1f1b``, ``interleaved`` or ``zb-h1``, or a key of ``SCHEDULES``, in
    any case; the result's ``name`` is the key."""
    key = schedule_key(name)
    if key is None:
        raise ValueError(f"pp build_schedule: unknown schedule {name!r}; expected one of "
                         f"{list(SCHEDULE_NAMES)} (or {sorted(SCHEDULES)}), in any case")
    name = key
    for arg, val in (("pp_size", pp_size), ("num_microbatches", num_microbatches),
                     ("num_virtual", num_virtual)):
        positive_int(val, f"pp build_schedule({name}): {arg}")
    if num_virtual > 1 and name != "interleaved_1f1b":
        raise ValueError(f"pp build_schedule({name}): num_virtual={num_virtual} needs "
                         "'interleaved_1f1b'; the other schedules run one chunk per rank")
    if num_microbatches < pp_size:
        raise ValueError(f"pp build_schedule({name}): num_microbatches={num_microbatches} must "
                         f"be >= pp_size={pp_size}, else some stages idle the whole step")
    if name == "interleaved_1f1b" and num_microbatches % pp_size:
        raise ValueError(f"pp build_schedule({name}): num_microbatches={num_microbatches} must "
                         f"be a multiple of pp_size={pp_size} (micro-batches sweep the chunks "
                         f"in groups of pp_size)")
    compute = SCHEDULES[name](pp_size, num_microbatches, num_virtual)
    num_stages = pp_size * num_virtual
    actions = lower(compute, pp_size, num_stages)
    peak = check_schedule(actions, pp_size=pp_size, num_stages=num_stages,
                    num_microbatches=num_microbatches, name=name)
    schedule = PipelineSchedule(name=name, pp_size=pp_size, num_virtual=num_virtual,
                                num_microbatches=num_microbatches,
                                actions=tuple(tuple(a) for a in actions),
                                peak_live_activations=tuple(peak))
    check_all(schedule)  # the executor's plans under NCCL's ordering rules
    return schedule
