"""Mixture of experts with expert parallelism: the router, SwiGLU experts as one grouped GEMM,
the MoE layer whose experts shard over an EP group, and the single-process reference.
The narrative: docs/moe.md."""

from overlap.moe.comm import EPComm
from overlap.moe.experts import SwiGLU, SwiGLUExperts, split_expert_parameters
from overlap.moe.layer import MoE, MoEAux, capacity
from overlap.moe.reference import reference_moe
from overlap.moe.router import Routing, TopKRouter, load_balancing_loss, z_loss

__all__ = ["EPComm", "MoE", "MoEAux", "capacity", "SwiGLU", "SwiGLUExperts", "TopKRouter",
           "Routing", "load_balancing_loss", "z_loss", "reference_moe",
           "split_expert_parameters"]
