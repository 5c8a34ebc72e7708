"""The MoE router: top-k experts per token from softmax or sigmoid scores, in float32, and the
two auxiliary losses.

Legend: ``T`` tokens, ``d`` hidden size, ``E`` experts, ``k`` experts per token.
``TopKRouter(x [T, d]) -> Routing(weights [T, k] fp32, experts [T, k] int64, scores [T, E],
logits [T, E])``. ``load_balancing_loss`` is the Switch/GShard form
``E * sum_e f_e * P_e`` (f_e: share of the T*k assignments that go to e, not differentiable;
P_e: mean normalised score of e); ``z_loss`` is ``mean_t(logsumexp(logits_t) ** 2)``.
The narrative: docs/moe.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from overlap.defaults import positive_int

__all__ = ["TopKRouter", "Routing", "load_balancing_loss", "z_loss", "SCORES"]

SCORES = ("softmax", "sigmoid")


class Routing(NamedTuple):
    weights: torch.Tensor   # [T, k] float32: the combine weight of each chosen expert
    experts: torch.Tensor   # [T, k] int64: the chosen experts, best first
    scores: torch.Tensor    # [T, E] float32: softmax or sigmoid of the logits
    logits: torch.Tensor    # [T, E] float32


class TopKRouter(nn.Module):
    """A bias-free linear gate ``[E, d]`` (``nn.Linear``'s init) and top-k selection.

    ``score``: "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3). ``normalize``: divide
    the k chosen weights by their sum (Mixtral and DeepSeek-V3 do; Qwen2-MoE does not)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 normalize: bool = True, device=None, dtype=None):
        super().__init__()
        positive_int(d_model, "TopKRouter: d_model")
        positive_int(num_experts, "TopKRouter: num_experts")
        positive_int(top_k, "TopKRouter: top_k")
        if top_k > num_experts:
            raise ValueError(f"TopKRouter: top_k={top_k} is larger than num_experts="
                             f"{num_experts}")
        if score not in SCORES:
            raise ValueError(f"TopKRouter: score must be one of {SCORES}, got {score!r}")
        self.num_experts, self.top_k, self.score, self.normalize = (num_experts, top_k, score,
                                                                    bool(normalize))
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, device=device,
                                               dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        weights, experts = scores.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(weights, experts, scores, logits)


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss of one batch: 1.0 when the load is uniform."""
    t, k = routing.experts.shape
    counts = torch.zeros(num_experts, device=routing.experts.device, dtype=torch.float32)
    counts.index_add_(0, routing.experts.reshape(-1),
                      torch.ones(t * k, device=counts.device, dtype=torch.float32))
    share = counts / max(1, t * k)
    probs = routing.scores / routing.scores.sum(-1, keepdim=True)
    return num_experts * (share * probs.mean(0)).sum()


def z_loss(routing: Routing) -> torch.Tensor:
    """Router z-loss (ST-MoE): keeps the logits small."""
    return torch.logsumexp(routing.logits, dim=-1).square().mean()
