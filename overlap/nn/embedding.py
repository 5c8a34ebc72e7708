"""Vocabulary-parallel embedding and the matching cross-entropy, which never builds full logits.

Shape legend: ``tp`` size of the TP group, ``V`` vocabulary, ``V_r`` this rank's slice of it
(rows ``[start_r, start_r + V_r)``; the first ``V % tp`` ranks hold one extra row, so any V
works), ``d`` embedding dim, ``b`` batch, ``t`` sequence, ``n`` tokens (any leading dims).

VocabParallelEmbedding: weight_shard_v [V_r, d], ids (b, t) replicated -> e (b, t, d), or with
sequence_parallel=True e_shard_s (b, t/tp, d) (ids (t, b) with sequence_dim=0: (t/tp, b, d)).
vocab_parallel_cross_entropy: logits_shard_v (..., V_r) (e.g. from a ColumnParallelLinear head
without gather_output), targets (...) replicated -> the loss, 0 where y == ignore_index and
averaged over the others. Only (n,)-sized vectors cross the wire; each rank keeps n x V_r
numbers.
The narrative (forward and backward equations): docs/design/nn.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from overlap.dist.stamp import DTYPE_CODES, dtype_name
from overlap.nn import sharding
from overlap.nn.layers import TPModule, local, require_comm
from overlap.nn.regions import all_gather_dim, reduce_from_tp, reduce_scatter_to_sp, wait
from overlap.nn.sharding import ShardSpec

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


class VocabParallelEmbedding(TPModule):
    """``nn.Embedding`` with its rows split over the TP group (see the module docstring)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 *, comm=None, sequence_parallel: bool = False,
                 seq_dim: int = 1, device=None, dtype=None):
        super().__init__()
        self._configure(comm, sequence_parallel, seq_dim)
        # Same RNG draws as nn.Embedding(V, d): shards of the same full table on every rank.
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device,
                            dtype=dtype)
        self._load(full)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, comm=None,
                       sequence_parallel: bool = False, seq_dim: int = 1) -> "VocabParallelEmbedding":
        """Shard an existing ``nn.Embedding`` (its values; the source is left unchanged)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding.from_embedding: expected nn.Embedding, got "
                            f"{type(embedding).__name__}")
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("VocabParallelEmbedding.from_embedding: max_norm, "
                             "scale_grad_by_freq and sparse are not supported")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(comm, sequence_parallel, seq_dim)
        self._load(embedding)
        return self

    def _configure(self, comm, sequence_parallel, seq_dim) -> None:
        self._init_comm("VocabParallelEmbedding", comm)
        if seq_dim not in (0, 1):
            raise ValueError(f"VocabParallelEmbedding: seq_dim must be 1 (ids (b, t)) or 0 "
                             f"(ids (t, b)), got {seq_dim!r}")
        self.sequence_parallel, self.seq_dim = bool(sequence_parallel), seq_dim

    def _load(self, full: nn.Embedding) -> None:
        vocab, self.embedding_dim = full.weight.shape
        if vocab < self.tp_size:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings={vocab} is smaller than "
                             f"tp={self.tp_size} (rank {dist.get_rank()})")
        self.num_embeddings = int(vocab)
        sizes = sharding.shard_sizes(vocab, self.tp_size)
        self.vocab_start = sum(sizes[:self.tp_rank])
        self.vocab_end = self.vocab_start + sizes[self.tp_rank]
        self.padding_idx = full.padding_idx
        uneven = tuple(sizes) if len(set(sizes)) > 1 else None
        self._set_params(full.weight, None, ShardSpec(dim=0, sizes=uneven), None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"VocabParallelEmbedding: ids must be int64/int32 on tp rank "
                            f"{self.tp_rank}, got {ids.dtype}")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = (pad - self.vocab_start if pad is not None
                     and self.vocab_start <= pad < self.vocab_end else None)
        e_partial = F.embedding(local_ids, local(self.weight), local_pad)
        # Rows owned by other ranks must contribute zero, value and gradient alike.
        e_partial = e_partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            seq = self.seq_dim if ids.dim() == 2 else 0
            if ids.dim() not in (1, 2) or ids.shape[seq] % self.tp_size:
                raise ValueError(f"VocabParallelEmbedding: sequence_parallel needs ids (t,) or "
                                 f"2-D with the sequence (dim {seq} of {tuple(ids.shape)}) "
                                 f"divisible by tp={self.tp_size} (tp rank {self.tp_rank})")
            return reduce_scatter_to_sp(e_partial, seq, comm=self.comm)
        return reduce_from_tp(e_partial, comm=self.comm)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.vocab_start}, "
                f"{self.vocab_end}), tp={self.tp_size}, sequence_parallel="
                f"{self.sequence_parallel}")


def _all_reduce(t: torch.Tensor, op, *, group, name: str) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        wait(dist.all_reduce(t, op=op, group=group, async_op=True), op=name, group=group)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, ignore_index, mean, group):
        # at least fp32 (16-bit logits are upcast; float64 keeps its precision)
        x = logits.to(torch.promote_types(logits.dtype, torch.float32)).contiguous()
        m = _all_reduce(x.max(-1).values, dist.ReduceOp.MAX, group=group,
                        name="vocab_parallel_cross_entropy max")
        x = x - m.unsqueeze(-1)
        local = targets - vocab_start
        is_local = (local >= 0) & (local < x.shape[-1])
        local = local.masked_fill(~is_local, 0)
        z_y = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~is_local, 0.0)
        e = x.exp()
        # One collective for both sums: [sum exp, target logit] per token.
        sums = _all_reduce(torch.stack([e.sum(-1), z_y]), dist.ReduceOp.SUM, group=group,
                           name="vocab_parallel_cross_entropy sums")
        s, z_y = sums[0], sums[1]
        valid = targets != ignore_index
        loss = (s.log() - z_y).masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(e.div_(s.unsqueeze(-1)), local, is_local, valid, count)
        ctx.mean, ctx.dtype = mean, logits.dtype
        out = loss.sum() / count if mean else loss
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx, dloss):
        softmax, local, is_local, valid, count = ctx.saved_tensors
        # A new tensor (the saved softmax stays intact for a retained graph); ignored rows 0.
        grad = softmax * valid.unsqueeze(-1)
        # Subtract the one-hot only where this rank owns the (non-ignored) target.
        rows = grad.view(-1, grad.shape[-1])
        own = (is_local & valid).reshape(-1)
        idx = torch.arange(rows.shape[0], device=rows.device)[own]
        rows[idx, local.reshape(-1)[own]] -= 1.0
        dloss = dloss.to(softmax.dtype)
        scale = dloss / count if ctx.mean else dloss.unsqueeze(-1)
        return (grad * scale).to(ctx.dtype), None, None, None, None, None


def _tp_group(comm, group) -> dist.ProcessGroup:
    if (comm is None) == (group is None):
        raise TypeError("vocab_parallel_cross_entropy: pass exactly one of comm= (a TPComm) or "
                        "group= (a process group)")
    if comm is not None:
        return require_comm("vocab_parallel_cross_entropy", comm).group
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"vocab_parallel_cross_entropy: group must be a torch.distributed "
                        f"ProcessGroup, got {type(group).__name__}")
    return group


def _checksum(targets: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 digest of ``targets`` on their device (no host sync): each value weighted
    by a hash of its position, summed with int64 wrap-around, so a changed or moved target
    changes it (up to collisions of a 64-bit sum)."""
    flat = targets.reshape(-1)
    pos = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
    weight = (pos * 2654435761 + 97531) % 2147483647 + 1
    return ((flat + 1) * weight).sum()


def vocab_parallel_cross_entropy(logits_shard_v: torch.Tensor, targets: torch.Tensor, *,
                                 comm=None, group=None, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits (..., V_r) against replicated targets (...).

    Equals ``F.cross_entropy(full_logits.reshape(-1, V), targets.reshape(-1),
    ignore_index=ignore_index, reduction=reduction)`` without gathering ``full_logits``: the
    max, the sum of exponentials and the target logit are reduced over the TP group: ``comm=``
    (a TPComm, its group) or ``group=`` (a process group), exactly one (the
    equations are in the module docstring). Rank r's shard must hold vocab rows
    ``[start_r, start_r + V_r)`` in rank order (as a ColumnParallelLinear head does; V_r may
    differ across ranks). Computed in float32, returned in the logits' dtype. ``reduction``:
    "mean" (over non-ignored tokens; nan if there are none, as torch) or "none" (per token,
    shape of ``targets``). One small all-gather first checks every rank's token count.
    """
    tp_group = _tp_group(comm, group)
    if reduction not in ("mean", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean' or 'none', "
                         f"got {reduction!r}")
    rank = dist.get_rank()
    if not logits_shard_v.is_floating_point() or targets.dtype != torch.int64:
        raise TypeError(f"vocab_parallel_cross_entropy: need floating logits and int64 targets "
                        f"(rank {rank}), got {logits_shard_v.dtype} and {targets.dtype}")
    if logits_shard_v.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits_shard_v.shape)} "
                         f"and targets {tuple(targets.shape)} disagree on the token dims "
                         f"(rank {rank})")
    # Every rank's (tokens, V_r, what must agree): checks the token counts, the options, the
    # logits' dtype and a checksum of the targets agree (the same all-gather, read on the
    # host once), and gives this rank's offset.
    n = targets.numel()
    dev = logits_shard_v.device
    mine = torch.cat([torch.tensor([n, logits_shard_v.shape[-1], ignore_index,
                                    reduction == "mean", DTYPE_CODES.get(logits_shard_v.dtype, 0)],
                                   dtype=torch.int64, device=dev),
                      _checksum(targets.to(dev)).reshape(1)]).view(1, -1)
    everyone = all_gather_dim(mine, 0, group=tp_group, op="vocab_parallel_cross_entropy shapes")
    if (everyone[:, 0] != n).any():
        raise ValueError(f"vocab_parallel_cross_entropy: token counts differ across the TP "
                         f"group: {everyone[:, 0].tolist()} (rank {rank}); targets must be "
                         f"replicated")
    for col, name in ((2, "ignore_index"), (3, "reduction == 'mean'"), (4, "the logits' dtype"),
                      (5, "a checksum of the targets")):
        if (everyone[:, col] != everyone[0, col]).any():
            shown = everyone[:, col].tolist()
            if col == 4:
                shown = [dtype_name(c) for c in shown]
            raise ValueError(f"vocab_parallel_cross_entropy: {name} differs across the TP "
                             f"group (TP rank order): {shown} (rank {rank}); every rank must "
                             "pass the same targets and options")
    tp_rank = dist.get_rank(tp_group)
    vocab = int(everyone[:, 1].sum())
    vocab_start = int(everyone[:tp_rank, 1].sum())
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bad.any():
        raise ValueError(f"vocab_parallel_cross_entropy: targets must be in [0, {vocab}) or "
                         f"ignore_index={ignore_index}; got {targets[bad][:4].tolist()} "
                         f"(rank {rank})")
    return _VocabParallelCrossEntropy.apply(logits_shard_v, targets, vocab_start, ignore_index,
                                            reduction == "mean", tp_group)
