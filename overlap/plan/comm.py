"""Collective and point-to-point times from an alpha-beta model per link class.

Placement: ranks are laid out as ``overlap.dist.ParallelDims`` does, TP innermost:
``rank = ((d*pp + p)*cp + c)*tp + t``. A group of n ranks with stride ``st`` on nodes of g GPUs
has ``k = clamp(g // st, 1, n)`` members per node and spans ``ceil(n / k)`` nodes.
Bandwidth: NVLink inside a node; a group that spans nodes gets ``min(NVLink, k * IB)``.
Ring (NCCL's model): all-reduce moves ``2(n-1)/n`` of the buffer over the bus bandwidth in
``2(n-1)`` steps, all-gather and reduce-scatter ``(n-1)/n`` in ``n-1`` steps; latency = base +
one hop latency per step. Tree (all-reduce across nodes only): latency
``base + 2((k-1)*a_nvlink + log2(nodes)*a_net)`` and algorithm bandwidth ``0.5 * 0.9 *`` bus
bandwidth. The faster one is used.
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses
import math

from overlap.plan.hardware import ClusterSpec, DeviceProfile

__all__ = ["Placement", "placement", "axis_placement", "collective_time", "p2p_time",
           "bus_bandwidth"]


@dataclasses.dataclass(slots=True, frozen=True)
class Placement:
    size: int
    per_node: int
    nodes: int


def placement(cluster: ClusterSpec, size: int, stride: int) -> Placement:
    g = cluster.gpus_per_node
    k = max(1, min(size, g // stride)) if stride < g else 1
    return Placement(size=size, per_node=k, nodes=math.ceil(size / k))


def axis_placement(cluster: ClusterSpec, axis: str, *, tp: int, cp: int, pp: int,
                   dp: int) -> Placement:
    """Placement of one group of ``axis`` ("tp", "cp", "pp", "dp")."""
    size, stride = {"tp": (tp, 1), "cp": (cp, tp), "pp": (pp, tp * cp),
                    "dp": (dp, tp * cp * pp)}[axis]
    return placement(cluster, size, stride)


def bus_bandwidth(device: DeviceProfile, place: Placement, tp: bool = False) -> float:
    intra = (device.tp_link or device.intra) if tp else device.intra
    if place.nodes == 1:
        return intra.effective_bandwidth
    return min(intra.effective_bandwidth, place.per_node * device.inter.effective_bandwidth)


def collective_time(kind: str, nbytes: float, place: Placement, device: DeviceProfile, *,
                    tp: bool = False) -> tuple[float, str]:
    """(seconds, algorithm) of one collective. ``nbytes``: the all-reduce buffer, the gathered
    output of an all-gather, the input of a reduce-scatter. ``tp``: a fused tensor-parallel
    op's collective, over ``device.tp_link`` when the profile has one."""
    n = place.size
    if n <= 1 or nbytes <= 0:
        return 0.0, "none"
    bw = bus_bandwidth(device, place, tp)
    intra = (device.tp_link or device.intra) if tp else device.intra
    base = device.base_latency_s
    if tp and device.tp_base_latency_s is not None:
        base = device.tp_base_latency_s
    a_in, a_net = intra.latency_s, device.inter.latency_s
    if kind == "all_reduce":
        steps, inter_steps, factor = 2 * (n - 1), 2 * (place.nodes - 1), 2.0 * (n - 1) / n
    elif kind in ("all_gather", "reduce_scatter"):
        steps, inter_steps, factor = n - 1, place.nodes - 1, (n - 1) / n
    else:
        raise ValueError(f"collective_time: unknown kind {kind!r}")
    ring = (base + (steps - inter_steps) * a_in + inter_steps * a_net
            + factor * nbytes / bw)
    if kind != "all_reduce" or place.nodes == 1:
        return ring, "ring"
    tree = (base + 2 * ((place.per_node - 1) * a_in
                                         + math.ceil(math.log2(place.nodes)) * a_net)
            + nbytes / (0.5 * 0.9 * bw))
    return (tree, "tree") if tree < ring else (ring, "ring")


def p2p_time(nbytes: float, cross_node: bool, device: DeviceProfile) -> float:
    """One send/receive of ``nbytes`` between two GPUs."""
    if nbytes <= 0:
        return 0.0
    link = device.inter if cross_node else device.intra
    return device.base_latency_s + link.latency_s + nbytes / link.effective_bandwidth
