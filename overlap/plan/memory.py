"""Memory per GPU: weights, gradients, optimizer state and activations, per pipeline rank.

Model state (bytes per parameter held by the GPU): bf16 weights 2, gradients 4 with fp32 main
grads (2 without), Adam state 12. ZeRO over the ``dp * cp`` ranks holding the same parameters
divides the optimizer state (stage 1), the gradients (2), the weights (3, + two gathered layers).
Activations per layer and micro-batch: ``plan.activations`` (Korthikanti et al. 2022). A
pipeline rank holds those of its peak number of live (stage, micro-batch) pairs from the
schedule (:func:`overlap.plan.bubble.peak_live`); the first stage adds the embedding dropout
mask, the last the output layer's activations for one micro-batch; full recomputation adds one
layer's full activations; CP adds its attention's fp32 output and lse per live layer and one
layer's exchange buffers (``plan.cp``; "auto": its leanest method). Offloading leaves the
kept blocks of live pairs, pending copies and reloads in flight (``plan.offload``). MoE: experts
(E/ep a layer, TP-replicated) shard their state over the dp*cp/ep expert-DP ranks.
The narrative (with the formulas): docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses

from overlap.plan.activations import layer_activation_bytes, routed_rows
from overlap.plan.bubble import live_pairs, peak_live
from overlap.plan.hardware import ClusterSpec
from overlap.plan.cp import cp_buffer_bytes, cp_stored_bytes
from overlap.plan.layout import CP_METHODS, Layout, ulysses_error
from overlap.plan.models import ModelSpec
from overlap.plan.offload import device_bytes, offload_chunks

__all__ = ["StageMemory", "rank_params", "rank_param_split", "layer_activation_bytes",
           "memory_per_rank", "routed_rows"]


@dataclasses.dataclass(slots=True, frozen=True)
class StageMemory:
    """Bytes on one GPU of pipeline rank ``rank``."""

    rank: int
    params: float
    weights: float
    grads: float
    optimizer: float
    activations: float
    expert_params: float = 0.0   # of ``params``, the routed experts (E/ep per MoE layer)
    expert_bytes: float = 0.0    # of weights + grads + optimizer, the experts'
    cp_buffers: float = 0.0      # of ``activations``, the CP exchange's buffers (one layer)
    host_bytes: float = 0.0      # pinned host memory of offloaded activations (not in total)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def rank_params(model: ModelSpec, layout: Layout, rank: int) -> float:
    """Parameters one GPU of pipeline rank ``rank`` holds (before ZeRO), with TP sharding."""
    if model.is_moe:
        return sum(rank_param_split(model, layout, rank))
    return _dense_rank_params(model, layout, rank)


def rank_param_split(model: ModelSpec, layout: Layout, rank: int) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of pipeline rank ``rank`` holds (before ZeRO)."""
    if not model.is_moe:
        return _dense_rank_params(model, layout, rank), 0.0
    t = layout.tp
    sharded, replicated = model.layer_params()
    m_sharded, m_replicated, experts = model.moe_layer_params()
    layers, moe = layout.chunk_layers(model), layout.chunk_moe_layers(model)
    chunks = layout.rank_chunks(rank)
    nm = sum(moe[c] for c in chunks)
    nd = sum(layers[c] for c in chunks) - nm
    dense = nd * (sharded / t + replicated) + nm * (m_sharded / t + m_replicated)
    word, pos = model.embedding_params()
    if 0 in chunks:
        dense += word / t + pos
    if layout.num_chunks - 1 in chunks:
        dense += model.head_params(layout.pp) / t + model.final_norm_params()
    return dense, nm * experts / layout.ep


def _dense_rank_params(model: ModelSpec, layout: Layout, rank: int) -> float:
    t = layout.tp
    sharded, replicated = model.layer_params()
    layers = layout.chunk_layers(model)
    chunks = layout.rank_chunks(rank)
    n = sum(layers[c] for c in chunks)
    params = n * (sharded / t + replicated)
    word, pos = model.embedding_params()
    if 0 in chunks:
        params += word / t + pos
    if layout.num_chunks - 1 in chunks:
        params += model.head_params(layout.pp) / t + model.final_norm_params()
    return params


def memory_per_rank(model: ModelSpec, layout: Layout, cluster: ClusterSpec, *,
                    offload: list | None = None) -> list[StageMemory]:
    """One entry per pipeline rank (every GPU of that rank holds the same). ``offload``: the
    layout's ``plan.offload.offload_chunks`` when the caller has them."""
    if layout.offload != "none":
        if layout.cp > 1 and layout.cp_method == "auto":  # each method's, the leanest per rank
            per = [memory_per_rank(model, dataclasses.replace(layout, cp_method=m), cluster)
                   for m in _cp_methods(model, layout)]
            return [min(col, key=lambda sm: sm.total) for col in zip(*per)]
        if offload is None:
            offload = offload_chunks(model, layout, cluster)
    dp_shard = layout.dp(cluster) * layout.cp
    grad_bytes = 4.0 if layout.fp32_main_grads else 2.0
    m = layout.num_microbatches(cluster)
    peaks = peak_live(layout.schedule, layout.pp, m, layout.num_virtual)
    layers = layout.chunk_layers(model)
    per_layer = layer_activation_bytes(model, layout)
    t, b, s = layout.tp, layout.micro_batch, model.seq_len // layout.cp
    sbh = s * b * model.hidden
    edp_shard = dp_shard // layout.ep
    moe_layers = layout.chunk_moe_layers(model)
    per_moe = layer_activation_bytes(model, layout, moe=True) if model.is_moe else 0.0
    cp_terms = _cp_terms(model, layout)
    out = []
    for r in range(layout.pp):
        params, experts = rank_param_split(model, layout, r)
        weights = float(layout.dtype_bytes) * params
        grads = grad_bytes * params
        optimizer = 12.0 * params
        if layout.zero >= 1:
            optimizer /= dp_shard
        if layout.zero >= 2:
            grads /= dp_shard
        if layout.zero >= 3:
            sharded, replicated = model.layer_params()
            weights = weights / dp_shard + 2 * layout.dtype_bytes * (sharded / t + replicated)
        expert_bytes = 0.0
        if experts:
            # The experts' state shards over expert-DP (dp*cp/ep), not over dp*cp.
            ew, eg, eo = float(layout.dtype_bytes) * experts, grad_bytes * experts, \
                12.0 * experts
            eo /= edp_shard if layout.zero >= 1 else 1
            eg /= edp_shard if layout.zero >= 2 else 1
            ew /= edp_shard if layout.zero >= 3 else 1
            weights, grads, optimizer = weights + ew, grads + eg, optimizer + eo
            expert_bytes = ew + eg + eo
        chunks = layout.rank_chunks(r)
        # Peak live pairs x layers of a chunk (all chunks of a rank have the same size when
        # interleaving; without it a rank has one chunk).
        host = saved = 0.0
        if offload:  # what stays on the device, in bytes (CP's stored extras included)
            states = live_pairs(layout.schedule, layout.pp, m, layout.num_virtual)[r]
            saved = max(device_bytes(offload[c], states) for c in chunks)
            host = peaks[r] * max(offload[c].host_bytes for c in chunks)
            acts = 0.0
        elif model.is_moe:
            acts = peaks[r] * max((layers[c] - moe_layers[c]) * per_layer
                                  + moe_layers[c] * per_moe for c in chunks)
        else:
            chunk_layers = max(layers[c] for c in chunks)
            acts = peaks[r] * chunk_layers * per_layer
        if layout.recompute == "full":
            # The layer being recomputed holds its full activations during its backward.
            acts += layer_activation_bytes(model, layout, "none")
        if 0 in chunks and model.dropout:
            acts += peaks[r] * sbh / t
        if layout.num_chunks - 1 in chunks:
            acts += 4.0 * sbh / t * (1.0 + model.vocab / model.hidden)
        acts *= layout.dtype_bytes / 2.0  # Korthikanti's counts are for 2-byte activations
        acts += saved
        # CP: what its attention saves per layer (every live layer, or the one being
        # recomputed; offloading counts the kept ones above), and one layer's buffers.
        live = peaks[r] * max(layers[c] for c in chunks) if layout.recompute != "full" else 1
        if offload and layout.recompute != "full":
            live = 0
        cp_stored, cp_buf = min(cp_terms, key=lambda sb: live * sb[0] + sb[1])
        acts += live * cp_stored + cp_buf
        out.append(StageMemory(rank=r, params=params + experts, weights=weights, grads=grads,
                               optimizer=optimizer, activations=acts, expert_params=experts,
                               expert_bytes=expert_bytes, cp_buffers=cp_buf, host_bytes=host))
    return out


def _cp_methods(model: ModelSpec, layout: Layout) -> list[str]:
    """The layout's CP method, or every feasible one for "auto"."""
    if layout.cp_method != "auto":
        return [layout.cp_method]
    return [m for m in CP_METHODS if m != "ulysses"
            or ulysses_error(model, layout.tp, layout.cp) is None]


def _cp_terms(model: ModelSpec, layout: Layout) -> list[tuple[float, float]]:
    """(stored bytes per layer and micro-batch, buffer bytes of one layer) of the layout's CP
    method, or of every feasible one for "auto" (the caller keeps the leanest)."""
    if layout.cp <= 1:
        return [(0.0, 0.0)]
    return [(cp_stored_bytes(model, layout, m), cp_buffer_bytes(model, layout, m))
            for m in _cp_methods(model, layout)]
