"""Context parallelism: KV bytes, transfer seconds and their exposed part, per method, for one
layer and one micro-batch on one GPU (ring, all-gather, Ulysses).

Legend: c = cp, e = element bytes; Bq, Bo, Bkv: this GPU's local q, attention output and K + V
(its s/c tokens, its TP rank's heads); A_f, A_b: its attention core seconds, blk = A / c (zig-zag:
every rank and every ring step does an equal share of the causal work).
ring       fwd c-1 hops of Bkv, each under a block: (c-1) max(0, kv - blk_f) exposed; bwd c-1
           hops of Bkv and c of the fp32 dK/dV accumulator (overlap.cp.ring), kv and acc:
           max(0, kv - blk) + (c-2) max(0, kv + acc - blk) + max(0, acc - blk) + acc.
allgather  fwd gather under the local block; bwd gather again under it, reduce-scatter exposed.
ulysses    4 all-to-alls (q, k, v, o) forward and 4 backward, (c-1)/c sent, all exposed.
Buffers of one layer: ring 2 Bkv (1 + 4/e), allgather 2c Bkv, ulysses 2 (Bq + Bkv) + Bo.
The narrative: docs/design/planner.md.
"""
from __future__ import annotations

import dataclasses

from overlap.plan.comm import Placement, all_to_all_time, collective_time, p2p_time
from overlap.plan.hardware import DeviceProfile
from overlap.plan.layout import CP_METHODS, Layout
from overlap.plan.models import ModelSpec

__all__ = ["CPCost", "cp_blocks", "cp_bytes", "cp_cost", "cp_buffer_bytes", "link_split",
           "ACC_BYTES"]

ACC_BYTES = 4.0  # the ring's dK/dV accumulators travel in fp32 (overlap/cp/ring.py)


@dataclasses.dataclass(slots=True, frozen=True)
class CPCost:
    """One layer, one micro-batch, one GPU: seconds raw and exposed, bytes sent, ops."""

    method: str
    comm_f: float
    comm_b: float
    exposed_f: float
    exposed_b: float
    bytes_f: float
    bytes_b: float
    p2p_sides: int      # ring: send and receive sides (the CPU twin's host cost)


def cp_blocks(model: ModelSpec, layout: Layout) -> tuple[float, float, float]:
    """(Bq, Bkv, Bo): bytes of this GPU's local q, K + V and attention output."""
    t, c, e = layout.tp, layout.cp, layout.dtype_bytes
    tokens = layout.micro_batch * model.seq_len / c
    kv_heads = model.kv_heads / t if model.kv_heads >= t else 1  # replicated below tp
    per_head = (model.k_width + model.v_width) / model.kv_heads
    bq = e * tokens * model.q_width / t
    bo = e * tokens * model.num_heads * (model.v_head_dim if model.is_mla else model.head_dim) / t
    return bq, e * tokens * kv_heads * per_head, bo


def cp_bytes(model: ModelSpec, layout: Layout, method: str) -> tuple[float, float]:
    """(forward, backward) bytes one GPU sends per layer and micro-batch."""
    c = layout.cp
    if c <= 1:
        return 0.0, 0.0
    bq, bkv, bo = cp_blocks(model, layout)
    if method == "ring":
        return (c - 1) * bkv, (c - 1) * bkv + c * bkv * ACC_BYTES / layout.dtype_bytes
    if method == "allgather":
        return (c - 1) * bkv, 2.0 * (c - 1) * bkv
    if method == "ulysses":
        sent = (c - 1) / c * (bq + bkv + bo)
        return sent, sent
    raise ValueError(f"--cp-method {method!r} is unknown; expected one of {list(CP_METHODS)}")


def cp_buffer_bytes(model: ModelSpec, layout: Layout, method: str) -> float:
    """Peak bytes of the exchange's own buffers during one layer's attention (module doc)."""
    if layout.cp <= 1:
        return 0.0
    bq, bkv, bo = cp_blocks(model, layout)
    if method == "ring":
        return 2.0 * bkv * (1.0 + ACC_BYTES / layout.dtype_bytes)
    if method == "allgather":
        return 2.0 * layout.cp * bkv
    if method == "ulysses":
        return 2.0 * (bq + bkv) + bo
    raise ValueError(f"--cp-method {method!r} is unknown; expected one of {list(CP_METHODS)}")


def link_split(method: str, place: Placement) -> tuple[float, float]:
    """(NVLink, network) shares of the bytes a GPU sends, on average over the CP group: a ring
    (the ring attention's, NCCL's all-gather and reduce-scatter) crosses nodes on ``nodes`` of
    its c edges; an all-to-all sends (k-1)/(c-1) of them inside the node (k per node)."""
    c = place.size
    if c <= 1 or place.nodes == 1:
        return 1.0, 0.0
    if method == "ulysses":
        inside = (place.per_node - 1) / (c - 1)
    else:
        inside = (c - place.nodes) / c
    return inside, 1.0 - inside


def cp_cost(model: ModelSpec, layout: Layout, device: DeviceProfile, place: Placement,
            method: str, attn_f: float, attn_b: float) -> CPCost:
    """The method's seconds (module docstring) given the attention core's forward and backward
    seconds ``attn_f``, ``attn_b`` on this GPU; ``layout.overlap.cp`` off exposes them all."""
    c = layout.cp
    bytes_f, bytes_b = cp_bytes(model, layout, method)
    if c <= 1:
        return CPCost(method, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
    _, bkv, _ = cp_blocks(model, layout)
    blk_f, blk_b = attn_f / c, attn_b / c
    sides = 0
    if method == "ring":
        cross = place.nodes > 1
        kv = p2p_time(bkv, cross, device)
        acc = p2p_time(bkv * ACC_BYTES / layout.dtype_bytes, cross, device)
        comm_f, comm_b = (c - 1) * kv, (c - 1) * kv + c * acc
        exp_f = (c - 1) * max(0.0, kv - blk_f)
        exp_b = max(0.0, kv - blk_b) + (c - 2) * max(0.0, kv + acc - blk_b) + \
            max(0.0, acc - blk_b) + acc
        sides = 2 * ((c - 1) * 2 + c)
    elif method == "allgather":
        ag = collective_time("all_gather", c * bkv, place, device)[0]
        rs = collective_time("reduce_scatter", c * bkv, place, device)[0]
        comm_f, comm_b = ag, ag + rs
        exp_f, exp_b = max(0.0, ag - blk_f), max(0.0, ag - blk_b) + rs
    else:
        bq, _, bo = cp_blocks(model, layout)
        a2a = sum(all_to_all_time(x, place, device) for x in (bq, bkv / 2, bkv / 2, bo))
        comm_f = comm_b = exp_f = exp_b = a2a
    if not layout.overlap.cp:
        exp_f, exp_b = comm_f, comm_b
    return CPCost(method, comm_f, comm_b, exp_f, exp_b, bytes_f, bytes_b, sides)
