"""Per-stage, per-micro-batch costs: the numbers the pipeline replay is fed with.

A stage is ``n`` layers (:mod:`overlap.plan.compute`) plus, on the first stage, the embedding
and, on the last, the final norm, the vocabulary projection (T, V/t, h) and the vocab-parallel
cross-entropy. Its costs also hold the exposed part of its pipeline transfers (``T*h*2`` bytes,
1/t of it per TP rank), ZeRO-3's weight gathers and gradient reduce-scatters, and, with
sequence parallelism, the TP all-reduces of the replicated parameters' gradients; a stage's MoE
layers use the MoE layer's cost (with its exposed all-to-all, ``ep_*``); ``cp_*`` is the
layers' context-parallel KV exchange (the ring's P2P sides count in ``p2p_ops``). Operation
counts per micro-batch (``tp_ops``, ``coll_ops``, ``p2p_ops``) feed the CPU twin's host-CPU
accounting.
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses

from overlap.plan.comm import Placement, collective_time, p2p_time
from overlap.plan.compute import Gemm, LayerCost, fused_exposed, gemm_time
from overlap.plan.hardware import ClusterSpec
from overlap.plan.layout import WIRE_BYTES, Layout
from overlap.plan.models import ModelSpec

__all__ = ["StageCost", "stage_costs"]


@dataclasses.dataclass(slots=True, frozen=True)
class StageCost:
    """Seconds per micro-batch of one stage on one GPU; comm split into raw and exposed."""

    F: float
    B: float
    I: float
    W: float
    tp_comm: float
    tp_exposed: float
    pp_comm: float
    pp_exposed: float
    dp_comm: float          # ZeRO-3 per-micro-batch gathers and reductions
    dp_exposed: float
    tp_ops: int
    coll_ops: int
    p2p_ops: int
    fwd_flops: float
    hw_flops: float         # forward + backward + recomputation
    ep_comm: float = 0.0    # MoE all-to-all, raw and exposed
    ep_exposed: float = 0.0
    cp_comm: float = 0.0    # CP KV exchange, raw and exposed
    cp_exposed: float = 0.0
    offload_comm: float = 0.0     # activation copies to host and back, raw and exposed
    offload_exposed: float = 0.0

    @property
    def work(self) -> float:
        """Compute seconds (F + B without their exposed communication)."""
        return self.F + self.B - self.tp_exposed - self.pp_exposed - self.dp_exposed - \
            self.ep_exposed - self.cp_exposed - self.offload_exposed

    def as_sim(self) -> dict[str, float]:
        return {"F": self.F, "B": self.B, "I": self.I, "W": self.W}


def _boundary_cross_node(layout: Layout, cluster: ClusterSpec, src_stage: int) -> bool:
    g = cluster.gpus_per_node
    stride = layout.tp * layout.cp
    a, b = src_stage % layout.pp, (src_stage + 1) % layout.pp
    return (a * stride) // g != (b * stride) // g


@dataclasses.dataclass(slots=True)
class _Part:
    """Extra work of a stage beyond its layers."""

    f: float = 0.0
    i: float = 0.0
    w: float = 0.0
    comm: float = 0.0
    exposed_f: float = 0.0
    exposed_i: float = 0.0
    tp_ops: int = 0
    coll_ops: int = 0


def _embedding(model: ModelSpec, layout: Layout, dev, tp_place: Placement) -> _Part:
    t, e, sp = layout.tp, layout.dtype_bytes, layout.sequence_parallel
    tokens = layout.micro_batch * model.seq_len / layout.cp
    mem_bw = dev.hbm_bandwidth * dev.mem_efficiency
    stream = tokens * model.hidden / (t if sp else 1)
    act_bytes = e * tokens * model.hidden
    part = _Part(f=e * stream / mem_bw, i=3.0 * e * tokens * model.hidden / t / mem_bw)
    if t > 1:  # vocab-parallel partial sums reduced; with SP the gradient is gathered back
        cf = collective_time("reduce_scatter" if sp else "all_reduce", act_bytes, tp_place,
                             dev, tp=True)[0]
        cb = collective_time("all_gather", act_bytes, tp_place, dev, tp=True)[0] if sp else 0.0
        part.comm, part.exposed_f, part.exposed_i = cf + cb, cf, cb
        part.f += cf
        part.i += cb
        part.coll_ops = 1 + int(sp)
    return part


def _head(model: ModelSpec, layout: Layout, dev, tp_place: Placement) -> _Part:
    t, e, sp = layout.tp, layout.dtype_bytes, layout.sequence_parallel
    tokens = layout.micro_batch * model.seq_len / layout.cp
    mem_bw = dev.hbm_bandwidth * dev.mem_efficiency
    stream = tokens * model.hidden / (t if sp else 1)
    head = Gemm(tokens, model.vocab / t, model.hidden)
    logits = tokens * model.vocab / t
    loss_bw = dev.loss_bandwidth or mem_bw
    part = _Part(f=gemm_time(dev, head, e) + 2.0 * e * stream / mem_bw + 8.0 * logits / loss_bw,
                 i=gemm_time(dev, head.dgrad(), e) + 4.0 * e * stream / mem_bw
                 + 4.0 * logits / loss_bw,
                 w=gemm_time(dev, head.wgrad(), e))
    if t > 1:
        # Vocab-parallel cross-entropy: max, sum-exp and target logit all-reduced per token.
        small = 3 * collective_time("all_reduce", 4.0 * tokens, tp_place, dev, tp=True)[0]
        part.comm, part.exposed_f, part.coll_ops = small, small, 3
        if sp:  # all-gather fused with the head GEMM; its gradient reduce-scattered in bwd
            act_bytes = e * tokens * model.hidden
            ag = collective_time("all_gather", act_bytes, tp_place, dev, tp=True)[0]
            part.comm += 2 * ag
            part.exposed_f += fused_exposed(ag, gemm_time(dev, head, e), t, layout.overlap.tp)
            part.exposed_i += fused_exposed(ag, part.i + part.w, t, layout.overlap.tp)
            part.tp_ops = 2
        part.f += part.exposed_f
        part.i += part.exposed_i
    return part


def _replicated_tensors(model: ModelSpec, layers: int, last: bool) -> int:
    """Parameter tensors TP replicates on a stage: norms and row-parallel biases."""
    per_norm = 2 if model.bias else 1
    n = layers * (2 * per_norm + (2 if model.bias else 0))
    return n + (per_norm if last else 0)


def stage_costs(model: ModelSpec, layout: Layout, cluster: ClusterSpec, layer: LayerCost, *,
                tp_place: Placement, dp_place: Placement, moe_layer: LayerCost | None = None,
                edp_place: Placement | None = None) -> list[StageCost]:
    dev = cluster.device
    t, e, sp = layout.tp, layout.dtype_bytes, layout.sequence_parallel
    tokens = layout.micro_batch * model.seq_len / layout.cp
    act_bytes = e * tokens * model.hidden
    layers = layout.chunk_layers(model)
    num_stages = layout.num_chunks
    emb = _embedding(model, layout, dev, tp_place)
    head = _head(model, layout, dev, tp_place)
    head_flops = model.head_fwd_flops(tokens) / t

    # Pipeline transfers (1/t of the activation per TP rank; gathered over NVLink without SP).
    msg = act_bytes / t if t > 1 else act_bytes
    regather = 0.0
    if t > 1 and not sp:
        regather = collective_time("all_gather", act_bytes, tp_place, dev, tp=True)[0]

    moe_counts = layout.chunk_moe_layers(model) if moe_layer is not None else [0] * num_stages
    out = []
    for s in range(num_stages):
        n = layers[s]
        first, last = s == 0, s == num_stages - 1
        nm = moe_counts[s]
        n -= nm  # dense layers; the nm MoE layers are added below
        f = n * layer.fwd
        i = n * (layer.dgrad + layer.recompute)
        w = n * layer.wgrad
        tp_comm, tp_exp = n * layer.tp_comm, n * layer.tp_exposed
        tp_ops, coll_ops, p2p_ops = n * layer.num_comm_ops, 0, n * layer.cp_p2p_sides
        cp_comm, cp_exp = n * layer.cp_comm, n * layer.cp_exposed
        fwd_flops = n * layer.fwd_flops
        hw = 3 * fwd_flops
        if layout.recompute == "full":
            hw += fwd_flops
        elif layout.flash_attention:
            hw += n * layer.attn_flops / 2
        elif layout.recompute == "selective":
            hw += n * layer.attn_flops
        ep_comm = ep_exp = 0.0
        if nm:
            ml = moe_layer
            f += nm * ml.fwd
            i += nm * (ml.dgrad + ml.recompute)
            w += nm * ml.wgrad
            tp_comm, tp_exp = tp_comm + nm * ml.tp_comm, tp_exp + nm * ml.tp_exposed
            tp_ops += nm * ml.num_comm_ops
            coll_ops += nm * ml.ep_ops
            ep_comm, ep_exp = nm * ml.ep_comm, nm * ml.ep_exposed
            cp_comm, cp_exp = cp_comm + nm * ml.cp_comm, cp_exp + nm * ml.cp_exposed
            p2p_ops += nm * ml.cp_p2p_sides
            fwd_flops += nm * ml.fwd_flops
            hw += 3 * nm * ml.fwd_flops + (nm * ml.fwd_flops if layout.recompute == "full"
                                           else nm * ml.attn_flops / 2
                                           if layout.flash_attention else
                                           nm * ml.attn_flops
                                           if layout.recompute == "selective" else 0.0)
        n += nm
        for part, here in ((emb, first), (head, last)):
            if here:
                f, i, w = f + part.f, i + part.i, w + part.w
                tp_comm += part.comm
                tp_exp += part.exposed_f + part.exposed_i
                tp_ops += part.tp_ops
                coll_ops += part.coll_ops
        if last:
            fwd_flops += head_flops
            hw += 3 * head_flops
        if t > 1 and sp:
            k = _replicated_tensors(model, n, last)
            small = collective_time("all_reduce", 4.0 * model.hidden, tp_place, dev)[0]
            tp_comm += k * small
            coll_ops += k
            if not layout.overlap.tp:
                i += k * small
                tp_exp += k * small
        # Receives: activation into F (s > 0), output gradient into B/I (s < last).
        pp_comm = pp_exp = 0.0
        if s > 0:
            c = p2p_time(msg, _boundary_cross_node(layout, cluster, s - 1), dev) + regather
            pp_comm += c
            e_f = max(0.0, c - f) if layout.overlap.pp else c
            pp_exp += e_f
            f += e_f
            p2p_ops += 2  # this receive and the previous stage's send
            tp_ops += int(regather > 0)
        if s < num_stages - 1:
            c = p2p_time(msg, _boundary_cross_node(layout, cluster, s), dev) + regather
            pp_comm += c
            e_b = max(0.0, c - (i + w)) if layout.overlap.pp else c
            pp_exp += e_b
            i += e_b
            p2p_ops += 2
            tp_ops += int(regather > 0)
        # ZeRO-3: gather this stage's weights for F and again for B, reduce-scatter grads.
        z_comm = z_exp = 0.0
        if layout.zero == 3 and dp_place.size > 1:
            params = n * sum(model.layer_params()) / t
            ag = collective_time("all_gather", e * params, dp_place, dev)[0]
            rs = collective_time("reduce_scatter", WIRE_BYTES[layout.comm_dtype] * params,
                                 dp_place, dev)[0]
            if nm and edp_place is not None:  # experts gather and reduce over expert-DP
                experts = nm * model.moe_layer_params()[2] / layout.ep
                ag += collective_time("all_gather", e * experts, edp_place, dev)[0]
                rs += collective_time("reduce_scatter", WIRE_BYTES[layout.comm_dtype] * experts,
                                      edp_place, dev)[0]
            hide = layout.overlap.dp
            e_f = max(0.0, ag - f) if hide else ag
            e_bw = max(0.0, ag + rs - (i + w)) if hide else ag + rs
            z_comm, z_exp = 2 * ag + rs, e_f + e_bw
            f += e_f + n * dev.zero3_layer_s
            i += e_bw + 2.0 * n * dev.zero3_layer_s
            coll_ops += 3
        # Host cost per compute action beyond the layers (executor, embedding, head, loss).
        action = dev.host_tp_action_s if t > 1 else dev.host_action_s
        f += action
        i += action
        out.append(StageCost(F=f, B=i + w, I=i, W=w, tp_comm=tp_comm, tp_exposed=tp_exp,
                             pp_comm=pp_comm, pp_exposed=pp_exp, dp_comm=z_comm,
                             dp_exposed=z_exp, tp_ops=tp_ops, coll_ops=coll_ops,
                             p2p_ops=p2p_ops, fwd_flops=fwd_flops, hw_flops=hw,
                             ep_comm=ep_comm, ep_exposed=ep_exp, cp_comm=cp_comm,
                             cp_exposed=cp_exp))
    return out
