"""Stored activations of one transformer layer for one micro-batch on one GPU, and the rows an
EP rank's experts receive.

Activations follow Korthikanti et al. 2022 (arXiv 2205.05198), each term derived from the
shapes for the rank's s/cp tokens; a MoE layer adds its routed rows (``routed_rows``: capacity
slots, or the dropless imbalance). The per-layer terms the memory (``plan.memory``), offloading
(``plan.offload``) and compute (``plan.compute``) models share, below all three.
The narrative (with the formulas): docs/design/planner.md.
"""

from __future__ import annotations

from overlap.plan.layout import Layout
from overlap.plan.models import ModelSpec

__all__ = ["routed_rows", "layer_activation_bytes"]


def routed_rows(model: ModelSpec, layout: Layout, tokens: float) -> float:
    """Rows an EP rank's experts receive (and its dispatch sends) for ``tokens`` local tokens:
    ``tokens * k * cf`` in capacity mode (padded slots travel and compute), else ``tokens * k *
    imbalance`` on the slowest rank (dropless)."""
    factor = layout.capacity_factor if layout.capacity_factor is not None \
        else layout.moe_imbalance
    return tokens * model.moe_top_k * factor


def layer_activation_bytes(model: ModelSpec, layout: Layout,
                           recompute: str | None = None, moe: bool = False) -> float:
    """Stored activations of one layer for one micro-batch on one GPU (see module docstring);
    ``recompute`` overrides the layout's mode; ``moe``: a MoE layer."""
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
    if model.standard_attention:
        sharded = s * b * (2.0 * h + 4.0 * kv + 2.0 * h)
    else:  # Q, K, V as flash attention stores them, and the out-proj input
        sharded = 2.0 * s * b * (model.q_width + model.k_width + 2.0 * model.v_width
                                 if model.is_mla else 2.0 * model.q_width + 2.0 * kv)
    moe_rows = 0.0
    if moe:
        # Not TP-sharded: with SP each TP rank routes its 1/t of the tokens, without it every
        # TP rank routes them all. Per routed row: the dispatched input and the expert output
        # (2h each), the gate and up outputs and the SwiGLU output (2Fe each); per token the
        # shared experts' (6 S Fe) and the fp32 router logits and probabilities (8E).
        fe = model.expert_ffn
        tok = s * b / (t if layout.sequence_parallel else 1)
        moe_rows = routed_rows(model, layout, tok) * (4.0 * h + 6.0 * fe) + \
            tok * (6.0 * model.num_shared_experts * fe + 8.0 * model.num_experts)
    else:
        sharded += s * b * f * (2.0 * n_act + 2.0)
    if recompute == "none" and not layout.flash_attention:
        # Softmax output (2), its dropout mask (1) and output (2) per score: a*s*(s*cp) each.
        sharded += (2.0 + 3.0 * mask) * a * b * s * (s * cp)
    if layout.sequence_parallel:
        return (replicated + sharded) / t + moe_rows
    return replicated + sharded / t + moe_rows
