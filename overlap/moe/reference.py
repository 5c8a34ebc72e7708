"""The single-process MoE oracle: every expert local, a plain loop over experts, the capacity
rule written out directly. Tests compare the MoE layer at any EP size against it.

``reference_moe(x [..., d], layer) -> (y [..., d], MoEAux)`` reads the parameters of ``layer``
(an MoE built with ``comm=None``, so it holds every expert) and its settings; gradients flow
into them as usual. Capacity: ``C = ceil(cf * T * k / E)``; each expert serves its assignments
slot-major then in token order and drops those past ``C``.
The narrative: docs/moe.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overlap.moe.layer import MoE, MoEAux, capacity

__all__ = ["reference_moe"]


def reference_moe(x: torch.Tensor, layer: MoE) -> tuple[torch.Tensor, MoEAux]:
    if layer.ep != 1:
        raise ValueError("reference_moe: needs a layer that holds every expert (comm=None)")
    router = layer.router
    x2 = x.reshape(-1, layer.d_model)
    t, k, e = x2.shape[0], layer.top_k, layer.num_experts
    logits = x2.float() @ router.weight.float().t()
    scores = logits.softmax(-1) if router.score == "softmax" else logits.sigmoid()
    weights, chosen = scores.topk(k, dim=-1)
    if router.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    cap = None if layer.capacity_factor is None else capacity(t, k, e, layer.capacity_factor)
    y = torch.zeros(t, layer.d_model, dtype=torch.float32)
    dropped = 0
    w_gu, w_down = layer.experts.w_gate_up, layer.experts.w_down
    f = w_down.shape[1]
    for expert in range(e):
        # (slot, token) pairs that chose this expert, slot-major then token order
        pairs = torch.nonzero((chosen == expert).t())
        if cap is not None and pairs.shape[0] > cap:
            dropped += pairs.shape[0] - cap
            pairs = pairs[:cap]
        if pairs.shape[0] == 0:
            continue
        slot, tok = pairs[:, 0], pairs[:, 1]
        h = x2[tok] @ w_gu[expert]
        out = (F.silu(h[:, :f]) * h[:, f:]) @ w_down[expert]
        y = y.index_add(0, tok, out.float() * weights[tok, slot].unsqueeze(1))
    y = y.to(x2.dtype)
    if layer.shared is not None:
        y = y + layer.shared(x2)
    share = torch.stack([(chosen == i).sum() for i in range(e)]).float() / (t * k)
    probs = scores / scores.sum(-1, keepdim=True)
    aux = MoEAux(e * (share * probs.mean(0)).sum(),
                 torch.logsumexp(logits, -1).square().mean(), torch.tensor(dropped),
                 (~torch.isfinite(logits)).any(1).sum())
    return y.reshape(x.shape), aux
