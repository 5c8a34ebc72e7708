"""Activation offloading as ``overlap.memory.ActivationOffloader`` runs it: per pipeline chunk and
micro-batch on one GPU, the bytes to host, the copies' seconds raw and exposed, device memory.

Legend: a chunk of L layers whose first n offload (k = L - n stay); layer j saves A_j bytes
(``activations``' count; full recomputation: its input), copied in c_j = A_j / B each way (B: the
GPU's host link per direction; both directions at once); f_j, b_j its forward and backward
(ZB-H1: the I pass) seconds, E_j the end of its forward.
d2h  one stream, copy j queued at E_j: D_j = max(D_{j-1}, E_j) + c_j, under the later layers'
     forward; the tail D_{n-1} - E_{L-1} runs under the rank's next action (a backward; GPipe:
     a forward) and is exposed beyond it. Copies pending at a layer's end stay on the device.
h2d  layer j's backward starts the reload of j-1: max(0, c_{j-1} - b_j) exposed; at k = 0 the
     first reload (c_{L-1}) in full. Device: live pairs x kept bytes (ZB-H1: pairs between I
     and W hold all L) + the peak of pending copies + one reload in flight (two layers at
     k = 0). Pinned host per GPU: live pairs x offloaded bytes.
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses
import math

from overlap.plan.activations import layer_activation_bytes
from overlap.plan.compute import LayerContext, LayerCost
from overlap.plan.cp import cp_stored_bytes
from overlap.plan.hardware import ClusterSpec, DeviceProfile
from overlap.plan.layout import Layout
from overlap.plan.models import ModelSpec

__all__ = ["ChunkOffload", "chunk_offload", "offload_chunks", "offloaded_blocks",
           "layer_offload_bytes", "host_bandwidth", "device_bytes", "node_host_bytes",
           "search_modes"]


@dataclasses.dataclass(slots=True, frozen=True)
class ChunkOffload:
    """One pipeline chunk (stage), one micro-batch, one GPU: ``offloaded`` of ``layers`` blocks
    offload; bytes the kept and the offloaded blocks save, the peak of copies pending on the
    device and the reloads in flight beyond the kept blocks; seconds of the copies one way
    (the reloads take as long) and exposed in the forward and in the backward."""

    layers: int
    offloaded: int
    kept_bytes: float
    host_bytes: float
    staging_bytes: float
    inflight_bytes: float
    copy_s: float
    exposed_f: float
    exposed_b: float

    @property
    def full_bytes(self) -> float:
        return self.kept_bytes + self.host_bytes


def offloaded_blocks(offload: str, layers: int) -> int:
    """How many of a chunk's ``layers`` blocks offload ("none", "all" or a number N: the first
    N), as ``overlap.train``'s ``--offload-activations``."""
    if offload == "none":
        return 0
    return layers if offload == "all" else min(int(offload), layers)


def host_bandwidth(device: DeviceProfile) -> float:
    """Bytes/s one GPU copies to host (and, at the same time, back)."""
    if device.host_link is None:
        raise ValueError(f"--offload-activations needs the GPU's host link: the profile "
                         f"{device.name!r} has none (give --host-bandwidth)")
    return device.host_link.effective_bandwidth


def layer_offload_bytes(model: ModelSpec, layout: Layout, moe: bool = False) -> float:
    """What one block saves for its backward per micro-batch, which the offloader copies: the
    stored activations (full recomputation: the block's input) and, with CP, what the CP
    attention saves (the layout's method must be concrete)."""
    saved = layer_activation_bytes(model, layout, moe=moe) * layout.dtype_bytes / 2.0
    if layout.cp > 1 and layout.recompute != "full":
        saved += cp_stored_bytes(model, layout, layout.cp_method)
    return saved


def chunk_offload(n: int, sizes: list[float], fwd: list[float], bwd: list[float],
                  bandwidth: float, after: float) -> ChunkOffload:
    """The module's timelines for one chunk whose first ``n`` blocks offload: per block the bytes
    it saves and its forward and backward seconds; ``after``: the rank's next action, under
    which the copies' tail runs."""
    L = len(sizes)
    copy = [a / bandwidth for a in sizes]
    end = done = staging = 0.0
    finish = []
    for j in range(L):
        end += fwd[j]
        if j < n:  # one d2h stream: the copy waits for the layer and for the copies before it
            done = max(done, end) + copy[j]
            finish.append(done)
        staging = max(staging, sum(sizes[i] for i in range(len(finish)) if finish[i] > end))
    exposed_f = max(0.0, done - end - after) if n else 0.0
    # Layer j's backward starts the reload of j-1; with nothing kept the first reload starts
    # with the backward of the layer that needs it.
    exposed_b = sum(max(0.0, copy[j] - (bwd[j + 1] if j + 1 < L else 0.0)) for j in range(n))
    inflight = max(sizes[:n]) * (2 if n == L else 1) if n else 0.0
    return ChunkOffload(layers=L, offloaded=n, kept_bytes=sum(sizes[n:]),
                        host_bytes=sum(sizes[:n]), staging_bytes=staging,
                        inflight_bytes=inflight, copy_s=sum(copy[:n]), exposed_f=exposed_f,
                        exposed_b=exposed_b)


def offload_chunks(model: ModelSpec, layout: Layout, cluster: ClusterSpec,
                   layers: tuple[LayerCost, LayerCost | None] | None = None
                   ) -> list[ChunkOffload]:
    """Per model chunk, in stage order. ``layers``: the (dense, MoE) layer costs the estimate
    uses (default: built for the layout, whose CP method must then be concrete)."""
    if layers is None:
        layers = LayerContext(model, cluster, layout, None).layers(layout.cp_method)
    dense, moe = layers
    bandwidth = host_bandwidth(cluster.device)
    saved = {False: layer_offload_bytes(model, layout)}
    if moe is not None:
        saved[True] = layer_offload_bytes(model, layout, moe=True)
    split = layout.schedule == "zb-h1"  # the reload hides under the I pass; W comes later
    out, start = [], 0
    for L in layout.chunk_layers(model):
        kinds = [moe is not None and model.is_moe_layer(start + j) for j in range(L)]
        costs = [moe if x else dense for x in kinds]
        fwd = [c.fwd for c in costs]
        bwd = [c.dgrad + c.recompute + (0.0 if split else c.wgrad) for c in costs]
        after = sum(fwd) if layout.schedule == "gpipe" else sum(bwd)
        out.append(chunk_offload(offloaded_blocks(layout.offload, L), [saved[x] for x in kinds],
                                 fwd, bwd, bandwidth, after))
        start += L
    return out


def device_bytes(chunk: ChunkOffload, states: tuple[tuple[int, int], ...]) -> float:
    """Saved bytes of a chunk's blocks on the device at the rank's peak: ``states`` are its
    (before, after) live counts (:func:`overlap.plan.bubble.live_pairs`)."""
    live = max(a * chunk.kept_bytes + b * chunk.full_bytes for a, b in states)
    return live + chunk.staging_bytes + chunk.inflight_bytes


def node_host_bytes(layout: Layout, cluster: ClusterSpec, per_rank: list[float]) -> float:
    """Pinned host bytes of the fullest node, ``per_rank[p]`` on each GPU of pp rank p (GPU g is
    on pp rank (g // (tp cp)) % pp, ``ParallelDims``' order); the pattern repeats every
    lcm(tp cp pp, GPUs per node) GPUs."""
    g, inner = cluster.gpus_per_node, layout.tp * layout.cp
    span = min(cluster.num_gpus, math.lcm(inner * layout.pp, g))
    nodes: dict[int, float] = {}
    for gpu in range(span):
        nodes[gpu // g] = nodes.get(gpu // g, 0.0) + per_rank[(gpu // inner) % layout.pp]
    return max(nodes.values())


def search_modes(model: ModelSpec, layout: Layout) -> list[str]:
    """What ``search`` tries for a layout that does not fit without offloading: all blocks, all
    but one (the first reload then hides under the kept block's backward) and half."""
    chunk = max(layout.chunk_layers(model))
    return ["all"] + sorted({str(n) for n in (chunk - 1, chunk // 2) if n >= 1}, key=int,
                            reverse=True)
