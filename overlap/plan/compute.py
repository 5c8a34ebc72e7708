"""Per-layer compute and tensor-parallel communication, for one micro-batch on one GPU.

GEMMs of a layer, per GPU (T = b*s/cp tokens; with sequence parallelism the column GEMMs run on
the gathered T tokens), forward:

    qkv    (T, (h + 2kv)/t, h)      scores  b*a/t x (s/cp, s, hd)     av  b*a/t x (s/cp, hd, s)
    out    (T, h, h/t)              fc1     (T, n_act*F/t, h)         fc2 (T, h, F/t)

Backward: every weight GEMM (m, n, k) has a dgrad (m, k, n) and a wgrad (k, n, m). A GEMM costs
``max(FLOPs / (peak * eff(shape)), HBM bytes / achievable bandwidth) + overhead``; element-wise
work is HBM traffic. A fused TP op takes ``max(c, g) + min(c, g)/tp``: its exposed part is
``max(0, c - g) + min(c, g)/tp``. Unfused, all of ``c`` is exposed.
A MoE layer (``moe=True``) swaps fc1/fc2 for the router, shared and E/ep local experts on its
routed rows, plus the all-to-alls, partly hidden (:func:`moe_exposed`); CP: ``plan.cp``.
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses

from overlap.plan.activations import routed_rows
from overlap.plan.comm import (Placement, all_to_all_time, axis_placement, collective_time,
                               edp_placement, ep_placement, ranks_placement)
from overlap.plan.cp import cp_cost
from overlap.plan.hardware import ClusterSpec, DeviceProfile
from overlap.plan.layout import WIRE_BYTES, Layout
from overlap.plan.models import ModelSpec

__all__ = ["Gemm", "gemm_time", "flash_time", "LayerCost", "layer_cost", "fused_exposed",
           "moe_exposed", "ep_volume", "ep_exchange_efficiency", "LayerContext",
           "dp_group_placement"]


@dataclasses.dataclass(slots=True, frozen=True)
class Gemm:
    m: float
    n: float
    k: float
    batch: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch

    def dgrad(self) -> "Gemm":
        return Gemm(self.m, self.k, self.n, self.batch)

    def wgrad(self) -> "Gemm":
        return Gemm(self.k, self.n, self.m, self.batch)


def gemm_time(device: DeviceProfile, g: Gemm, elem_bytes: float = 2.0) -> float:
    if g.flops <= 0:
        return 0.0
    compute = g.flops / (device.peak_flops * device.gemm.efficiency(g.m, g.n, g.k))
    traffic = elem_bytes * (g.m * g.k + g.k * g.n + g.m * g.n) * g.batch
    memory = traffic / (device.hbm_bandwidth * device.mem_efficiency)
    return device.gemm.overhead_s + max(compute, memory)


def flash_time(device: DeviceProfile, g: Gemm, elem_bytes: float = 2.0,
               backward: bool = False) -> float:
    """An attention-core GEMM inside a causal flash kernel: half its FLOPs (the blocks above the
    diagonal are skipped; zig-zag CP keeps every rank at half) and no HBM traffic for its
    s x s operand (the largest of the three), which stays on chip. ``backward``: a GEMM of the
    backward kernel (the scores it recomputes too), at ``device.attention_bwd`` of the level."""
    if g.flops <= 0:
        return 0.0
    if device.attention is not None:  # measured on the kernel, by sequence length (the key
        # length: the largest of the three dimensions of every attention-core GEMM)
        seq = max(g.m, g.n, g.k)
        eff = device.attention.e_max * seq / (seq + device.attention.d_half)
        eff *= device.attention_bwd if backward else 1.0
    else:
        eff = device.gemm.efficiency(g.m, g.n, g.k)
    compute = 0.5 * g.flops / (device.peak_flops * eff)
    small = sorted((g.m * g.k, g.k * g.n, g.m * g.n))[:2]
    memory = elem_bytes * sum(small) * g.batch / (device.hbm_bandwidth * device.mem_efficiency)
    return device.gemm.overhead_s + max(compute, memory)


def fused_exposed(comm_s: float, gemm_s: float, chunks: int, fused: bool) -> float:
    """Exposed communication of a collective fused with a GEMM it overlaps (module doc)."""
    if not fused or comm_s <= 0:
        return comm_s
    return max(0.0, comm_s - gemm_s) + min(comm_s, gemm_s) / max(chunks, 1)


@dataclasses.dataclass(slots=True, frozen=True)
class LayerCost:
    """Seconds for one layer and one micro-batch on one GPU, and what they are made of."""

    fwd: float            # forward compute incl. exposed TP comm
    dgrad: float          # input-gradient compute incl. exposed TP comm (the ZB-H1 "I")
    wgrad: float          # weight-gradient GEMMs (the ZB-H1 "W")
    recompute: float      # extra forward work in the backward (selective or full)
    tp_comm: float        # raw TP collective seconds, fwd + bwd + recompute
    tp_exposed: float     # of which exposed
    num_comm_ops: int     # collectives per layer and micro-batch (fwd + bwd + recompute)
    fwd_flops: float      # per GPU, executed (flash: half the attention core)
    attn_flops: float     # attention core forward FLOPs per GPU, executed (recomputation)
    ep_comm: float = 0.0      # raw MoE all-to-all seconds, fwd + bwd + recompute
    ep_exposed: float = 0.0   # of which exposed (already inside fwd, dgrad, recompute)
    ep_ops: int = 0           # all-to-alls per layer and micro-batch
    cp_comm: float = 0.0      # raw CP (KV exchange) seconds, fwd + bwd + recompute
    cp_exposed: float = 0.0   # of which exposed (already inside fwd, dgrad, recompute)
    cp_bytes: float = 0.0     # bytes this GPU sends for CP, fwd + bwd + recompute
    cp_p2p_sides: int = 0     # ring: P2P sides (send or receive) per layer and micro-batch


def _gemms(model: ModelSpec, layout: Layout, moe: bool = False) -> dict[str, Gemm]:
    t, cp, b = layout.tp, layout.cp, layout.micro_batch
    s = model.seq_len
    tokens = b * s / cp
    h, hd, f = model.hidden, model.head_dim, model.ffn_dim
    kv_local = model.kv_dim / t if model.kv_heads >= t else hd
    heads = model.num_heads / t
    n_act = 2 if model.gated_mlp else 1
    if model.standard_attention:
        attn = {"qkv": Gemm(tokens, h / t + 2 * kv_local, h),
                "scores": Gemm(s / cp, s, hd, b * heads),
                "av": Gemm(s / cp, hd, s, b * heads),
                "out": Gemm(tokens, h, h / t)}
    else:
        # MLA's down- and up-projections are counted as one GEMM of the same FLOPs (K = h).
        vd = model.v_head_dim if model.is_mla else hd
        qkv_n = model.attn_proj_params()[0] / h / t if model.is_mla else \
            model.q_width / t + 2 * kv_local
        attn = {"qkv": Gemm(tokens, qkv_n, h),
                "scores": Gemm(s / cp, s, model.qk_head_dim, b * heads),
                "av": Gemm(s / cp, vd, s, b * heads),
                "out": Gemm(tokens, h, model.num_heads * vd / t)}
    if moe:
        return {**attn, **_moe_gemms(model, layout)}
    return {**attn, "fc1": Gemm(tokens, n_act * f / t, h), "fc2": Gemm(tokens, h, f / t)}


def _moe_tokens(model: ModelSpec, layout: Layout) -> float:
    """Tokens one GPU routes per micro-batch: its 1/t sequence shard with SP, else all."""
    tokens = layout.micro_batch * model.seq_len / layout.cp
    return tokens / layout.tp if layout.sequence_parallel else tokens


def _moe_gemms(model: ModelSpec, layout: Layout) -> dict[str, Gemm]:
    h, fe, e = model.hidden, model.expert_ffn, model.num_experts
    tok = _moe_tokens(model, layout)
    local = e / layout.ep
    rows = routed_rows(model, layout, tok)
    out = {"router": Gemm(tok, e, h),
           "expert_fc1": Gemm(rows / local, 2 * fe, h, local),
           "expert_fc2": Gemm(rows / local, h, fe, local)}
    if model.num_shared_experts:
        sf = model.num_shared_experts * fe
        out.update(shared_fc1=Gemm(tok, 2 * sf, h), shared_fc2=Gemm(tok, h, sf))
    return out


def ep_volume(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(dispatch bytes, combine bytes) one GPU sends per MoE layer and micro-batch, forward;
    the backward moves the combine's bytes twice (gradients travel in the activation dtype)."""
    rows = routed_rows(model, layout, _moe_tokens(model, layout))
    disp = WIRE_BYTES[layout.ep_dispatch] if layout.dtype_bytes == 2 else layout.dtype_bytes
    return rows * model.hidden * disp, rows * model.hidden * layout.dtype_bytes


def ep_exchange_efficiency(device: DeviceProfile, layout: Layout) -> float:
    """The links' share a MoE exchange runs at: DeepEP's once-per-node kernels
    (``layout.ep_node_dedup``) or the NCCL collectives (``all_to_all_time``'s ``efficiency``)."""
    return device.dedup_a2a_efficiency if layout.ep_node_dedup else device.a2a_efficiency


def moe_exposed(comm_f: float, comm_b: float, hide_f: float, hide_b: float, work_f: float,
                work_b: float, layout: Layout, num_microbatches: int) -> tuple[float, float]:
    """(forward, backward) exposed all-to-all seconds of one MoE layer and micro-batch.

    Chunked (``overlap.ep``): ``fused_exposed`` with ``ep_chunks`` pieces under the expert and
    shared-expert GEMMs (``hide_*``). In-schedule (``overlap.ep_schedule``, pp > 1): in the
    ``(m - pp + 1)/m`` of micro-batches that run in the 1F1B steady state, what is left of a
    forward all-to-all hides under the layer's backward compute of another micro-batch
    (``work_b``) and a backward one under a forward (``work_f``)."""
    ov = layout.overlap
    e_f = fused_exposed(comm_f, hide_f, layout.ep_chunks, ov.ep)
    e_b = fused_exposed(comm_b, hide_b, layout.ep_chunks, ov.ep)
    if ov.ep_schedule and layout.pp > 1:
        m = num_microbatches
        steady = max(0, m - layout.pp + 1) / m
        e_f = (1 - steady) * e_f + steady * max(0.0, e_f - work_b)
        e_b = (1 - steady) * e_b + steady * max(0.0, e_b - work_f)
    return e_f, e_b


def _elementwise(model: ModelSpec, layout: Layout, flash: bool,
                 moe: bool = False) -> tuple[float, float]:
    """(forward bytes of the layer's element-wise ops, of which the attention core's). A MoE
    layer's SwiGLU runs on its routed rows and shared experts, and it permutes the rows into
    expert order and back (read and write, 8 bytes per element of a row in all)."""
    t, cp, b = layout.tp, layout.cp, layout.micro_batch
    tokens = b * model.seq_len / cp
    mask = 1.0 if model.dropout else 0.0
    stream = tokens * model.hidden / (t if layout.sequence_parallel else 1)
    if moe:
        tok = _moe_tokens(model, layout)
        rows = routed_rows(model, layout, tok)
        fe = model.expert_ffn
        byts = stream * (20.0 + 10.0 * mask) + (rows + tok * model.num_shared_experts) * fe * 6.0 \
            + rows * model.hidden * 8.0
    else:
        act = tokens * model.ffn_dim / t
        byts = stream * (20.0 + 10.0 * mask) + act * (6.0 if model.gated_mlp else 4.0)
    attn = 0.0
    if not flash:
        scores = b * model.num_heads / t * (model.seq_len / cp) * model.seq_len
        attn = scores * (4.0 + 5.0 * mask)
    scale = layout.dtype_bytes / 2.0  # the counts above are for 2-byte elements
    return (byts + attn) * scale, attn * scale


def layer_cost(model: ModelSpec, layout: Layout, device: DeviceProfile, *, tp_place: Placement,
               cp_place: Placement, flash: bool, moe: bool = False,
               ep_place: Placement | None = None, num_microbatches: int = 1,
               cp_method: str | None = None) -> LayerCost:
    """``cp_method`` (None: the layout's) must be a concrete method when cp > 1."""
    cp_method = cp_method or layout.cp_method
    gm = _gemms(model, layout, moe)
    e = layout.dtype_bytes
    g = {k: gemm_time(device, v, e) for k, v in gm.items()}
    g_dgrad = {k: gemm_time(device, v.dgrad(), e) for k, v in gm.items()}
    g_wgrad = {k: gemm_time(device, v.wgrad(), e) for k, v in gm.items()}
    if moe:  # the experts run as one grouped GEMM per matrix
        for k in ("expert_fc1", "expert_fc2"):
            for d in (g, g_dgrad, g_wgrad):
                d[k] /= device.grouped_gemm_efficiency
    rescore = 0.0  # the scores a flash backward recomputes
    if flash:
        for k in ("scores", "av"):
            g[k] = flash_time(device, gm[k], e)
            g_dgrad[k] = flash_time(device, gm[k].dgrad(), e, backward=True)
            g_wgrad[k] = flash_time(device, gm[k].wgrad(), e, backward=True)
        rescore = flash_time(device, gm["scores"], e, backward=True)
    mem_bw = device.hbm_bandwidth * device.mem_efficiency
    ew_bytes, attn_bytes = _elementwise(model, layout, flash, moe)
    host_f, host_b = device.host_tp_layer_s if layout.tp > 1 else device.host_layer_s
    ew_fwd = ew_bytes / mem_bw + host_f
    ew_bwd = 2.0 * ew_bytes / mem_bw + host_b
    attn_core = g["scores"] + g["av"] + attn_bytes / mem_bw

    # Tensor-parallel collectives, each paired with the GEMM it is fused with.
    t = layout.tp
    act_bytes = e * layout.micro_batch * model.seq_len / layout.cp * model.hidden
    fused = layout.overlap.tp
    if t > 1 and layout.sequence_parallel:
        ag = collective_time("all_gather", act_bytes, tp_place, device, tp=True)[0]
        rs = collective_time("reduce_scatter", act_bytes, tp_place, device, tp=True)[0]
        fwd_pairs = [(ag, g["qkv"]), (rs, g["out"])]
        # Backward: column layers reduce-scatter dX under dgrad + wgrad; row layers
        # all-gather dY under their dgrad.
        bwd_pairs = [(rs, g_dgrad["qkv"] + g_wgrad["qkv"]), (ag, g_dgrad["out"])]
        if not moe:  # a MoE block is left to EP: no TP collectives around it
            fwd_pairs[2:] = [(ag, g["fc1"]), (rs, g["fc2"])]
            bwd_pairs[2:] = [(rs, g_dgrad["fc1"] + g_wgrad["fc1"]), (ag, g_dgrad["fc2"])]
    elif t > 1:
        ar = collective_time("all_reduce", act_bytes, tp_place, device, tp=True)[0]
        fwd_pairs = [(ar, g["out"])] + ([] if moe else [(ar, g["fc2"])])
        bwd_pairs = [(ar, g_wgrad["qkv"])] + ([] if moe else [(ar, g_wgrad["fc1"])])
    else:
        fwd_pairs, bwd_pairs = [], []
    fwd_exp = sum(fused_exposed(c, gs, t, fused) for c, gs in fwd_pairs)
    bwd_exp = sum(fused_exposed(c, gs, t, fused) for c, gs in bwd_pairs)
    fwd_comm = sum(c for c, _ in fwd_pairs)
    bwd_comm = sum(c for c, _ in bwd_pairs)

    fwd = sum(g.values()) + ew_fwd + fwd_exp
    dgrad = sum(g_dgrad.values()) + g_wgrad["scores"] + g_wgrad["av"] + ew_bwd + bwd_exp
    wgrad = sum(v for k, v in g_wgrad.items() if k not in ("scores", "av"))
    n_ops = len(fwd_pairs) + len(bwd_pairs)
    # Context parallelism: the attention core's KV exchange, partly under its blocks. Flash
    # attention's backward recomputes the scores, so that counts as backward block work.
    attn_b = g_dgrad["scores"] + g_dgrad["av"] + g_wgrad["scores"] + g_wgrad["av"] + rescore
    cpc = cp_cost(model, layout, device, cp_place, cp_method, attn_core, attn_b)
    fwd += cpc.exposed_f
    dgrad += cpc.exposed_b
    ep_f = ep_b = ep_ef = ep_eb = 0.0
    if moe and ep_place is not None and ep_place.size > 1:
        # Dispatch + combine forward; output and input gradients backward.
        disp, comb = ep_volume(model, layout)
        kw = {"node_dedup_k": model.moe_top_k if layout.ep_node_dedup else 0,
              "efficiency": ep_exchange_efficiency(device, layout)}
        ep_f = all_to_all_time(disp, ep_place, device, **kw) + \
            all_to_all_time(comb, ep_place, device, **kw)
        ep_b = 2.0 * all_to_all_time(comb, ep_place, device, **kw)
        experts = [k for k in g if k.startswith(("expert", "shared"))]
        hide_f = sum(g[k] for k in experts)
        hide_b = sum(g_dgrad[k] + g_wgrad[k] for k in experts)
        ep_ef, ep_eb = moe_exposed(ep_f, ep_b, hide_f, hide_b, fwd, dgrad + wgrad, layout,
                                   num_microbatches)
        # An exchange that runs its own kernels on SMs (DeepEP's) slows what it hides under:
        # that work keeps 1 - share of the SMs while the exchange runs.
        share = device.dedup_a2a_sm_share if layout.ep_node_dedup else 0.0
        slow = share / (1.0 - share)
        fwd += ep_ef + slow * (ep_f - ep_ef)
        dgrad += ep_eb + slow * (ep_b - ep_eb)
    ep_comm, ep_exp = ep_f + ep_b, ep_ef + ep_eb
    cp_comm, cp_exp = cpc.comm_f + cpc.comm_b, cpc.exposed_f + cpc.exposed_b
    cp_sent, cp_sides = cpc.bytes_f + cpc.bytes_b, cpc.p2p_sides
    if layout.recompute == "full":
        recompute, rec_comm, rec_exp, n_rec = fwd, fwd_comm, fwd_exp, len(fwd_pairs)
        ep_comm, ep_exp = ep_comm + ep_f, ep_exp + ep_ef
        cp_comm, cp_exp = cp_comm + cpc.comm_f, cp_exp + cpc.exposed_f
        cp_sent += cpc.bytes_f
        cp_sides += 2 * (layout.cp - 1) if cpc.method == "ring" else 0
    elif flash:
        # Flash attention's backward recomputes the scores (QK^T) itself, whatever the mode.
        recompute, rec_comm, rec_exp, n_rec = rescore, 0.0, 0.0, 0
    elif layout.recompute == "selective":
        recompute, rec_comm, rec_exp, n_rec = attn_core, 0.0, 0.0, 0
    else:
        recompute, rec_comm, rec_exp, n_rec = 0.0, 0.0, 0.0, 0
    b = layout.micro_batch
    if moe:  # per GPU, from the GEMMs (the MoE block is not TP-sharded; padded rows count)
        fwd_flops = sum(v.flops for v in gm.values())
    else:
        fwd_flops = model.layer_fwd_flops(b * model.seq_len, b) / t / layout.cp
    # Executed FLOPs (HFU): a causal flash kernel skips half of the scores.
    attn_flops = sum(gm[k].flops for k in ("scores", "av")) * (0.5 if flash else 1.0)
    if flash:
        fwd_flops -= attn_flops
    return LayerCost(fwd=fwd, dgrad=dgrad, wgrad=wgrad, recompute=recompute,
                     tp_comm=fwd_comm + bwd_comm + rec_comm,
                     tp_exposed=fwd_exp + bwd_exp + rec_exp, num_comm_ops=n_ops + n_rec,
                     fwd_flops=fwd_flops, attn_flops=attn_flops,
                     ep_comm=ep_comm, ep_exposed=ep_exp,
                     ep_ops=(4 + (layout.recompute == "full") * 2) if ep_f else 0,
                     cp_comm=cp_comm, cp_exposed=cp_exp, cp_bytes=cp_sent,
                     cp_p2p_sides=cp_sides)


def dp_group_placement(cluster: ClusterSpec, layout: Layout, dp: int) -> Placement:
    """The dp x cp ranks that hold the same parameters (one DP reduction group)."""
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    return ranks_placement(cluster, [(d * pp * cp + c) * tp for d in range(dp)
                                     for c in range(cp)])


class LayerContext:
    """What every estimate of a layout shares (every CP method's, the offload terms'): the
    groups' placements and the layer builder. ``ep_group`` replaces the EP group's placement
    (``estimate``)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, layout: Layout,
                 ep_group: Placement | None) -> None:
        self.model, self.cluster = model, cluster
        self.dp = dp = layout.dp(cluster)
        self.m = layout.num_microbatches(cluster)
        kw = dict(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=dp)
        self.tp_place = axis_placement(cluster, "tp", **kw)
        self.cp_place = axis_placement(cluster, "cp", **kw)
        self.dp_place = dp_group_placement(cluster, layout, dp)
        self.ep_place = self.edp_place = None
        if model.is_moe:
            geo = dict(tp=layout.tp, cp=layout.cp, pp=layout.pp)
            self.ep_place = ep_group or ep_placement(cluster, ep=layout.ep, **geo)
            self.edp_place = edp_placement(cluster, dp=dp, ep=layout.ep, **geo)
        self.layout = layout

    def layers(self, cp_method: str) -> tuple[LayerCost, LayerCost | None]:
        """(dense layer, MoE layer or None) with ``cp_method``'s KV exchange."""
        lay, dev = self.layout, self.cluster.device
        kw = dict(tp_place=self.tp_place, cp_place=self.cp_place, flash=lay.flash_attention,
                  cp_method=cp_method)
        dense = layer_cost(self.model, lay, dev, **kw)
        if not self.model.is_moe:
            return dense, None
        return dense, layer_cost(self.model, lay, dev, moe=True, ep_place=self.ep_place,
                                 num_microbatches=self.m, **kw)
