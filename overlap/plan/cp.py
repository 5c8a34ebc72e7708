"""Context parallelism as ``overlap.cp`` runs it: KV bytes, seconds raw and exposed, buffers and
stored extras per method, for one layer and one micro-batch on one GPU.

Legend: c = cp, e = element bytes, a = 4/e (fp32 over the wire dtype); Bq, Bo, Bkv: this GPU's
local q, attention output and K + V (its s/c tokens, its TP rank's heads); A: its attention core
seconds, u = A / 2c (zig-zag: rank r's causal work is 2c units of one chunk x chunk each).
ring       fwd c-1 hops of Bkv, each under one step (2u): (c-1) max(0, kv - 2u); bwd c-1 hops
           of Bkv and c of the fp32 dK/dV (a Bkv), kv + acc in flight together, the last acc
           exposed. allgather  two half gathers; the own block (2u) and piece 0 (c-1+r units)
           hide them; bwd gathers again and reduce-scatters fp32 dK/dV per piece, the last
           exposed (a per-rank timeline, worst rank). ulysses  all-to-alls of q+kv and o
           forward, dO and dq+dkv backward, (c-1)/c sent, exposed; kv repeated c/kv_t times.
Buffers: ring 2 Bkv (1 + a); allgather c Bkv (1 + 2a); ulysses (Bq + r Bkv) a + 2 (Bq + r Bkv).
Stored per layer: the fp32 output and lse (ulysses: also the repeated kv).
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses

from overlap.plan.comm import Placement, all_to_all_time, collective_time, p2p_time
from overlap.plan.hardware import DeviceProfile
from overlap.plan.layout import CP_METHODS, Layout
from overlap.plan.models import ModelSpec

__all__ = ["CPCost", "cp_blocks", "cp_bytes", "cp_cost", "cp_buffer_bytes", "cp_stored_bytes",
           "link_split", "ulysses_repeat", "ACC_BYTES"]

ACC_BYTES = 4.0  # dK/dV accumulate and travel in fp32 (ring hops, all-gather reduce-scatter)


@dataclasses.dataclass(slots=True, frozen=True)
class CPCost:
    """One layer, one micro-batch, one GPU: seconds raw and exposed, bytes sent, P2P sides."""

    method: str
    comm_f: float
    comm_b: float
    exposed_f: float
    exposed_b: float
    bytes_f: float
    bytes_b: float
    p2p_sides: int      # ring: send and receive sides (the CPU twin's host cost)


def _kv_heads(model: ModelSpec, tp: int) -> float:
    return model.kv_heads / tp if model.kv_heads >= tp else 1  # replicated below tp


def cp_blocks(model: ModelSpec, layout: Layout) -> tuple[float, float, float]:
    """(Bq, Bkv, Bo): bytes of this GPU's local q, K + V and attention output."""
    t, e = layout.tp, layout.dtype_bytes
    tokens = layout.micro_batch * model.seq_len / layout.cp
    per_head = (model.k_width + model.v_width) / model.kv_heads
    bq = e * tokens * model.q_width / t
    bo = e * tokens * model.num_heads * (model.v_head_dim if model.is_mla else model.head_dim) / t
    return bq, e * tokens * _kv_heads(model, t) * per_head, bo


def ulysses_repeat(model: ModelSpec, layout: Layout) -> int:
    """How many times Ulysses repeats each kv head so that cp ranks get whole heads (1 unless
    the TP rank's kv heads are fewer than cp)."""
    return max(1, layout.cp // int(_kv_heads(model, layout.tp)))


def _ratio(layout: Layout) -> float:
    return ACC_BYTES / layout.dtype_bytes


def cp_bytes(model: ModelSpec, layout: Layout, method: str) -> tuple[float, float]:
    """(forward, backward) bytes one GPU sends per layer and micro-batch."""
    c = layout.cp
    if c <= 1:
        return 0.0, 0.0
    bq, bkv, bo = cp_blocks(model, layout)
    a = _ratio(layout)
    if method == "ring":
        return (c - 1) * bkv, (c - 1) * bkv + c * bkv * a
    if method == "allgather":
        return (c - 1) * bkv, (c - 1) * bkv * (1.0 + a)
    if method == "ulysses":
        rep = ulysses_repeat(model, layout)
        share = (c - 1) / c
        return share * (bq + rep * bkv + bo), share * (bo + bq + rep * bkv * (a if rep > 1 else 1))
    raise ValueError(f"--cp-method {method!r} is unknown; expected one of {list(CP_METHODS)}")


def cp_buffer_bytes(model: ModelSpec, layout: Layout, method: str) -> float:
    """Peak bytes of the exchange's own buffers during one layer's attention (module doc)."""
    if layout.cp <= 1:
        return 0.0
    bq, bkv, _ = cp_blocks(model, layout)
    a = _ratio(layout)
    if method == "ring":  # the current and next kv block, the accumulators in and out
        return 2.0 * bkv * (1.0 + a)
    if method == "allgather":  # both gathered pieces, one piece's fp32 copy and its dK/dV,
        return layout.cp * bkv * (1.0 + 2.0 * a)  # and the two reduce-scatter inputs
    if method == "ulysses":  # fp32 dq, dkv and the send and receive packets of their trip
        x = bq + ulysses_repeat(model, layout) * bkv
        return x * a + 2.0 * x
    raise ValueError(f"--cp-method {method!r} is unknown; expected one of {list(CP_METHODS)}")


def cp_stored_bytes(model: ModelSpec, layout: Layout, method: str) -> float:
    """Bytes a CP attention saves for its backward per layer and micro-batch beyond what flash
    attention stores (q, k, v and the output): the fp32 output (a copy unless the activations
    are fp32; Ulysses keeps its own in the head layout), the fp32 log-sum-exp, and Ulysses'
    repeated kv heads."""
    if layout.cp <= 1:
        return 0.0
    _, bkv, bo = cp_blocks(model, layout)
    tokens = layout.micro_batch * model.seq_len / layout.cp
    lse = 4.0 * tokens * model.num_heads / layout.tp
    if method == "ulysses":
        return bo * _ratio(layout) + lse + (ulysses_repeat(model, layout) - 1) * bkv
    return (bo * _ratio(layout) if layout.dtype_bytes < ACC_BYTES else 0.0) + lse


def link_split(method: str, place: Placement) -> tuple[float, float]:
    """(NVLink, network) shares of the bytes a GPU sends, on average over the CP group: a ring
    (the ring attention's, NCCL's all-gather and reduce-scatter) crosses nodes on ``nodes`` of
    its c edges; an all-to-all sends (k-1)/(c-1) of them inside the node (k per node)."""
    c = place.size
    if c <= 1 or place.nodes == 1:
        return 1.0, 0.0
    inside = (place.per_node - 1) / (c - 1) if method == "ulysses" else (c - place.nodes) / c
    return inside, 1.0 - inside


def _allgather_exposed(c: int, half: float, rs: float, u_f: float, u_b: float
                       ) -> tuple[float, float]:
    """(forward, backward) exposed seconds of the all-gather method on its slowest rank. The
    pieces' collectives run one after another on the group's communicator; rank r attends its
    own block (2 units), then piece 0 (c-1+r units), then piece 1 (c-1-r units)."""
    worst_f = worst_b = 0.0
    for r in range(c):
        t = max(2 * u_f, half) + (c - 1 + r) * u_f
        t = max(t, 2 * half) + (c - 1 - r) * u_f
        worst_f = max(worst_f, t - 2 * c * u_f)
        t = max(2 * u_b, half) + (c - 1 + r) * u_b
        rs0_end = max(t, 2 * half) + rs  # posted after piece 0, hidden under piece 1
        t = max(t, 2 * half) + (c - 1 - r) * u_b
        worst_b = max(worst_b, max(t, rs0_end) + rs - 2 * c * u_b)
    return worst_f, worst_b


def cp_cost(model: ModelSpec, layout: Layout, device: DeviceProfile, place: Placement,
            method: str, attn_f: float, attn_b: float) -> CPCost:
    """The method's seconds (module docstring) given the attention core's forward and backward
    seconds ``attn_f``, ``attn_b`` on this GPU; ``layout.overlap.cp`` off exposes them all."""
    c = layout.cp
    bytes_f, bytes_b = cp_bytes(model, layout, method)
    if c <= 1:
        return CPCost(method, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
    bq, bkv, bo = cp_blocks(model, layout)
    a = _ratio(layout)
    u_f, u_b = attn_f / (2 * c), attn_b / (2 * c)
    sides = 0
    if method == "ring":
        cross = place.nodes > 1
        kv, acc = p2p_time(bkv, cross, device), p2p_time(bkv * a, cross, device)
        comm_f, comm_b = (c - 1) * kv, (c - 1) * kv + c * acc
        step_f, step_b = 2 * u_f, 2 * u_b
        exp_f = (c - 1) * max(0.0, kv - step_f)
        exp_b = max(0.0, kv - step_b) + (c - 2) * max(0.0, kv + acc - step_b) + \
            max(0.0, acc - step_b) + acc
        sides = 2 * (2 * (c - 1) + c)
    elif method == "allgather":
        half = collective_time("all_gather", c * bkv / 2, place, device)[0]
        rs = collective_time("reduce_scatter", c * bkv / 2 * a, place, device)[0]
        comm_f, comm_b = 2 * half, 2 * half + 2 * rs
        exp_f, exp_b = _allgather_exposed(c, half, rs, u_f, u_b)
    else:
        rep = ulysses_repeat(model, layout)
        comm_f = all_to_all_time(bq + rep * bkv, place, device) + \
            all_to_all_time(bo, place, device)
        comm_b = all_to_all_time(bo, place, device) + \
            all_to_all_time(bq + rep * bkv * (a if rep > 1 else 1.0), place, device)
        exp_f, exp_b = comm_f, comm_b
    if not layout.overlap.cp:
        exp_f, exp_b = comm_f, comm_b
    return CPCost(method, comm_f, comm_b, exp_f, exp_b, bytes_f, bytes_b, sides)
