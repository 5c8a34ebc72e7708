"""``search(model, cluster, global_batch, constraints)``: rank the layouts that fit.

Candidates: every tp (a power of two up to the node, dividing the heads), pp (dividing the
layers and the GPUs left), cp (a power of two dividing the GPUs left, with 2*cp dividing the
sequence and s/cp >= ``min_cp_tokens``; method "auto"), micro-batch, schedule (1F1B, interleaved
with v chunks, ZB-H1), recomputation and ZeRO stage the constraints allow, with sequence
parallelism whenever tp > 1; for a MoE model also every ep that divides dp x cp (and the
experts). Offloading (``Constraints.offload``): by default never; None tries, for a layout
that does not fit without it, all blocks, all but one and half of them (never faster than the
same layout without it, so only those); a tuple of modes gives every candidate each of them.
Each is checked in order of cost: its shapes (``Layout.check``), then its memory (cheap,
:mod:`overlap.plan.memory`; with offloading also the node's host memory), then the full
estimate with the pipeline replay. A candidate that fails gets the reason; the rest are ranked
by step time (ties: fewer bytes to host, then less memory).
"""

from __future__ import annotations

import dataclasses

from overlap.plan.estimate import GIB, Estimate, estimate
from overlap.plan.hardware import ClusterSpec
from overlap.plan.layout import Layout, Overlap
from overlap.plan.memory import StageMemory, memory_per_rank
from overlap.plan.models import ModelSpec
from overlap.plan.offload import node_host_bytes, search_modes

__all__ = ["Constraints", "SearchResult", "search", "candidates", "rank_layouts"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Constraints:
    """What the search may choose. ``max_tp`` None: the GPUs of a node."""

    max_tp: int | None = None
    max_pp: int = 64
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1")
    virtual: tuple[int, ...] = (2,)
    recompute: tuple[str, ...] = ("selective", "full")
    zero: tuple[int, ...] = (1,)
    comm_dtype: str = "bf16"
    flash_attention: bool = True
    overlap: Overlap = Overlap()
    memory_fraction: float = 0.9
    ep: tuple[int, ...] | None = None   # None: every valid ep (MoE models)
    capacity_factor: float | None = None
    moe_imbalance: float = 1.0
    ep_dispatch: str = "bf16"
    ep_chunks: int = 2
    cp: tuple[int, ...] | None = None   # None: every valid cp
    # cp > 1 only while every CP rank keeps s/cp >= this many tokens: 4096 allows cp 2 from 8K,
    # where Megatron-Core's parallelism guide starts recommending CP ("8K+ tokens").
    min_cp_tokens: int = 4096
    cp_method: str = "auto"
    # ("none",): never offload; None: the modes of ``offload.search_modes`` for a layout that
    # does not fit without; else every candidate with each of these modes.
    offload: tuple[str, ...] | None = ("none",)


@dataclasses.dataclass(slots=True)
class SearchResult:
    ranked: list[Estimate]
    rejected: list[tuple[Layout, str]]

    def reasons(self) -> dict[str, int]:
        """How many candidates failed for each kind of reason."""
        out: dict[str, int] = {}
        for _, why in self.rejected:
            key = why.split(":")[0]
            out[key] = out.get(key, 0) + 1
        return out


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def candidates(model: ModelSpec, cluster: ClusterSpec, global_batch: int,
               c: Constraints) -> list[Layout]:
    max_tp = c.max_tp or cluster.gpus_per_node
    out = []
    for tp in _powers_of_two(min(max_tp, cluster.num_gpus)):
        for pp in range(1, min(c.max_pp, model.num_layers) + 1):
            if model.num_layers % pp or cluster.num_gpus % (tp * pp):
                continue
            for cp in _cp_values(model, cluster.num_gpus // (tp * pp), c):
                out += _inner(model, cluster, global_batch, c, tp, pp, cp)
    return out


def _cp_values(model: ModelSpec, rest: int, c: Constraints) -> list[int]:
    """Every cp the search tries; an explicit ``c.cp`` is not held to ``min_cp_tokens``."""
    floor = c.min_cp_tokens if c.cp is None else 0
    valid = [v for v in _powers_of_two(rest) if rest % v == 0 and (v == 1 or (
        model.seq_len % (2 * v) == 0 and model.seq_len // v >= floor))]
    return [v for v in valid if c.cp is None or v in c.cp]


def _inner(model: ModelSpec, cluster: ClusterSpec, global_batch: int, c: Constraints, tp: int,
           pp: int, cp: int) -> list[Layout]:
    """Every micro-batch, schedule, recomputation, ZeRO stage and ep at one (tp, pp, cp)."""
    out = []
    for mb in c.micro_batches:
        for sched in c.schedules if pp > 1 else ("1f1b",):
            for v in c.virtual if sched == "interleaved" else (1,):
                for rec in c.recompute:
                    if sched == "zb-h1" and rec == "full":
                        continue
                    for zero in c.zero:
                        for ep in _ep_values(model, cluster.num_gpus // (tp * pp), c):
                            out += [Layout(
                                tp=tp, pp=pp, cp=cp, cp_method=c.cp_method, ep=ep,
                                global_batch=global_batch, micro_batch=mb, schedule=sched,
                                virtual=v, recompute=rec, sequence_parallel=tp > 1, zero=zero,
                                comm_dtype=c.comm_dtype, flash_attention=c.flash_attention,
                                overlap=c.overlap, offload=off, **_moe_kw(model, c))
                                for off in c.offload or ("none",)]
    return out


def _ep_values(model: ModelSpec, dp: int, c: Constraints) -> list[int]:
    if not model.is_moe:
        return [1]
    valid = [e for e in range(1, dp + 1) if dp % e == 0 and model.num_experts % e == 0]
    return [e for e in valid if c.ep is None or e in c.ep]


def _moe_kw(model: ModelSpec, c: Constraints) -> dict:
    if not model.is_moe:
        return {}
    return dict(capacity_factor=c.capacity_factor, moe_imbalance=c.moe_imbalance,
                ep_dispatch=c.ep_dispatch, ep_chunks=c.ep_chunks)


def search(model: ModelSpec, cluster: ClusterSpec, global_batch: int,
           constraints: Constraints = Constraints()) -> SearchResult:
    try_offload = constraints.offload is None and cluster.device.host_link is not None
    return rank_layouts(model, cluster, candidates(model, cluster, global_batch, constraints),
                        memory_fraction=constraints.memory_fraction, try_offload=try_offload)


def rank_layouts(model: ModelSpec, cluster: ClusterSpec, layouts: list[Layout], *,
                 memory_fraction: float = 0.9, try_offload: bool = False) -> SearchResult:
    """The given layouts that are valid and fit, fastest first (``search`` without the
    enumeration; ``overlap.train.shrink`` ranks the layouts a job can resume on)."""
    ranked: list[Estimate] = []
    rejected: list[tuple[Layout, str]] = []
    frac = memory_fraction
    for layout in layouts:
        try:
            layout.check(model, cluster)
        except ValueError as exc:
            rejected.append((layout, f"invalid: {exc}"))
            continue
        why = _memory_error(model, cluster, layout, frac)
        if why is None:
            ranked.append(estimate(model, cluster, layout, memory_fraction=frac))
            continue
        rejected.append((layout, why))
        if try_offload and layout.offload == "none" and why.startswith("memory"):
            # The same layout with offloading is only worth it when it does not fit without.
            for mode in search_modes(model, layout):
                lay = dataclasses.replace(layout, offload=mode)
                if _memory_error(model, cluster, lay, frac) is None:
                    ranked.append(estimate(model, cluster, lay, memory_fraction=frac))
    ranked.sort(key=lambda e: (e.step_time_s, e.offload_bytes_per_step, e.peak_memory.total))
    return SearchResult(ranked=ranked, rejected=rejected)


def _memory_error(model: ModelSpec, cluster: ClusterSpec, layout: Layout,
                  fraction: float) -> str | None:
    """Why the layout does not fit (device memory, or the node's pinned host memory), or None."""
    dev = cluster.device
    mems = memory_per_rank(model, layout, cluster)
    mem = max(mems, key=lambda s: s.total)
    capacity = fraction * dev.hbm_bytes
    if mem.total > capacity:
        return (f"memory: {mem.total / GIB:.1f} GiB on pp rank {mem.rank} > "
                f"{capacity / GIB:.1f} GiB ({fraction:g} of {dev.hbm_bytes / GIB:.1f} GiB)")
    return _host_error(cluster, layout, mems, fraction)


def _host_error(cluster: ClusterSpec, layout: Layout, mems: list[StageMemory],
                fraction: float) -> str | None:
    if layout.offload == "none" or cluster.device.host_bytes_per_gpu is None:
        return None
    node = node_host_bytes(layout, cluster, [s.host_bytes for s in mems])
    cap = fraction * cluster.device.host_bytes_per_gpu * cluster.gpus_per_node
    if node <= cap:
        return None
    return (f"host memory: {node / GIB:.1f} GiB pinned on a node > {cap / GIB:.1f} GiB "
            f"({fraction:g} of {cap / fraction / GIB:.1f} GiB)")
