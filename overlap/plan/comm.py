"""Collective and point-to-point times from an alpha-beta model per link class.

Placement: ranks are laid out as ``overlap.dist.ParallelDims`` does, TP innermost:
``rank = ((d*pp + p)*cp + c)*tp + t``. A group of n ranks with stride ``st`` on nodes of g GPUs
has ``k = clamp(g // st, 1, n)`` members per node and spans ``ceil(n / k)`` nodes.
Bandwidth: NVLink inside a node; a group that spans nodes gets ``min(NVLink, k * IB)``.
Ring (NCCL's model): all-reduce moves ``2(n-1)/n`` of the buffer over the bus bandwidth in
``2(n-1)`` steps, all-gather and reduce-scatter ``(n-1)/n`` in ``n-1`` steps; latency = base +
one hop latency per step. Tree (all-reduce across nodes only): latency
``base + 2((k-1)*a_nvlink + log2(nodes)*a_net)``, algorithm bandwidth ``0.5 * 0.9 *`` bus
bandwidth; the faster one is used. All-to-all (MoE dispatch/combine), ``V`` bytes per rank over
n ranks, k per node: ``(k-1)/n * V`` over NVLink and ``(n-k)/n * V`` over the rank's own NIC at
once, at the caller's efficiency (MoE: ``device.a2a_efficiency``, or ``dedup_a2a_efficiency``
for a once-per-node dispatch); latency = base + one hop. The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses
import math

from overlap.plan.hardware import ClusterSpec, DeviceProfile

__all__ = ["Placement", "placement", "axis_placement", "collective_time", "p2p_time",
           "bus_bandwidth", "ranks_placement", "ep_placement", "edp_placement", "all_to_all_time"]


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


def ranks_placement(cluster: ClusterSpec, ranks: list[int]) -> Placement:
    """Placement of an explicit list of global ranks (the fullest node gives ``per_node``)."""
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // cluster.gpus_per_node] = nodes.get(r // cluster.gpus_per_node, 0) + 1
    return Placement(size=len(ranks), per_node=max(nodes.values()), nodes=len(nodes))


def _dp_cp_rank(x: int, *, tp: int, cp: int, pp: int) -> int:
    """Global rank of data-parallel x context-parallel index ``x = d*cp + c`` (p = t = 0)."""
    d, c = divmod(x, cp)
    return (d * pp * cp + c) * tp


def ep_placement(cluster: ClusterSpec, *, tp: int, cp: int, pp: int, ep: int) -> Placement:
    """The first EP group: ``x = edp*ep + ep_rank`` varies ep_rank (ParallelDims)."""
    return ranks_placement(cluster, [_dp_cp_rank(x, tp=tp, cp=cp, pp=pp) for x in range(ep)])


def edp_placement(cluster: ClusterSpec, *, tp: int, cp: int, pp: int, dp: int,
                  ep: int) -> Placement:
    """The first expert-data-parallel group (same ep_rank): where expert gradients reduce."""
    return ranks_placement(cluster, [_dp_cp_rank(j * ep, tp=tp, cp=cp, pp=pp)
                                     for j in range(dp * cp // ep)])


def all_to_all_time(nbytes: float, place: Placement, device: DeviceProfile, *,
                    node_dedup_k: int = 0, efficiency: float = 1.0) -> float:
    """One all-to-all in which every rank sends ``nbytes`` in total (its own share included).

    ``node_dedup_k`` > 0: the rows are a top-k dispatch that crosses the network once per
    destination node (DeepEP's internode kernels), so of the ``k (N-1)/N`` remote copies a token
    makes only ``(N-1)(1 - (1 - 1/N)^k)`` travel, N the nodes (uniform routing). Both links run
    at ``efficiency`` times their own: 1 for a plain exchange (Ulysses'), the MoE dispatcher's
    for the MoE's (``layer_cost``)."""
    n = place.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = min(place.per_node, n)
    eff = efficiency
    net = (n - k) / n * nbytes
    if node_dedup_k and place.nodes > 1:
        nn, tk = place.nodes, node_dedup_k
        net *= nn * (1.0 - (1.0 - 1.0 / nn) ** tk) / tk
    intra = (k - 1) / n * nbytes / (device.intra.effective_bandwidth * eff)
    inter = net / (device.inter.effective_bandwidth * eff)
    hop = device.inter.latency_s if place.nodes > 1 else device.intra.latency_s
    return device.base_latency_s + hop + max(intra, inter)


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
