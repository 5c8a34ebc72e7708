"""Modules that run on sequence shards between TP regions (sequence parallelism).

With sequence parallelism the residual stream is (b, t/tp, d) on each rank: norms see only this
rank's tokens, so the gradient of their (replicated) parameters is a partial sum that must be
summed over the TP group. The classes here are drop-in subclasses that keep the parameter
names (and share the parameter objects) of the module they replace, so state dicts and
optimizers see no difference.

SequenceParallelLayerNorm / SequenceParallelRMSNorm, weight and bias replicated:
  forward  y_shard_s = norm(x_shard_s; copy_to_tp(weight), copy_to_tp(bias))
  wgrad    dweight = all_reduce(sum over local tokens of dy_shard_s * x_hat_shard_s)

SequenceShardedPositions (an ``nn.Embedding`` of positions, replicated), positions (..., t):
  forward  p_shard_s = scatter_s(weight[positions])       this rank's t/tp positions
  wgrad    dweight = scatter-add of all_gather_s(dp_shard_s)   (full on every rank)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from overlap.nn.layers import resolve_comm
from overlap.nn.regions import copy_to_tp, scatter_to_tp

__all__ = ["SequenceParallelLayerNorm", "SequenceParallelRMSNorm", "SequenceShardedPositions",
           "sequence_parallel_norm"]


def _adopt(new: nn.Module, old: nn.Module) -> None:
    # Share the very Parameter objects (and every other attribute) of the replaced module.
    new.__dict__.update(old.__dict__)


class _FromNorm:
    @classmethod
    def from_norm(cls, norm: nn.Module, *, comm=None, tp_group=None, dims=None):
        """The sequence-parallel twin of ``norm``, sharing its parameters."""
        self = cls.__new__(cls)
        _adopt(self, norm)
        self.comm = resolve_comm(cls.__name__, comm, tp_group, dims)
        self.tp_group = self.comm.group
        return self


class SequenceParallelLayerNorm(_FromNorm, nn.LayerNorm):
    """``nn.LayerNorm`` on a sequence shard; parameter gradients summed over ``tp_group``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else copy_to_tp(self.weight, comm=self.comm)
        b = None if self.bias is None else copy_to_tp(self.bias, comm=self.comm)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class SequenceParallelRMSNorm(_FromNorm, nn.RMSNorm):
    """``nn.RMSNorm`` on a sequence shard; weight gradient summed over ``tp_group``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else copy_to_tp(self.weight, comm=self.comm)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


def sequence_parallel_norm(norm: nn.Module, *, comm=None, tp_group=None,
                           dims=None) -> nn.Module:
    """The sequence-parallel twin of an ``nn.LayerNorm`` or ``nn.RMSNorm``."""
    if isinstance(norm, nn.LayerNorm):
        return SequenceParallelLayerNorm.from_norm(norm, comm=comm, tp_group=tp_group, dims=dims)
    if isinstance(norm, nn.RMSNorm):
        return SequenceParallelRMSNorm.from_norm(norm, comm=comm, tp_group=tp_group, dims=dims)
    raise TypeError(f"sequence_parallel_norm: expected nn.LayerNorm or nn.RMSNorm, got "
                    f"{type(norm).__name__}")


class SequenceShardedPositions(nn.Embedding):
    """A replicated position table whose output keeps only this rank's sequence shard, to be
    added to a sequence-parallel token embedding (the sequence is the last dim of the ids)."""

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, comm=None, tp_group=None, dims=None):
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_embedding: expected nn.Embedding, got "
                            f"{type(embedding).__name__}")
        self = cls.__new__(cls)
        _adopt(self, embedding)
        self.comm = resolve_comm(cls.__name__, comm, tp_group, dims)
        self.tp_group = self.comm.group
        return self

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        p = super().forward(positions)
        return scatter_to_tp(p, positions.dim() - 1, comm=self.comm)
