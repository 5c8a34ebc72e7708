"""What the planner needs to know about a device and a cluster, as data.

A device is a peak, a GEMM-efficiency curve, a memory and two link classes (inside a node,
across nodes). Shipped profiles live in :mod:`overlap.plan.profiles`, each number with its source;
``overlap-plan --calibrate`` writes the same structure as JSON for the local machine.

GEMM efficiency: a (M, N, K) GEMM runs at ``peak * e_max * g(M) g(N) g(K)`` with
``g(d) = d / (d + d_half)``; its time is never below its HBM traffic over the achievable
bandwidth, and ``overhead_s`` is a fixed cost per call. Links (alpha-beta): ``n`` bytes cost
``latency_s + n / (bandwidth * efficiency)``; collectives add ``base_latency_s`` and one
latency per algorithm step (see :mod:`overlap.plan.comm`).
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = ["GemmCurve", "LinkSpec", "DeviceProfile", "ClusterSpec"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GemmCurve:
    e_max: float
    d_half: float
    overhead_s: float = 0.0

    def efficiency(self, m: float, n: float, k: float) -> float:
        g = 1.0
        for d in (m, n, k):
            g *= d / (d + self.d_half)
        return self.e_max * g


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LinkSpec:
    """``bandwidth``: bytes/s per device per direction (vendor peak); ``efficiency``: the
    achieved fraction of it; ``latency_s``: one algorithm step (a hop)."""

    bandwidth: float
    latency_s: float
    efficiency: float = 1.0

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class DeviceProfile:
    """One accelerator (or, for the CPU twin, one rank on a CPU core).

    ``intra``/``inter`` carry the NCCL-style collectives and P2P. ``tp_link`` (None: ``intra``)
    is the link the fused tensor-parallel ops use, with ``tp_base_latency_s`` per op: on GPUs
    both are NVLink, on the CPU twin the fused ops run over shared memory while the other
    collectives run over gloo. ``loss_bandwidth`` (None: the HBM's) is the rate of the
    cross-entropy's logit traffic, which a CPU computes far slower than it copies.

    Host costs (zero on GPUs, whose kernel launches are asynchronous and run ahead of the
    device; on the CPU twin they are the work), each without / with tensor parallelism
    (``host_tp_*``): ``host_layer_s`` the (forward, backward) host seconds of one layer per
    micro-batch (dispatch, autograd, hooks, the fused ops' and small collectives' host side),
    ``host_action_s`` what a pipeline compute action adds beyond its layers (executor,
    embedding, head and loss), ``host_step_s`` what a step adds; ``comm_cpu_s`` /
    ``p2p_cpu_s`` the CPU a rank spends per data-parallel collective step and per side of a P2P
    transfer; ``host_cores`` the cores the ranks of a node share. ``a2a_efficiency``: the
    achieved fraction of both links' bandwidth in the MoE all-to-all on collectives (NCCL's, as
    a dispatcher calls them), ``dedup_a2a_efficiency`` the same for a dispatcher that sends a
    token once per node (DeepEP's kernels), ``dedup_a2a_sm_share`` the share of the SMs those
    kernels hold while they run under compute, and ``grouped_gemm_efficiency`` the expert
    grouped GEMMs' throughput relative to a dense GEMM of the same shape. ``host_link`` (None:
    unknown, no offloading) is the GPU's link to host memory, per direction (PCIe or
    NVLink-C2C), which activation offloading copies over; ``host_bytes_per_gpu`` (None:
    unknown) a GPU's share of its node's host memory. ``attention`` (None: the GEMM curve) is
    a flash-attention kernel's efficiency by sequence length, ``e_max * s / (s + d_half)``, on
    the FLOPs it executes (the forward's; ``attention_bwd`` times that for its backward).
    ``zero3_layer_s``: what ZeRO-3 (FSDP) adds per layer and forward of a micro-batch beyond
    its transfers (each layer's gather and reduce-scatter synchronise with the compute; twice
    that in the backward). ``sources`` maps a field name to where its number comes from."""

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    mem_efficiency: float
    gemm: GemmCurve
    intra: LinkSpec
    inter: LinkSpec
    base_latency_s: float
    loss_bandwidth: float | None = None
    tp_link: LinkSpec | None = None
    tp_base_latency_s: float | None = None
    host_layer_s: tuple[float, float] = (0.0, 0.0)
    host_tp_layer_s: tuple[float, float] = (0.0, 0.0)
    host_action_s: float = 0.0
    host_tp_action_s: float = 0.0
    host_step_s: float = 0.0
    host_tp_step_s: float = 0.0
    comm_cpu_s: float = 0.0
    p2p_cpu_s: float = 0.0
    host_cores: float | None = None
    a2a_efficiency: float = 1.0
    dedup_a2a_efficiency: float = 1.0
    dedup_a2a_sm_share: float = 0.0
    grouped_gemm_efficiency: float = 1.0
    host_link: LinkSpec | None = None
    host_bytes_per_gpu: float | None = None
    attention: GemmCurve | None = None
    attention_bwd: float = 1.0
    zero3_layer_s: float = 0.0
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeviceProfile":
        d = dict(d)
        d["gemm"] = GemmCurve(**d["gemm"])
        if d.get("attention") is not None:
            d["attention"] = GemmCurve(**d["attention"])
        d["intra"] = LinkSpec(**d["intra"])
        d["inter"] = LinkSpec(**d["inter"])
        for k in ("tp_link", "host_link"):
            if d.get(k) is not None:
                d[k] = LinkSpec(**d[k])
        for k in ("host_layer_s", "host_tp_layer_s"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    @classmethod
    def load(cls, path: str) -> "DeviceProfile":
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, json.JSONDecodeError, TypeError, KeyError) as exc:
            raise ValueError(f"--profile {path!r}: cannot read a device profile ({exc})") \
                from None

    def replace(self, **changes: Any) -> "DeviceProfile":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ClusterSpec:
    """``num_gpus`` devices, ``gpus_per_node`` per node (TP groups should fit in one).

    ``cores_per_node`` is for the CPU twin, where a "GPU" is a process and the processes of a
    node share that many cores: the step can never be shorter than the CPU work of the node
    divided by the cores. None (GPUs) means every device computes on its own."""

    device: DeviceProfile
    num_gpus: int
    gpus_per_node: int = 8
    cores_per_node: float | None = None

    @classmethod
    def local(cls, device: DeviceProfile, num_ranks: int) -> "ClusterSpec":
        """The CPU twin: ``num_ranks`` processes on this machine, sharing its cores."""
        return cls(device=device, num_gpus=num_ranks, gpus_per_node=num_ranks,
                   cores_per_node=device.host_cores)

    def __post_init__(self) -> None:
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"--gpus must be a positive integer, got {self.num_gpus!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be a positive integer, got "
                             f"{self.gpus_per_node!r}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"--gpus {self.num_gpus} is not a whole number of nodes of "
                             f"--gpus-per-node {self.gpus_per_node}")
        if self.cores_per_node is not None and self.cores_per_node <= 0:
            raise ValueError(f"cores_per_node must be > 0, got {self.cores_per_node}")

    @property
    def ranks_per_node(self) -> int:
        return min(self.num_gpus, self.gpus_per_node)
