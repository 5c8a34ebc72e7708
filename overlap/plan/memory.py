"""Memory per GPU: weights, gradients, optimizer state and activations, per pipeline rank.

Model state (bytes per parameter held by the GPU): bf16 weights 2, gradients 4 with fp32 main
grads (2 without), Adam optimizer state 12. ZeRO over the ``dp * cp`` ranks that hold the same
parameters divides the optimizer state (stage 1), also the gradients (stage 2), also the
weights (stage 3, plus two layers of gathered bf16 weights in flight).

Activations per layer and micro-batch follow Korthikanti et al. 2022 (arXiv 2205.05198),
each term derived from the shapes (:func:`layer_activation_bytes`). A pipeline rank holds
those of its peak number of live (stage, micro-batch) pairs, taken from the schedule
(:func:`overlap.plan.bubble.peak_live`); the first stage adds the embedding dropout mask, the
last stage the output layer's activations for one micro-batch. With full recomputation the
layer being recomputed also holds its full (no recompute) activations during its backward.
The narrative (with the formulas): docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses

from overlap.plan.bubble import peak_live
from overlap.plan.hardware import ClusterSpec
from overlap.plan.layout import Layout
from overlap.plan.models import ModelSpec

__all__ = ["StageMemory", "rank_params", "layer_activation_bytes", "memory_per_rank"]


@dataclasses.dataclass(slots=True, frozen=True)
class StageMemory:
    """Bytes on one GPU of pipeline rank ``rank``."""

    rank: int
    params: float
    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def rank_params(model: ModelSpec, layout: Layout, rank: int) -> float:
    """Parameters one GPU of pipeline rank ``rank`` holds (before ZeRO), with TP sharding."""
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


def layer_activation_bytes(model: ModelSpec, layout: Layout,
                           recompute: str | None = None) -> float:
    """Stored activations of one layer for one micro-batch on one GPU (see module docstring);
    ``recompute`` overrides the layout's mode."""
    recompute = recompute or layout.recompute
    t, cp = layout.tp, layout.cp
    b, s = layout.micro_batch, model.seq_len // cp
    h, kv, f, a = model.hidden, model.kv_dim, model.ffn_dim, model.num_heads
    sbh = s * b * h
    mask = 1.0 if model.dropout else 0.0
    if recompute == "full":
        return 2.0 * sbh / (t if layout.sequence_parallel else 1)
    # Replicated across TP ranks without SP: the two norm inputs (2+2), the inputs of the QKV
    # and fc1 GEMMs (2+2) and the two dropout masks after the row-parallel GEMMs.
    replicated = (8.0 + 2 * mask) * sbh
    # Sharded over TP: Q, K, V (2 bytes each), the out-proj input, the MLP activation input(s)
    # and the fc2 input.
    n_act = 2 if model.gated_mlp else 1
    sharded = s * b * (2.0 * h + 4.0 * kv + 2.0 * h) + s * b * f * (2.0 * n_act + 2.0)
    if recompute == "none" and not layout.flash_attention:
        # Softmax output (2), its dropout mask (1) and output (2) per score: a*s*(s*cp) each.
        sharded += (2.0 + 3.0 * mask) * a * b * s * (s * cp)
    if layout.sequence_parallel:
        return (replicated + sharded) / t
    return replicated + sharded / t


def memory_per_rank(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> list[StageMemory]:
    """One entry per pipeline rank (every GPU of that rank holds the same)."""
    dp_shard = layout.dp(cluster) * layout.cp
    grad_bytes = 4.0 if layout.fp32_main_grads else 2.0
    m = layout.num_microbatches(cluster)
    peaks = peak_live(layout.schedule, layout.pp, m, layout.num_virtual)
    layers = layout.chunk_layers(model)
    per_layer = layer_activation_bytes(model, layout)
    t, b, s = layout.tp, layout.micro_batch, model.seq_len // layout.cp
    sbh = s * b * model.hidden
    out = []
    for r in range(layout.pp):
        params = rank_params(model, layout, r)
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
        chunks = layout.rank_chunks(r)
        # Peak live pairs x layers of a chunk (all chunks of a rank have the same size when
        # interleaving; without it a rank has one chunk).
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
        out.append(StageMemory(rank=r, params=params, weights=weights, grads=grads,
                               optimizer=optimizer, activations=acts))
    return out
