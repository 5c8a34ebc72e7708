"""Per-layer compute and tensor-parallel communication, for one micro-batch on one GPU.

GEMMs of a layer, per GPU (T = b*s/cp tokens; with sequence parallelism the column GEMMs run on
the gathered T tokens), forward:

    qkv    (T, (h + 2kv)/t, h)      scores  b*a/t x (s/cp, s, hd)     av  b*a/t x (s/cp, hd, s)
    out    (T, h, h/t)              fc1     (T, n_act*F/t, h)         fc2 (T, h, F/t)

Backward: every weight GEMM (m, n, k) has a dgrad (m, k, n) and a wgrad (k, n, m). A GEMM costs
``max(FLOPs / (peak * eff(shape)), HBM bytes / achievable bandwidth) + overhead``; element-wise
work is HBM traffic. A fused TP op takes ``max(c, g) + min(c, g)/tp``: its exposed part is
``max(0, c - g) + min(c, g)/tp``. Unfused, all of ``c`` is exposed.
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses

from overlap.plan.comm import Placement, collective_time
from overlap.plan.hardware import DeviceProfile
from overlap.plan.layout import Layout
from overlap.plan.models import ModelSpec

__all__ = ["Gemm", "gemm_time", "LayerCost", "layer_cost", "fused_exposed"]


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
    tp_comm: float        # raw TP (and CP) collective seconds, fwd + bwd + recompute
    tp_exposed: float     # of which exposed
    num_comm_ops: int     # collectives per layer and micro-batch (fwd + bwd + recompute)
    fwd_flops: float      # per GPU
    attn_flops: float     # attention core forward FLOPs per GPU (selective recompute)


def _gemms(model: ModelSpec, layout: Layout) -> dict[str, Gemm]:
    t, cp, b = layout.tp, layout.cp, layout.micro_batch
    s = model.seq_len
    tokens = b * s / cp
    h, hd, f = model.hidden, model.head_dim, model.ffn_dim
    kv_local = model.kv_dim / t if model.kv_heads >= t else hd
    heads = model.num_heads / t
    n_act = 2 if model.gated_mlp else 1
    return {
        "qkv": Gemm(tokens, h / t + 2 * kv_local, h),
        "scores": Gemm(s / cp, s, hd, b * heads),
        "av": Gemm(s / cp, hd, s, b * heads),
        "out": Gemm(tokens, h, h / t),
        "fc1": Gemm(tokens, n_act * f / t, h),
        "fc2": Gemm(tokens, h, f / t),
    }


def _elementwise(model: ModelSpec, layout: Layout, flash: bool) -> tuple[float, float]:
    """(forward bytes of the layer's element-wise ops, of which the attention core's)."""
    t, cp, b = layout.tp, layout.cp, layout.micro_batch
    tokens = b * model.seq_len / cp
    mask = 1.0 if model.dropout else 0.0
    stream = tokens * model.hidden / (t if layout.sequence_parallel else 1)
    act = tokens * model.ffn_dim / t
    byts = stream * (20.0 + 10.0 * mask) + act * (6.0 if model.gated_mlp else 4.0)
    attn = 0.0
    if not flash:
        scores = b * model.num_heads / t * (model.seq_len / cp) * model.seq_len
        attn = scores * (4.0 + 5.0 * mask)
    scale = layout.dtype_bytes / 2.0  # the counts above are for 2-byte elements
    return (byts + attn) * scale, attn * scale


def layer_cost(model: ModelSpec, layout: Layout, device: DeviceProfile, *, tp_place: Placement,
               cp_place: Placement, flash: bool) -> LayerCost:
    gm = _gemms(model, layout)
    e = layout.dtype_bytes
    g = {k: gemm_time(device, v, e) for k, v in gm.items()}
    g_dgrad = {k: gemm_time(device, v.dgrad(), e) for k, v in gm.items()}
    g_wgrad = {k: gemm_time(device, v.wgrad(), e) for k, v in gm.items()}
    mem_bw = device.hbm_bandwidth * device.mem_efficiency
    ew_bytes, attn_bytes = _elementwise(model, layout, flash)
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
        fwd_pairs = [(ag, g["qkv"]), (rs, g["out"]), (ag, g["fc1"]), (rs, g["fc2"])]
        # Backward: column layers reduce-scatter dX under dgrad + wgrad; row layers
        # all-gather dY under their dgrad.
        bwd_pairs = [(rs, g_dgrad["qkv"] + g_wgrad["qkv"]), (ag, g_dgrad["out"]),
                     (rs, g_dgrad["fc1"] + g_wgrad["fc1"]), (ag, g_dgrad["fc2"])]
    elif t > 1:
        ar = collective_time("all_reduce", act_bytes, tp_place, device, tp=True)[0]
        fwd_pairs = [(ar, g["out"]), (ar, g["fc2"])]
        bwd_pairs = [(ar, g_wgrad["qkv"]), (ar, g_wgrad["fc1"])]
    else:
        fwd_pairs, bwd_pairs = [], []
    if layout.cp > 1:
        # Ring attention: cp-1 exchanges of this rank's K and V (forward), of dK and dV
        # (backward), under the attention core; modelled as one collective each way.
        kv_bytes = 2 * e * layout.micro_batch * model.seq_len / layout.cp * model.kv_dim / t
        ring = collective_time("all_gather", kv_bytes * layout.cp, cp_place, device)[0]
        fwd_pairs.append((ring, g["scores"] + g["av"]))
        bwd_pairs.append((2 * ring, g_dgrad["scores"] + g_dgrad["av"]))
    fwd_exp = sum(fused_exposed(c, gs, t, fused) for c, gs in fwd_pairs)
    bwd_exp = sum(fused_exposed(c, gs, t, fused) for c, gs in bwd_pairs)
    fwd_comm = sum(c for c, _ in fwd_pairs)
    bwd_comm = sum(c for c, _ in bwd_pairs)

    fwd = sum(g.values()) + ew_fwd + fwd_exp
    dgrad = sum(g_dgrad.values()) + g_wgrad["scores"] + g_wgrad["av"] + ew_bwd + bwd_exp
    wgrad = sum(v for k, v in g_wgrad.items() if k not in ("scores", "av"))
    n_ops = len(fwd_pairs) + len(bwd_pairs)
    if layout.recompute == "full":
        recompute, rec_comm, rec_exp, n_rec = fwd, fwd_comm, fwd_exp, len(fwd_pairs)
    elif flash:
        # Flash attention's backward recomputes the scores (QK^T) itself, whatever the mode.
        recompute, rec_comm, rec_exp, n_rec = g["scores"], 0.0, 0.0, 0
    elif layout.recompute == "selective":
        recompute, rec_comm, rec_exp, n_rec = attn_core, 0.0, 0.0, 0
    else:
        recompute, rec_comm, rec_exp, n_rec = 0.0, 0.0, 0.0, 0
    b = layout.micro_batch
    return LayerCost(fwd=fwd, dgrad=dgrad, wgrad=wgrad, recompute=recompute,
                     tp_comm=fwd_comm + bwd_comm + rec_comm,
                     tp_exposed=fwd_exp + bwd_exp + rec_exp, num_comm_ops=n_ops + n_rec,
                     fwd_flops=model.layer_fwd_flops(b * model.seq_len, b) / t / layout.cp,
                     attn_flops=sum(gm[k].flops for k in ("scores", "av")))
