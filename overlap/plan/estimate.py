"""``estimate(model, cluster, layout) -> Estimate``: memory, bubble, communication, step time.

Step time = pipeline makespan (the schedule replayed with per-stage costs that already contain
the exposed TP, CP, P2P and ZeRO-3 communication) + exposed data-parallel reduction + exposed
parameter all-gather (ZeRO >= 1) + the tied-embedding gradient all-reduce (pp > 1) + the
optimizer step (memory bound: 32 bytes per local parameter). MoE: the stages' costs hold the
exposed all-to-all (``comm_s["ep"]``, ``exposed_s["ep"]``); expert gradients reduce over the
expert-DP group after the dense ones, in the same overlap window. When ranks outnumber cores
(``cluster.cores_per_node``, the CPU twin), the step is also never shorter than the node's CPU
work divided by the cores. Activation offloading adds its exposed copies to the stages' F and
B (``comm_s["offload"]``, ``exposed_s["offload"]``; ``plan.offload``), and a layout fits when
the fullest node's pinned host memory also fits (``fits``).
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from overlap.plan.bubble import closed_form_bubble, simulate_stages
from overlap.plan.comm import Placement, collective_time, placement
from overlap.plan.compute import LayerContext, LayerCost
from overlap.plan.cp import link_split
from overlap.plan.hardware import ClusterSpec
from overlap.plan.layout import CP_METHODS, WIRE_BYTES, Layout, ulysses_error
from overlap.plan.memory import StageMemory, memory_per_rank, rank_param_split, rank_params
from overlap.plan.models import ModelSpec
from overlap.plan.offload import ChunkOffload, node_host_bytes, offload_chunks
from overlap.plan.stages import StageCost, stage_costs

__all__ = ["Estimate", "estimate", "GIB"]

GIB = float(2**30)
OPTIMIZER_BYTES_PER_PARAM = 32.0  # Adam: read p16, g32, p32, m, v (18) + write p16, p32, m, v (14)


@dataclasses.dataclass(slots=True, frozen=True)
class Estimate:
    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    dp: int
    num_microbatches: int
    step_time_s: float
    pipeline_s: float
    optimizer_s: float
    bubble_fraction: float
    closed_form_bubble: float
    memory: tuple[StageMemory, ...]
    comm_s: dict[str, float]
    exposed_s: dict[str, float]
    stage_costs: tuple[StageCost, ...]
    model_flops: float
    hardware_flops: float
    cpu_work_s: float
    cpu_bound: bool
    dp_algorithm: str
    ep_link: str = "none"   # "nvlink" (EP group inside a node), "ib" (across nodes), "none"
    cp_link: str = "none"   # the same for the CP group
    # cp > 1: per feasible CP method, its terms per layer and micro-batch (``_cp_row``) and,
    # for those "auto" replayed, the step time; ``cp_auto``: the method was chosen by "auto".
    cp_methods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    cp_auto: bool = False
    # Activation offloading: per model chunk (stage order), one micro-batch (``plan.offload``);
    # the fullest node's pinned host bytes.
    offload: tuple[ChunkOffload, ...] = ()
    host_node_bytes: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.layout.global_batch * self.model.seq_len / self.step_time_s

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time_s / self.cluster.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu * 1e12 / self.cluster.device.peak_flops

    @property
    def hfu(self) -> float:
        return self.hardware_flops / self.step_time_s / self.cluster.num_gpus / \
            self.cluster.device.peak_flops

    @property
    def peak_memory(self) -> StageMemory:
        return max(self.memory, key=lambda m: m.total)

    @property
    def exposed_comm_s(self) -> float:
        return sum(self.exposed_s.values())

    @property
    def cp_hidden(self) -> float:
        """The share of the step's CP exchange seconds that the attention hides (0 at cp 1)."""
        raw = self.comm_s.get("cp", 0.0)
        return 1.0 - self.exposed_s["cp"] / raw if raw > 0 else 0.0

    @property
    def host_capacity(self) -> float | None:
        """Host memory of a node (None: the profile does not say)."""
        per_gpu = self.cluster.device.host_bytes_per_gpu
        return None if per_gpu is None else per_gpu * self.cluster.gpus_per_node

    @property
    def offload_bytes_per_step(self) -> float:
        """Bytes one GPU copies to host per step (and back), on the pp rank that copies most."""
        m = self.num_microbatches
        return max((m * sum(self.offload[c].host_bytes for c in self.layout.rank_chunks(r))
                    for r in range(self.layout.pp)), default=0.0) if self.offload else 0.0

    def host_fits(self, fraction: float = 0.9) -> bool:
        cap = self.host_capacity
        return cap is None or self.host_node_bytes <= fraction * cap

    def fits(self, fraction: float = 0.9) -> bool:
        return self.peak_memory.total <= fraction * self.cluster.device.hbm_bytes and \
            self.host_fits(fraction)

    def as_dict(self) -> dict[str, Any]:
        mem = self.peak_memory
        lay = self.layout
        d = self._as_dict(mem, lay)
        if self.model.is_moe:
            d["memory_gib"]["experts"] = mem.expert_bytes / GIB
            d["memory_gib"]["expert_params_per_gpu"] = mem.expert_params
            d["layout"].update(ep=lay.ep, edp=lay.edp(self.cluster),
                               capacity_factor=lay.capacity_factor,
                               moe_imbalance=lay.moe_imbalance, ep_dispatch=lay.ep_dispatch,
                               ep_chunks=lay.ep_chunks)
            d["ep_link"] = self.ep_link
        if lay.cp > 1:
            d["memory_gib"]["cp_buffers"] = mem.cp_buffers / GIB
            d["layout"]["cp_method"] = lay.cp_method
            d["cp"] = {"method": lay.cp_method, "auto": self.cp_auto, "link": self.cp_link,
                       **self.cp_methods[lay.cp_method], "hidden_fraction": self.cp_hidden,
                       "methods": self.cp_methods}
        if self.offload:
            d["memory_gib"]["host_pinned"] = max(s.host_bytes for s in self.memory) / GIB
            d["offload"] = self.offload_dict()
        return d

    def offload_dict(self) -> dict[str, Any]:
        """The offload terms for ``--json``: per GPU and step on the busiest pp rank, the
        fullest node's pinned host memory against the node's (None: unknown)."""
        raw, exp = self.comm_s["offload"], self.exposed_s["offload"]
        cap = self.host_capacity
        return {"mode": self.layout.offload,
                "blocks_per_chunk": [o.offloaded for o in self.offload],
                "layers_per_chunk": [o.layers for o in self.offload],
                "host_link_gb_s": self.cluster.device.host_link.effective_bandwidth / 1e9,
                "bytes_to_host_per_step": self.offload_bytes_per_step,
                "copy_s": raw, "exposed_s": exp,
                "hidden_fraction": 1.0 - exp / raw if raw > 0 else 1.0,
                "host_gib_per_gpu": max(s.host_bytes for s in self.memory) / GIB,
                "host_gib_per_node": self.host_node_bytes / GIB,
                "host_capacity_gib_per_node": None if cap is None else cap / GIB}

    def _as_dict(self, mem: StageMemory, lay: Layout) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "bubble_fraction": self.bubble_fraction,
            "bubble_fraction_closed_form": self.closed_form_bubble,
            "memory_gib": {"weights": mem.weights / GIB, "grads": mem.grads / GIB,
                           "optimizer": mem.optimizer / GIB,
                           "activations": mem.activations / GIB, "total": mem.total / GIB,
                           "pp_rank": mem.rank, "capacity": self.cluster.device.hbm_bytes / GIB},
            "comm_s": dict(self.comm_s),
            "exposed_comm_s": self.exposed_comm_s,
            "exposed_s": dict(self.exposed_s),
            "pipeline_s": self.pipeline_s,
            "optimizer_s": self.optimizer_s,
            "cpu_bound": self.cpu_bound,
            "layout": {"gpus": self.cluster.num_gpus, "gpu": self.cluster.device.name,
                       "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "dp": self.dp,
                       "micro_batch": lay.micro_batch, "num_microbatches": self.num_microbatches,
                       "schedule": lay.schedule, "virtual": lay.num_virtual,
                       "recompute": lay.recompute, "sequence_parallel": lay.sequence_parallel,
                       "zero": lay.zero, "comm_dtype": lay.comm_dtype,
                       "offload": lay.offload},
        }


def estimate(model: ModelSpec, cluster: ClusterSpec, layout: Layout, *,
             ep_group: Placement | None = None, memory_fraction: float = 0.9) -> Estimate:
    """``ep_group`` replaces the EP group's placement (size and ranks per node) for a run that
    placed it differently from ``ParallelDims``, such as Megatron-Core's EP folded over TP x DP
    in the published runs ``fit_moe`` calibrates on; the layout's ``ep`` still sets the
    experts per GPU. ``layout.cp_method`` "auto" (cp > 1): of the feasible methods that fit in
    ``memory_fraction`` of the device (all, when none does), the one with the lowest step
    time (``Estimate.cp_auto``)."""
    layout.check(model, cluster)
    ctx = LayerContext(model, cluster, layout, ep_group)
    if layout.cp == 1:
        return _estimate(ctx, layout, ctx.layers("none"), {})
    terms = {meth: ctx.layers(meth) for meth in CP_METHODS
             if meth != "ulysses" or ulysses_error(model, layout.tp, layout.cp) is None}
    rows = {meth: _cp_row(ctx, meth, lay_costs[0]) for meth, lay_costs in terms.items()}
    if layout.cp_method != "auto":
        meth = layout.cp_method
        return _estimate(ctx, layout, terms[meth], rows)
    cap = memory_fraction * cluster.device.hbm_bytes
    fit = [meth for meth in terms if max(s.total for s in memory_per_rank(
        model, dataclasses.replace(layout, cp_method=meth), cluster)) <= cap]
    terms = {meth: terms[meth] for meth in fit} if fit else terms
    # A method whose layers are no faster, forward and backward, than another's cannot give a
    # shorter step (the replay and the overlap windows only add), so it is not replayed.
    keys = {meth: _cp_key(cluster, *lay_costs) for meth, lay_costs in terms.items()}
    keep = [a for a in terms if not any(
        b != a and all(x <= y for x, y in zip(keys[b], keys[a]))
        and (keys[b] != keys[a] or CP_METHODS.index(b) < CP_METHODS.index(a)) for b in terms)]
    ests = {meth: _estimate(ctx, dataclasses.replace(layout, cp_method=meth), terms[meth], rows)
            for meth in keep}
    for meth, e in ests.items():
        rows[meth]["step_time_s"] = e.step_time_s
    best = min(keep, key=lambda meth: (ests[meth].step_time_s, CP_METHODS.index(meth)))
    return dataclasses.replace(ests[best], cp_auto=True)


def _cp_key(cluster: ClusterSpec, dense: LayerCost, moe: LayerCost | None) -> tuple:
    """What differs between CP methods in a step: layer forward and backward seconds (with the
    exposed exchange) and, on the CPU twin, the ring's host CPU per P2P side."""
    out = [dense.fwd, dense.dgrad + dense.recompute,
           dense.cp_p2p_sides * cluster.device.p2p_cpu_s]
    if moe is not None:
        out += [moe.fwd, moe.dgrad + moe.recompute]
    return tuple(out)


def _cp_row(ctx: LayerContext, method: str, dense: LayerCost) -> dict[str, Any]:
    """One CP method's terms per (dense) layer and micro-batch on one GPU, for the report."""
    nv, ib = link_split(method, ctx.cp_place)
    return {"comm_s_per_layer": dense.cp_comm, "exposed_s_per_layer": dense.cp_exposed,
            "kv_bytes_per_layer": {"nvlink": nv * dense.cp_bytes, "ib": ib * dense.cp_bytes},
            "step_time_s": None}


def _estimate(ctx: LayerContext, layout: Layout, lay_costs: tuple[LayerCost, LayerCost | None],
              cp_rows: dict[str, dict[str, Any]]) -> Estimate:
    model, cluster = ctx.model, ctx.cluster
    dev = cluster.device
    dp, m, v = ctx.dp, ctx.m, layout.num_virtual
    tp_place, dp_place, edp_place = ctx.tp_place, ctx.dp_place, ctx.edp_place
    ep_place = ctx.ep_place
    layer, moe_layer = lay_costs
    costs = stage_costs(model, layout, cluster, layer, tp_place=tp_place, dp_place=dp_place,
                        moe_layer=moe_layer, edp_place=edp_place)
    offload = offload_chunks(model, layout, cluster, lay_costs) \
        if layout.offload != "none" else []
    if offload:  # copies both ways; what did not hide delays the stage's forward or backward
        costs = [dataclasses.replace(c, F=c.F + o.exposed_f, I=c.I + o.exposed_b,
                                     B=c.B + o.exposed_b, offload_comm=2.0 * o.copy_s,
                                     offload_exposed=o.exposed_f + o.exposed_b)
                 for c, o in zip(costs, offload)]
    sim = simulate_stages(layout.schedule, layout.pp, m, v, [c.as_sim() for c in costs])

    # Data-parallel reduction and parameter gather, per pp rank.
    wire = WIRE_BYTES[layout.comm_dtype]
    dp_exposed = ag_exposed = 0.0
    dp_comm_rank, dp_algo, dp_ops = [], "none", 0
    for r in range(layout.pp):
        params, experts = rank_param_split(model, layout, r)
        first_f = costs[r].F
        if (dp_place.size <= 1 and not (experts and edp_place.size > 1)) or layout.zero == 3:
            dp_comm_rank.append(0.0)
            continue
        if layout.zero == 0:
            red, dp_algo = collective_time("all_reduce", wire * params, dp_place, dev)
            tail = collective_time("all_reduce", min(wire * params, layout.bucket_bytes),
                                   dp_place, dev)[0]
            gather = 0.0
        else:
            red, dp_algo = collective_time("reduce_scatter", wire * params, dp_place, dev)
            tail = collective_time("reduce_scatter", min(wire * params, layout.bucket_bytes),
                                   dp_place, dev)[0]
            gather = collective_time("all_gather", layout.dtype_bytes * params, dp_place,
                                     dev)[0]
        if experts:  # the experts' own reducer, over expert-DP
            kind = "all_reduce" if layout.zero == 0 else "reduce_scatter"
            red += collective_time(kind, wire * experts, edp_place, dev)[0]
            if layout.zero >= 1:
                gather += collective_time("all_gather", layout.dtype_bytes * experts,
                                          edp_place, dev)[0]
            params += experts
        dp_ops = max(dp_ops, math.ceil(wire * params / layout.bucket_bytes) * (1 + (gather > 0)))
        dp_comm_rank.append(red + gather)
        if layout.overlap.dp:
            slack = sim.makespan - sim.finish[r]
            dp_exposed = max(dp_exposed, max(0.0, max(red - sim.last_backward[r], tail) - slack))
            ag_exposed = max(ag_exposed, max(0.0, gather - sim.first_start[r] - first_f))
        else:
            dp_exposed = max(dp_exposed, red)
            ag_exposed = max(ag_exposed, gather)
    emb_sync = 0.0
    if layout.pp > 1 and model.tied_embeddings:
        pair = placement(cluster, 2, (layout.pp - 1) * layout.tp * layout.cp)
        emb_sync = collective_time("all_reduce", wire * model.vocab * model.hidden / layout.tp,
                                   pair, dev)[0]

    # Optimizer: memory-bound update of the local (ZeRO: 1/(dp*cp)) parameters.
    shard = dp * layout.cp if layout.zero >= 1 else 1
    mem_bw = dev.hbm_bandwidth * dev.mem_efficiency
    if model.is_moe:
        eshard = shard // layout.ep if layout.zero >= 1 else 1
        opt = max((d / shard + x / eshard) * OPTIMIZER_BYTES_PER_PARAM / mem_bw
                  for d, x in (rank_param_split(model, layout, r) for r in range(layout.pp)))
    else:
        opt = max(rank_params(model, layout, r) / shard * OPTIMIZER_BYTES_PER_PARAM / mem_bw
                  for r in range(layout.pp))
    host_step = dev.host_tp_step_s if layout.tp > 1 else dev.host_step_s
    step = sim.makespan + dp_exposed + ag_exposed + emb_sync + opt + host_step

    # CPU twin: the node's CPU work over its cores.
    cpu_work, cpu_bound = 0.0, False
    if cluster.cores_per_node is not None:
        per_rank = []
        for r in range(layout.pp):
            chunks = layout.rank_chunks(r)
            # Compute (with the layers' host costs, which include their TP ops and small
            # collectives), P2P sides, data-parallel collectives, the optimizer, the step.
            work = m * sum(costs[c].work for c in chunks)
            host = m * sum(costs[c].p2p_ops for c in chunks) * dev.p2p_cpu_s + \
                dp_ops * (dp_place.size - 1) * dev.comm_cpu_s + host_step
            per_rank.append(work + host + opt)
        cpu_work = sum(per_rank) / layout.pp * cluster.ranks_per_node
        floor = cpu_work / cluster.cores_per_node
        if floor > step:
            step, cpu_bound = floor, True

    # Per-step communication of the busiest pp rank, raw and exposed.
    def per_rank(attr: str, r: int) -> float:
        return m * sum(getattr(costs[c], attr) for c in layout.rank_chunks(r))

    worst = max(range(layout.pp), key=lambda r: sim.busy[r])
    comm = {"tp": per_rank("tp_comm", worst), "pp": per_rank("pp_comm", worst),
            "dp": max(dp_comm_rank, default=0.0) + emb_sync + per_rank("dp_comm", worst)}
    exposed = {"tp": per_rank("tp_exposed", worst), "pp": per_rank("pp_exposed", worst),
               "dp": dp_exposed + ag_exposed + emb_sync + per_rank("dp_exposed", worst)}
    if offload:
        comm["offload"] = per_rank("offload_comm", worst)
        exposed["offload"] = per_rank("offload_exposed", worst)
    cp_link = "none"
    if layout.cp > 1:
        comm["cp"], exposed["cp"] = per_rank("cp_comm", worst), per_rank("cp_exposed", worst)
        cp_link = "nvlink" if ctx.cp_place.nodes == 1 else "ib"
    ep_link = "none"
    if model.is_moe:
        comm["ep"], exposed["ep"] = per_rank("ep_comm", worst), per_rank("ep_exposed", worst)
        if ep_place.size > 1:
            ep_link = "nvlink" if ep_place.nodes == 1 else "ib"
    seqs = layout.global_batch
    model_flops = seqs * model.model_flops_per_sequence()
    hw_per_mb = sum(c.hw_flops for c in costs)  # one micro-batch through every stage, per GPU
    hardware_flops = hw_per_mb * m * cluster.num_gpus / layout.pp
    memory = tuple(memory_per_rank(model, layout, cluster, offload=offload or None))
    host_node = node_host_bytes(layout, cluster, [s.host_bytes for s in memory]) \
        if offload else 0.0
    return Estimate(model=model, cluster=cluster, layout=layout, dp=dp, num_microbatches=m,
                    step_time_s=step, pipeline_s=sim.makespan, optimizer_s=opt,
                    bubble_fraction=sim.bubble_fraction,
                    closed_form_bubble=closed_form_bubble(layout.schedule, layout.pp, m, v),
                    memory=memory, comm_s=comm,
                    exposed_s=exposed, stage_costs=tuple(costs), model_flops=model_flops,
                    hardware_flops=hardware_flops, cpu_work_s=cpu_work, cpu_bound=cpu_bound,
                    dp_algorithm=dp_algo, ep_link=ep_link, cp_link=cp_link,
                    cp_methods=cp_rows, offload=tuple(offload), host_node_bytes=host_node)
