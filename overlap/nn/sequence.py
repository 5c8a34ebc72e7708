"""Modules that run on sequence shards between TP regions (sequence parallelism).

Each class is a drop-in subclass that keeps the parameter names (and shares the parameter
objects) of the module it replaces, so state dicts and optimizers see no difference.

SequenceParallelLayerNorm / SequenceParallelRMSNorm, weight and bias replicated:
  forward  y_shard_s = norm(x_shard_s; copy_to_tp(weight), copy_to_tp(bias))
  wgrad    dweight = all_reduce(sum over local tokens of dy_shard_s * x_hat_shard_s)
SequenceShardedPositions (an ``nn.Embedding`` of positions, replicated), positions (..., t):
  forward  p_shard_s = scatter_s(weight[positions])       this rank's t/tp positions
  wgrad    dweight = scatter-add of all_gather_s(dp_shard_s)   (full on every rank)

``sum_grads_over_tp(module)`` makes any module use ``copy_to_tp(p)`` for each of its own
parameters during its forward, so their gradients become the sum over the TP group.
The narrative: docs/design/nn.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from overlap.nn.layers import require_comm
from overlap.nn.regions import copy_to_tp, scatter_to_tp

__all__ = ["SequenceParallelLayerNorm", "SequenceParallelRMSNorm", "SequenceShardedPositions",
           "sequence_parallel_norm", "sum_grads_over_tp", "sums_grads_over_tp",
           "undo_sum_grads_over_tp"]


def _adopt(new: nn.Module, old: nn.Module) -> None:
    # Share the very Parameter objects (and every other attribute) of the replaced module.
    new.__dict__.update(old.__dict__)


class _FromNorm:
    @classmethod
    def from_norm(cls, norm: nn.Module, *, comm=None):
        """The sequence-parallel twin of ``norm``, sharing its parameters."""
        self = cls.__new__(cls)
        _adopt(self, norm)
        self.comm = require_comm(cls.__name__, comm)
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


def sequence_parallel_norm(norm: nn.Module, *, comm=None) -> nn.Module:
    """The sequence-parallel twin of an ``nn.LayerNorm`` or ``nn.RMSNorm``."""
    if isinstance(norm, nn.LayerNorm):
        return SequenceParallelLayerNorm.from_norm(norm, comm=comm)
    if isinstance(norm, nn.RMSNorm):
        return SequenceParallelRMSNorm.from_norm(norm, comm=comm)
    raise TypeError(f"sequence_parallel_norm: expected nn.LayerNorm or nn.RMSNorm, got "
                    f"{type(norm).__name__}")


class SequenceShardedPositions(nn.Embedding):
    """A replicated position table whose output keeps only this rank's sequence shard, to be
    added to a sequence-parallel token embedding (the sequence is the last dim of the ids)."""

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, comm=None):
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_embedding: expected nn.Embedding, got "
                            f"{type(embedding).__name__}")
        self = cls.__new__(cls)
        _adopt(self, embedding)
        self.comm = require_comm(cls.__name__, comm)
        self.tp_group = self.comm.group
        return self

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        p = super().forward(positions)
        return scatter_to_tp(p, positions.dim() - 1, comm=self.comm)


class _SumsGradsOverTP:
    """Put in front of a module's own class by ``sum_grads_over_tp``: during the forward each
    of the module's own parameters is read through ``copy_to_tp`` (identity forward, all-reduce
    of its gradient over TP), and restored afterwards even if the forward raises."""

    def forward(self, *args, **kwargs):
        params = self._parameters
        saved = {n: p for n, p in params.items() if p is not None and p.requires_grad}
        if not (saved and torch.is_grad_enabled()):
            return super().forward(*args, **kwargs)
        comm = self.__dict__["_overlap_sum_grads_comm"]
        try:
            for name, p in saved.items():
                params[name] = copy_to_tp(p, comm=comm)
            return super().forward(*args, **kwargs)
        finally:
            params.update(saved)


_summed_classes: dict[type, type] = {}


def _summed_class(cls: type) -> type:
    if cls not in _summed_classes:
        _summed_classes[cls] = type(cls.__name__, (_SumsGradsOverTP, cls),
                                    {"__module__": cls.__module__,
                                     "__qualname__": cls.__qualname__})
    return _summed_classes[cls]


def sums_grads_over_tp(module: nn.Module) -> bool:
    return isinstance(module, _SumsGradsOverTP)


def sum_grads_over_tp(module: nn.Module, *, comm=None) -> nn.Module:
    """Make ``module`` (in place; returned) sum the gradients of its own parameters (not its
    submodules') over the TP group: for a replicated module that runs on TP-sharded activations
    (a per-head norm between column- and row-parallel layers, a bias added to a sharded
    activation). Parameter names, types, state dicts and ``isinstance`` stay as they were.
    Costs one all-reduce of the parameters' size per backward. Idempotent for the same
    communicator; ``undo_sum_grads_over_tp`` reverts it."""
    comm = require_comm("sum_grads_over_tp", comm)
    if sums_grads_over_tp(module):
        if module.__dict__["_overlap_sum_grads_comm"] is not comm:
            raise ValueError(f"sum_grads_over_tp: {type(module).__name__} already sums its "
                             "gradients over another TP communicator")
        return module
    module.__class__ = _summed_class(type(module))
    module.__dict__["_overlap_sum_grads_comm"] = comm
    return module


def undo_sum_grads_over_tp(module: nn.Module) -> None:
    if sums_grads_over_tp(module):
        module.__class__ = type(module).__mro__[2]
        del module.__dict__["_overlap_sum_grads_comm"]
