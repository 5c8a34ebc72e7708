"""Zig-zag sharding of a sequence dim over a CP group, and its inverse.

The sequence is cut into ``2 * cp`` equal chunks; CP rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``, concatenated in that order, so under a causal mask every rank attends to
the same number of key positions. ``zigzag_shard(x, dim, cp=, rank=)`` returns that local
piece (a copy); ``zigzag_unshard(pieces, dim)`` rebuilds the full sequence from every rank's
piece in CP-rank order. The narrative: docs/design/cp.md.
"""

from __future__ import annotations

from typing import Sequence

import torch

from overlap.defaults import positive_int

__all__ = ["zigzag_shard", "zigzag_unshard", "zigzag_chunks"]


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * cp``) that CP rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def _checked(x: torch.Tensor, dim: int, cp: int, rank: int, op: str) -> tuple[int, int]:
    positive_int(cp, f"{op}: cp")
    if type(rank) is not int or not 0 <= rank < cp:
        raise ValueError(f"{op}: rank must be an int in [0, {cp}), got {rank!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim {dim} is out of range for a {x.dim()}-d tensor "
                         f"(rank {rank} of cp {cp})")
    dim %= x.dim()
    size = x.shape[dim]
    if size % (2 * cp):
        raise ValueError(f"{op}: the sequence length along dim {dim} must be divisible by "
                         f"2 * cp = {2 * cp} (zig-zag chunks), got {size} (rank {rank} of "
                         f"cp {cp}); pad the sequence to a multiple of {2 * cp}")
    return dim, size // (2 * cp)


def zigzag_shard(x: torch.Tensor, dim: int, *, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s zig-zag piece of the full sequence ``x`` along ``dim``."""
    dim, c = _checked(x, dim, cp, rank, "zigzag_shard")
    first, second = zigzag_chunks(cp, rank)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim)


def zigzag_unshard(pieces: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The full sequence from every CP rank's piece (``pieces[r]`` from rank ``r``)."""
    cp = len(pieces)
    positive_int(cp, "zigzag_unshard: len(pieces)")
    shape = tuple(pieces[0].shape)
    for r, p in enumerate(pieces):
        if tuple(p.shape) != shape:
            raise ValueError(f"zigzag_unshard: every piece must have shape {shape} (rank 0's), "
                             f"rank {r}'s is {tuple(p.shape)}")
    dim %= pieces[0].dim()
    if shape[dim] % 2:
        raise ValueError(f"zigzag_unshard: a piece holds two equal chunks along dim {dim}, "
                         f"got length {shape[dim]}")
    c = shape[dim] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, p in enumerate(pieces):
        first, second = zigzag_chunks(cp, r)
        chunks[first], chunks[second] = p.narrow(dim, 0, c), p.narrow(dim, c, c)
    return torch.cat(chunks, dim)
