"""Drop-in tensor-parallel linear layers: ColumnParallelLinear and RowParallelLinear.

Shape legend: ``tp`` size of the TP group, ``K`` in_features, ``N`` out_features, ``b`` batch,
``t`` sequence, ``...`` any leading dims. Weights keep the ``nn.Linear`` layout [out, in]; the
fused ops take ``w`` as [K, N], so the layers pass ``weight.t()``. Suffixes name the sharding:
``_shard_n`` over the output features, ``_shard_k`` over the input features, ``_shard_s`` over
the sequence: dim ``seq_dim`` of a 3-D input (1: batch-first (b, t, K), the default; 0:
sequence-first (t, b, K)), dim 0 of a 2-D (M, K) input.

Contract: every layer takes its TPComm explicitly as ``comm=`` (there is no default group);
per-layer settings stay on the layer (``sequence_parallel``, ``seq_dim``, ``parts``,
``gather_output`` (column), ``input_is_parallel`` (row)). Built fresh, a layer holds the shards
of the full ``nn.Linear`` the same seed builds; ``from_linear`` takes ``nn.Linear`` or HF
``Conv1D``; ``full_state_dict()`` (collective) gathers the unsharded parameters in its layout.
The narrative: docs/design/nn.md.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from overlap.nn import sharding
from overlap.tp.comm import BACKENDS, TPComm
from overlap.tp.ops import (all_gather_matmul, call_op, define_op, matmul_all_reduce,
                            matmul_reduce_scatter)
from overlap.nn.regions import copy_to_tp, gather_from_tp, guarded, scatter_to_tp, stamp_call
from overlap.tp.backends import stamped_all_reduce_finish, stamped_all_reduce_start
from overlap.nn.sharding import ShardSpec

__all__ = ["TPModule", "ColumnParallelLinear", "RowParallelLinear", "column_parallel_shared",
           "require_comm", "linear_weight", "BACKENDS"]


def require_comm(op: str, comm) -> TPComm:
    """The layer's communicator: ``comm=`` must be a TPComm (``TPComm(group, ...)`` or
    ``dims.tp_comm()``); there is no default group."""
    if not isinstance(comm, TPComm):
        got = ("nothing" if comm is None else f"a ProcessGroup ({type(comm).__name__}): wrap it, "
               "comm=TPComm(group)" if isinstance(comm, dist.ProcessGroup) else
               type(comm).__name__)
        raise TypeError(f"{op}: comm= must be a TPComm (TPComm(group, backend=..., chunks=...) "
                        f"or dims.tp_comm()), got {got}")
    return comm


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's tensor of a parameter that may be exposed as a DTensor on the TP mesh
    (overlap.nn.dtensor.expose_dtensors; differentiable, so gradients reach the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight, bias, transposed) of an ``nn.Linear`` ([out, in]) or an HF ``Conv1D``
    ([in, out], transposed=True). TypeError for anything else."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight, getattr(module, "bias", None), True
    raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}")


class TPModule(nn.Module):
    """Base of every TP layer: holds its ``comm`` (and ``tp_group`` = ``comm.group``) and one
    ShardSpec per parameter."""

    tp_group = None
    comm: TPComm
    shard_specs: dict[str, ShardSpec]

    def _init_comm(self, op: str, comm) -> None:
        self.comm = require_comm(op, comm)
        self.tp_group = self.comm.group
        self.tp_size = self.comm.world
        self.tp_rank = self.comm.rank

    def full_state_dict(self, prefix: str = "", *, grads: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded parameters (or their gradients, zeros where None) keyed like the source
        module's state dict. Collective over ``tp_group``."""
        out = {}
        for name, p in self.named_parameters(recurse=False):
            t = p if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
            out[prefix + name] = sharding.gather(local(t), self.shard_specs[name],
                                                 group=self.tp_group)
        return out

    def _set_params(self, weight_full: torch.Tensor, bias_full: torch.Tensor | None,
                    w_spec: ShardSpec, b_spec: ShardSpec | None) -> None:
        self.shard_specs = {"weight": w_spec}
        self.weight = nn.Parameter(sharding.shard(weight_full, w_spec, self.tp_rank,
                                                  self.tp_size))
        if bias_full is None:
            self.register_parameter("bias", None)
        else:
            self.shard_specs["bias"] = b_spec
            self.bias = nn.Parameter(sharding.shard(bias_full, b_spec, self.tp_rank,
                                                    self.tp_size))

    def _seq_dim(self, x: torch.Tensor) -> int:
        return self.seq_dim if x.dim() == 3 else 0

    def _check_input(self, x: torch.Tensor, want_k: int) -> None:
        if x.dim() < 1 or x.shape[-1] != want_k:
            raise ValueError(f"{type(self).__name__}: input last dim must be {want_k} on tp rank "
                             f"{self.tp_rank}, got shape {tuple(x.shape)}")
        if self.sequence_parallel and x.dim() not in (2, 3):
            raise ValueError(f"{type(self).__name__}: sequence_parallel needs (M, K) or "
                             f"(b, t, K) input on tp rank {self.tp_rank}, got {tuple(x.shape)}")


def _column_linear_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            comm: TPComm, layer: int, need_dx: bool, need_dw: bool,
                            need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx = all_reduce(dy @ w), launched first; dw and db computed while it is in flight.
    A gradient not needed is an empty tensor (custom ops return no None). The all-reduce is
    stamped with the layer's number (``layer``), so a rank whose input needs no gradient (it
    skips this all-reduce) is named when its next one pairs with it, even with equal widths."""
    op = "ColumnParallelLinear dgrad all_reduce"
    started = None
    if need_dx:
        def start():
            # Not the weight's shape: uneven shards (N % tp) differ by rank.
            stamp_call(comm, op, x.shape, dy.dtype, flags=layer)
            return stamped_all_reduce_start(comm, x.shape, dy, op,
                                            lambda dx: torch.matmul(dy, weight, out=dx))
        started = guarded(comm, op, start)
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw = dy2.t().matmul(x.reshape(-1, x.shape[-1])) if need_dw else weight.new_empty(0)
    db = dy2.sum(0) if need_db else weight.new_empty(0)
    if started is None:
        return dy.new_empty(0), dw, db
    return guarded(comm, op, lambda: stamped_all_reduce_finish(comm, started, op)), dw, db


define_op("column_linear_backward", _column_linear_backward,
          lambda dy, x, w, comm, layer, need_dx, need_dw, need_db: (
              x.new_empty(x.shape) if need_dx else dy.new_empty(0),
              w.new_empty(w.shape) if need_dw else w.new_empty(0),
              w.new_empty(w.shape[0]) if need_db else w.new_empty(0)))


class _ColumnLinearAllReduceDgrad(torch.autograd.Function):
    """y_shard_n = x @ w_shard_n.T + b_shard_n with x replicated; backward all-reduces dx
    asynchronously and computes the weight gradient while it is in flight (one
    implementation, reached directly in eager and through its custom op under compile)."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, layer):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.layer, ctx.has_bias = comm, layer, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        dx, dw, db = call_op("column_linear_backward", _column_linear_backward, dy.contiguous(),
                             x, weight, ctx.comm, ctx.layer, need_dx, need_dw, need_db)
        return (dx if need_dx else None), (dw if need_dw else None), \
            (db if need_db else None), None, None


def _column_linear(x, weight, bias, comm, layer):
    return _ColumnLinearAllReduceDgrad.apply(x, weight, bias, comm, layer)


# Column layers built on a communicator, in order: every rank builds the same model in the same
# order, so a layer's number names it alike on every rank (its dgrad all-reduce's stamp).
_built: "weakref.WeakKeyDictionary[TPComm, int]" = weakref.WeakKeyDictionary()


def _number(comm: TPComm) -> int:
    n = _built.get(comm, 0)
    _built[comm] = n + 1
    return n


class _Linear(TPModule):
    """Shared construction for the two linear layers (``_split`` says which dim is sharded)."""

    _split: str  # "out" or "in"

    def _configure(self, comm, *, sequence_parallel: bool, seq_dim: int, parts) -> None:
        name = type(self).__name__
        self._init_comm(name, comm)
        if isinstance(parts, (list, tuple)):
            parts = tuple(parts)
            ok = len(parts) >= 1 and all(isinstance(p, int) and not isinstance(p, bool)
                                         and p >= 1 for p in parts)
            multi = len(parts) > 1
        else:
            ok = isinstance(parts, int) and not isinstance(parts, bool) and parts >= 1
            multi = ok and parts > 1
        if not ok or (multi and self._split == "in"):
            raise ValueError(f"{name}: parts must be a positive int or a tuple of positive "
                             f"block sizes (and 1 for a row layer), got {parts!r} (rank "
                             f"{dist.get_rank()})")
        if seq_dim not in (0, 1):
            raise ValueError(f"{name}: seq_dim must be 1 (batch-first (b, t, K)) or 0 "
                             f"(sequence-first (t, b, K)), got {seq_dim!r}")
        self.sequence_parallel = bool(sequence_parallel)
        self.seq_dim = seq_dim
        self.parts = parts

    def _build(self, in_features: int, out_features: int, bias: bool, device, dtype) -> None:
        # Same RNG draws as nn.Linear(in, out): the shards of the same full weight on every rank.
        full = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._load(full.weight, full.bias, transposed=False)

    @classmethod
    def _from(cls, linear: nn.Module):
        try:
            weight, bias, transposed = linear_weight(linear)
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.from_linear: {exc}") from None
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        return self, (weight, bias, transposed)

    def _load(self, weight: torch.Tensor, bias: torch.Tensor | None, *, transposed: bool):
        name = type(self).__name__
        out_f, in_f = (weight.shape[1], weight.shape[0]) if transposed else weight.shape
        self.in_features, self.out_features = int(in_f), int(out_f)
        n = out_f if self._split == "out" else in_f
        tp = self.tp_size
        where = f"(rank {dist.get_rank()})"
        if isinstance(self.parts, tuple):
            if sum(self.parts) != n:
                raise ValueError(f"{name}: parts={self.parts} sum to {sum(self.parts)}, but "
                                 f"{self._split}_features={n} {where}")
            bad = [p for p in self.parts if p % tp]
            if bad:
                raise ValueError(f"{name}: every part of parts={self.parts} must be divisible "
                                 f"by tp={tp}; {bad} are not {where}")
        elif n % self.parts or n // self.parts < tp:
            raise ValueError(f"{name}: {self._split}_features={n} must be {self.parts} equal "
                             f"parts of at least tp={tp} features each {where}")
        elif self.parts > 1 and (n // self.parts) % tp:
            raise ValueError(f"{name}: each of the {self.parts} parts ({n // self.parts} "
                             f"features) must be divisible by tp={tp} {where}")
        sizes = sharding.shard_sizes(n, tp)
        uneven = tuple(sizes) if len(set(sizes)) > 1 else None
        if uneven and self._split == "in":
            # The row input comes from a column layer split evenly, and the fused ops need
            # every rank's w to have the same shape.
            raise ValueError(f"{name}: in_features={n} must be divisible by tp={tp} "
                             f"(rank {dist.get_rank()})")
        self.local_sizes = sizes
        dim = 0 if self._split == "out" else 1
        w_spec = ShardSpec(dim=dim, parts=self.parts, sizes=uneven, transpose=transposed)
        b_spec = (ShardSpec(dim=0, parts=self.parts, sizes=uneven) if self._split == "out"
                  else ShardSpec(dim=None))
        self._set_params(weight, bias, w_spec, b_spec)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"local_weight={tuple(self.weight.shape)}, bias={self.bias is not None}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
                f"backend={self.comm.backend}")


class ColumnParallelLinear(_Linear):
    """y = x @ W.T + b with W [N, K] split over its output features: weight_shard_n [N/tp, K].

    sequence_parallel=False: x (..., K) replicated on every rank.
      forward  y_shard_n = x @ w_shard_n.T + b_shard_n
      dgrad    dx        = all_reduce(dy_shard_n @ w_shard_n)   (async, overlaps wgrad)
      wgrad    dw_shard_n = dy_shard_n.T @ x
    sequence_parallel=True: x_shard_s (b, t/tp, K) (or (M/tp, K)), via all_gather_matmul.
      forward  y_shard_n  = all_gather_s(x_shard_s) @ w_shard_n.T + b_shard_n   (b, t, N/tp)
      dgrad    dx_shard_s = reduce_scatter_s(dy_shard_n @ w_shard_n)
      wgrad    dw_shard_n = dy_shard_n.T @ all_gather_s(x_shard_s)
    gather_output=True returns y = all_gather(y_shard_n, dim -1) (..., N) instead (for a
    head whose loss wants full logits); its backward keeps this rank's columns of dy.

    ``parts`` > 1 shards each of ``parts`` equal output blocks separately (fused [q; k; v]);
    a tuple gives unequal block sizes (GQA [q: H*d | k: KV*d | v: KV*d]), each divisible by
    tp. N not divisible by tp (parts=1) gives uneven shards (first N % tp ranks one larger).
    """

    _split = "out"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 comm: TPComm | None = None,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 seq_dim: int = 1, parts: int | tuple[int, ...] = 1,
                 device=None, dtype=None):
        super().__init__()
        self._configure(comm, sequence_parallel=sequence_parallel, seq_dim=seq_dim, parts=parts)
        self.gather_output = bool(gather_output)
        self.layer_number = _number(self.comm)
        self._build(in_features, out_features, bias, device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Module, *, comm: TPComm | None = None,
                    gather_output: bool = False, sequence_parallel: bool = False,
                    seq_dim: int = 1, parts: int | tuple[int, ...] = 1) -> "ColumnParallelLinear":
        """Shard an existing ``nn.Linear`` or HF ``Conv1D`` (its values; the source module is
        left unchanged). ``parts``: the output dim is that many equal blocks to shard
        separately (fused qkv: parts=3)."""
        self, (weight, bias, transposed) = cls._from(linear)
        self._configure(comm, sequence_parallel=sequence_parallel, seq_dim=seq_dim, parts=parts)
        self.gather_output = bool(gather_output)
        self.layer_number = _number(self.comm)
        self._load(weight, bias, transposed=transposed)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.in_features)
        if self.tp_size == 1:
            y = F.linear(x, local(self.weight), local(self.bias))
        elif self.sequence_parallel:
            w = local(self.weight)
            w, n_local = w.t(), w.shape[0]
            pad = max(self.local_sizes) - n_local
            if pad:  # uneven vocab: the fused op needs one w shape on every rank
                w = F.pad(w, (0, pad))
            y = all_gather_matmul(x, w, comm=self.comm,
                                  seq_dim=self._seq_dim(x))
            if pad:
                y = y[..., :n_local]
            if self.bias is not None:
                y = y + local(self.bias)
        else:
            y = _column_linear(x, local(self.weight), local(self.bias), self.comm,
                               self.layer_number)
        if self.gather_output:
            sizes = None if len(set(self.local_sizes)) == 1 else self.local_sizes
            y = gather_from_tp(y, -1, sizes=sizes, comm=self.comm)
        return y


class RowParallelLinear(_Linear):
    """y = x @ W.T + b with W [N, K] split over its input features: weight_shard_k [N, K/tp];
    the bias is replicated and added once, after the reduction.

    input_is_parallel=True: x_shard_k (..., K/tp) is the output of a column layer.
    input_is_parallel=False: x (..., K) is replicated and this layer keeps its K/tp columns
    (backward all-gathers dx).
    sequence_parallel=False, via matmul_all_reduce:
      forward  y          = all_reduce(x_shard_k @ w_shard_k.T) + b        (..., N) replicated
      dgrad    dx_shard_k = dy @ w_shard_k
      wgrad    dw_shard_k = dy.T @ x_shard_k ;  db = sum(dy)
    sequence_parallel=True, via matmul_reduce_scatter (x_shard_k (b, t, K/tp)):
      forward  y_shard_s  = reduce_scatter_s(x_shard_k @ w_shard_k.T) + b  (b, t/tp, N)
      dgrad    dx_shard_k = all_gather_s(dy_shard_s) @ w_shard_k
      wgrad    dw_shard_k = all_gather_s(dy_shard_s).T @ x_shard_k
               db         = all_reduce(sum(dy_shard_s))   (each rank saw only its tokens)
    """

    _split = "in"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 comm: TPComm | None = None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 seq_dim: int = 1, device=None, dtype=None):
        super().__init__()
        self._configure(comm, sequence_parallel=sequence_parallel, seq_dim=seq_dim, parts=1)
        self.input_is_parallel = bool(input_is_parallel)
        self._build(in_features, out_features, bias, device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Module, *, comm: TPComm | None = None,
                    input_is_parallel: bool = True,
                    sequence_parallel: bool = False, seq_dim: int = 1) -> "RowParallelLinear":
        """Shard an existing ``nn.Linear`` or HF ``Conv1D`` over its input features."""
        self, (weight, bias, transposed) = cls._from(linear)
        self._configure(comm, sequence_parallel=sequence_parallel, seq_dim=seq_dim, parts=1)
        self.input_is_parallel = bool(input_is_parallel)
        self._load(weight, bias, transposed=transposed)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = None if len(set(self.local_sizes)) == 1 else self.local_sizes
        if not self.input_is_parallel:
            self._check_input(x, self.in_features)
            x = scatter_to_tp(x, -1, sizes=sizes, comm=self.comm)
        self._check_input(x, local(self.weight).shape[1])
        if self.tp_size == 1:
            return F.linear(x, local(self.weight), local(self.bias))
        if self.sequence_parallel:
            y = matmul_reduce_scatter(x, local(self.weight).t(), comm=self.comm,
                                      seq_dim=self._seq_dim(x))
            bias = None if self.bias is None else copy_to_tp(local(self.bias), comm=self.comm)
        else:
            y = matmul_all_reduce(x, local(self.weight).t(), comm=self.comm)
            bias = local(self.bias)
        return y if bias is None else y + bias


def column_parallel_shared(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """Several ColumnParallelLinear layers that read the same input (q, k and v), as one GEMM:

        [y_1, ..., y_n] = split(column(x; w = [w_1; ...; w_n], b = [b_1; ...; b_n]))

    so the input is all-gathered once (sequence parallel) or its gradient all-reduced once
    (not) instead of n times. Equal to ``[layer(x) for layer in layers]``, which is what runs
    when the layers disagree on communicator, sequence parallelism or seq_dim, gather their
    output, or mix bias and no bias.
    """
    first = layers[0]
    key = (first.comm, first.sequence_parallel, first.seq_dim, first.bias is None)
    if any((m.comm, m.sequence_parallel, m.seq_dim, m.bias is None) != key
           or m.gather_output or not isinstance(m, ColumnParallelLinear)
           or len(set(m.local_sizes)) > 1 for m in layers):
        return [m(x) for m in layers]
    first._check_input(x, first.in_features)
    weight = torch.cat([local(m.weight) for m in layers])
    bias = None if first.bias is None else torch.cat([local(m.bias) for m in layers])
    if first.tp_size == 1:
        y = F.linear(x, weight, bias)
    elif first.sequence_parallel:
        y = all_gather_matmul(x, weight.t(), comm=first.comm,
                              seq_dim=first._seq_dim(x))
        y = y if bias is None else y + bias
    else:
        y = _column_linear(x, weight, bias, first.comm, first.layer_number)
    return list(y.split([local(m.weight).shape[0] for m in layers], -1))
