"""The layout a job continues on after losing nodes, and the emulated nodes of a local job.

``choose_layout(cfg, world_size, ranks_per_node=, profile=)`` tries every tp x cp x pp x dp
(x ep) of the surviving ranks that the job can run (``TrainConfig.validate``, tp inside a node)
and ranks them: the global batch kept (more micro-batches per dp rank: gradient accumulation)
before a changed one; dp changed alone before tp, cp, pp or ep change; then the planner's step
time (``overlap.plan.search.rank_layouts`` with the device profile), among those that fit its
memory. Pure and deterministic: every rank computes the same choice without communicating.

A local job's nodes are groups of ``--ranks-per-node`` consecutive ranks. With ``--min-nodes``
the launcher presumes the node of a rank that died (exited without a result) lost and writes
``<save>/.nodes/down_<id>``; the node counts as back once that file is removed (what a health
check would report; ``nodes_down``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from overlap.train.config import ConfigError, TrainConfig

__all__ = ["Choice", "choose_layout", "layout_name", "describe_layout", "layout_dict",
           "load_profile", "mark_node_down", "nodes_down"]

_DEGREES = ("tp", "cp", "pp", "ep")


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    cfg: TrainConfig           # the job's settings on the new layout
    step_time_s: float         # the planner's estimate for it
    batch_kept: bool           # global batch unchanged (else ``changes`` says how)
    changes: tuple[str, ...]   # what changed besides the degrees, as sentences
    ranked: int                # candidates that were valid and fit
    rejected: int              # candidates the job or the planner refused


def load_profile(name_or_path: str):
    """``overlap.plan.profiles.load_profile``: a GPU name of ``overlap-plan`` or the path of a
    profile JSON. Imported on the call: the planner's imports are ~80 ms that a rank of a job
    without --min-nodes never needs."""
    from overlap.plan.profiles import load_profile as load

    return load(name_or_path)


def global_batch(cfg: TrainConfig) -> int:
    return cfg.dp * cfg.micro_batches * cfg.micro_batch_size


def layout_dict(cfg: TrainConfig) -> dict:
    return {"tp": cfg.tp, "cp": cfg.cp, "pp": cfg.pp, "dp": cfg.dp, "ep": cfg.ep,
            "ranks": cfg.world_size, "micro_batches": cfg.micro_batches,
            "micro_batch_size": cfg.micro_batch_size, "global_batch": global_batch(cfg)}


def layout_name(cfg: TrainConfig) -> str:
    return describe_layout(layout_dict(cfg))


def describe_layout(d: dict) -> str:
    """``layout_dict``'s dict in words: "tp2 x pp2 x dp2 (8 ranks, 4 micro-batches of 4)"."""
    degrees = " x ".join(f"{k}{d[k]}" for k in ("tp", "cp", "pp", "dp")
                         if k != "cp" or d[k] > 1)
    ep = f" ep{d['ep']}" if d["ep"] > 1 else ""
    ranks = f"{d['ranks']} rank{'s' if d['ranks'] > 1 else ''}"
    return f"{degrees}{ep} ({ranks}, {d['micro_batches']} micro-batches of " \
           f"{d['micro_batch_size']})"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_splits(cfg: TrainConfig, dp: int) -> list[tuple[int, int]]:
    """(micro_batches, micro_batch_size) per dp rank, best first: the global batch kept with
    the micro-batch size kept, then smaller micro-batches; if dp does not divide the global
    batch, the largest smaller batch at the same micro-batch size."""
    g = global_batch(cfg)
    if g % dp == 0:
        per = g // dp
        return [(per // m, m) for m in sorted(_divisors(per), reverse=True)
                if m <= cfg.micro_batch_size]
    return [(max(1, g // (dp * cfg.micro_batch_size)), cfg.micro_batch_size)]


def _layout_only(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` without what ``validate`` checks apart from the layout: the elastic flags (the
    job is already elastic) and the files (data, checkpoints), which the job's own validation
    read once and which no layout changes."""
    return dataclasses.replace(cfg, min_nodes=0, grow_back=False, data=None, save=None,
                               resume=None, export=None, max_restarts=0)


def _candidates(cfg: TrainConfig, world: int, rpn: int) -> tuple[list[TrainConfig], list[str]]:
    """Every runnable configuration on ``world`` ranks (first valid batch split per layout),
    and why the others cannot run."""
    out, refused = [], []
    for tp in (t for t in _divisors(world) if t <= rpn):
        for cp in _divisors(world // tp):
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                eps = ([e for e in _divisors(dp * cp) if cfg.moe_experts % e == 0]
                       if cfg.moe_experts else [1])
                for ep in eps:
                    why = None
                    for mb, mbs in _batch_splits(cfg, dp):
                        new = dataclasses.replace(
                            cfg, tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, micro_batches=mb,
                            micro_batch_size=mbs, ranks_per_node=rpn)
                        try:
                            _layout_only(new).validate()
                        except ConfigError as exc:
                            why = str(exc)
                            continue
                        out.append(new)
                        break
                    else:
                        refused.append(why)
    return out, refused


def choose_layout(cfg: TrainConfig, world_size: int, *, ranks_per_node: int,
                  profile=None) -> Choice:
    """The layout to continue ``cfg``'s job on ``world_size`` ranks (see the module doc).
    Raises ConfigError when no layout of the job runs on them."""
    from overlap.plan.hardware import ClusterSpec
    from overlap.plan.search import rank_layouts
    from overlap.plan.selfpredict import plan_inputs

    rpn = min(ranks_per_node, world_size)
    device = profile if profile is not None else load_profile(cfg.plan_profile)
    cluster = ClusterSpec(device=device, num_gpus=world_size, gpus_per_node=rpn)
    configs, refused = _candidates(cfg, world_size, rpn)
    scored = []
    for new in configs:
        model, layout = plan_inputs(new)
        result = rank_layouts(model, cluster, [layout])
        if not result.ranked:
            refused.append(f"the planner: {result.rejected[0][1]}")
            continue
        t = result.ranked[0].step_time_s
        batch_kept = global_batch(new) == global_batch(cfg)
        mp_changed = any(getattr(new, k) != getattr(cfg, k) for k in _DEGREES)
        scored.append(((not batch_kept, mp_changed, t, new.tp, new.pp), new, t, batch_kept))
    if not scored:
        seen = sorted(set(refused), key=lambda w: (not w.startswith("the planner"), w))
        raise ConfigError(f"no layout of this job runs on {world_size} ranks ({rpn} per node, "
                          f"planner profile {cfg.plan_profile}): {len(refused)} candidates "
                          f"refused, for example: {'; '.join(seen[:2])}")
    scored.sort(key=lambda s: s[0])
    _, new, t, kept = scored[0]
    changes = []
    if not kept:
        changes.append(f"global batch {global_batch(cfg)} -> {global_batch(new)} sequences: no "
                       f"layout of {world_size} ranks whose dp divides it runs this job")
    elif new.micro_batch_size != cfg.micro_batch_size:
        changes.append(f"micro-batch size {cfg.micro_batch_size} -> {new.micro_batch_size}")
    return Choice(cfg=new, step_time_s=t, batch_kept=kept, changes=tuple(changes),
                  ranked=len(scored), rejected=len(refused))


# ---- emulated nodes of a local job -----------------------------------------------------------

def _nodes_dir(save: str) -> str:
    return os.path.join(save, ".nodes")


def mark_node_down(save: str, node: str | int, seconds: float = math.inf) -> None:
    """Node ``node`` is down for ``seconds`` from now (inf: until its marker is removed)."""
    os.makedirs(_nodes_dir(save), exist_ok=True)
    until = time.time() + seconds if math.isfinite(seconds) else math.inf
    path = os.path.join(_nodes_dir(save), f"down_{node}")
    with open(path + ".tmp", "w") as f:
        f.write(repr(until))
    os.replace(path + ".tmp", path)


def nodes_down(save: str | None) -> int:
    """How many emulated nodes are down now."""
    if not save or not os.path.isdir(_nodes_dir(save)):
        return 0
    now, down = time.time(), 0
    for name in os.listdir(_nodes_dir(save)):
        if not name.startswith("down_") or name.endswith(".tmp"):
            continue
        try:
            with open(os.path.join(_nodes_dir(save), name)) as f:
                until = float(f.read())
        except (OSError, ValueError):
            continue
        down += until > now
    return down
