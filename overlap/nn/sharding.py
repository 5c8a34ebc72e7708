"""How a tensor-parallel parameter is cut from the full one, and how to put it back together.

A ``ShardSpec`` describes one parameter of a TP layer:

- ``dim``: the tensor dim that is split over the tp ranks (None: replicated on every rank).
- ``parts``: the full dim is blocks laid end to end, each split over the ranks separately:
  an int is that many equal blocks (a fused qkv projection ``[q; k; v]``: parts=3), a tuple
  gives the block sizes (grouped-query attention ``[q: H*d | k: KV*d | v: KV*d]``:
  parts=(H*d, KV*d, KV*d)). The local shard is ``[q_r; k_r; v_r]``, so the layer's output
  splits into local q, k, v the way the unsharded model splits its full output (at local sizes
  ``size / tp``). A per-head interleaved layout (GPT-NeoX ``[h0: q k v | h1: q k v | ...]``)
  is one block (parts=1) cut at head boundaries: each rank keeps whole heads.
- ``sizes``: uneven per-rank sizes along ``dim`` (only with parts=1), e.g. a vocabulary that
  tp does not divide; None means ``full // tp`` each.
- ``transpose``: the *source* module stores the transpose of our layout (Hugging Face
  ``Conv1D`` keeps its weight as [in, out]; ours is [out, in] like ``nn.Linear``). Sharding
  transposes on the way in and ``gather`` transposes back, so a gathered state dict has the
  keys and shapes of the unsharded model.

``shard(full, spec, tp_rank, tp)`` is pure; ``gather(local, spec, group)`` is a collective that
returns the full tensor on every rank.
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
