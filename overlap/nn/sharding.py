"""How a tensor-parallel parameter is cut from the full one, and how to put it back together.

A ``ShardSpec`` describes one parameter of a TP layer:
- ``dim``: the tensor dim that is split over the tp ranks (None: replicated on every rank);
- ``parts``: the full dim is blocks laid end to end, each split over the ranks separately: an
  int is that many equal blocks (a fused ``[q; k; v]``: parts=3), a tuple gives the block sizes
  (grouped-query attention: parts=(H*d, KV*d, KV*d)); the local shard is ``[q_r; k_r; v_r]``;
- ``sizes``: uneven per-rank sizes along ``dim`` (only with parts=1); None means ``full // tp``;
- ``transpose``: the *source* module stores the transpose of our [out, in] layout (HF
  ``Conv1D``); ``gather`` transposes back, so a gathered state dict matches the unsharded model.

Contract: ``shard(full, spec, tp_rank, tp)`` is pure; ``gather(local, spec, group)`` is a
collective that returns the full tensor on every rank.
The narrative: docs/design/nn.md.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from overlap.tp.collectives import all_gather_dim

__all__ = ["ShardSpec", "shard_sizes", "part_sizes", "shard", "gather"]


def shard_sizes(n: int, tp: int) -> list[int]:
    """Sizes of ``n`` split over ``tp`` ranks, the first ``n % tp`` ranks one larger."""
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ShardSpec:
    dim: int | None
    parts: int | tuple[int, ...] = 1
    sizes: tuple[int, ...] | None = None
    transpose: bool = False


def part_sizes(parts: int | tuple[int, ...], n: int) -> list[int]:
    """The block sizes of a dim of size ``n`` cut into ``parts`` (an int: equal blocks)."""
    if isinstance(parts, tuple):
        return list(parts)
    return [n // parts] * parts


def shard(full: torch.Tensor, spec: ShardSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of ``full`` (a new contiguous tensor, detached)."""
    full = full.detach()
    if spec.transpose:
        full = full.t()
    if spec.dim is None:
        return full.clone().contiguous()
    if spec.sizes is not None:
        start = sum(spec.sizes[:tp_rank])
        return full.narrow(spec.dim, start, spec.sizes[tp_rank]).clone().contiguous()
    blocks = full.split(part_sizes(spec.parts, full.shape[spec.dim]), spec.dim)
    pieces = [p.chunk(tp, spec.dim)[tp_rank] for p in blocks]
    return torch.cat(pieces, spec.dim).contiguous()


def gather(local: torch.Tensor, spec: ShardSpec, *, group) -> torch.Tensor:
    """The full tensor, in the source module's layout, on every rank of ``group``."""
    local = local.detach()
    if spec.dim is None:
        full = local.clone()
    else:
        tp = dist.get_world_size(group)
        sizes = list(spec.sizes) if spec.sizes is not None else None
        cat = all_gather_dim(local, spec.dim, group=group, sizes=sizes, op="gather state")
        sizes = part_sizes(spec.parts, local.shape[spec.dim] * tp)
        if len(sizes) > 1:
            per_rank = cat.chunk(tp, spec.dim)
            local_sizes = [s // tp for s in sizes]
            blocks = [r.split(local_sizes, spec.dim) for r in per_rank]
            cat = torch.cat([blocks[r][p] for p in range(len(sizes)) for r in range(tp)],
                            spec.dim)
        full = cat
    return (full.t() if spec.transpose else full).contiguous()
