"""parallelize's self-verification: the parallel model proves, on a probe, that it computes
what the unsharded one did, before it is handed back.

Contract: three checks, all on by default (``parallelize(verify=True)``), all collective over
the TP group, none in a forward pass: the same model on every rank (``check_same_weights``),
each replaced layer against the unsharded module (``LeafProbe``) and each region that contains
replaced layers (``UnitProbe``; the whole model with ``verify="model"``). Errors are
max |parallel - reference| / max |reference| per tensor; every rank's worst is all-reduced
(MAX), so all ranks decide alike. The tolerance defaults to 1e-4 for fp32/fp64 and 3e-2 for
16-bit models. The probe runs in eval mode and draws from its own generators, never the global
RNG.
The narrative: docs/design/nn.md.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.nn import sharding
from overlap.nn.layers import linear_weight
from overlap.nn.sharding import ShardSpec
from overlap.tp.collectives import all_gather_dim, wait

__all__ = ["check_same_weights", "default_probe", "LeafProbe", "UnitProbe", "GradProbe",
           "tensor_hash", "rel_err", "primary_output", "HEAD_ATTR", "all_max", "user_probe"]

HEAD_ATTR = re.compile(r"(^|_)heads?$|^num_.*heads$|^split_size$|^embed_dim$|^all_head_size$")
_SEED = 20251123


def tensor_hash(t: torch.Tensor) -> torch.Tensor:
    """Four int64 words of ``t``'s bytes, exact and independent of summation order (wrapping
    integer sums of its int32 words laid out as rows of 64): the total, the row sums weighted
    by row index, the column sums weighted by column index, and the element count. Two
    reductions over the tensor, no int64 copy of it."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % 256
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int32).view(-1, 64)
    rows = w.sum(1, dtype=torch.int64)
    cols = w.sum(0, dtype=torch.int64)
    idx_r = torch.arange(1, rows.numel() + 1, device=w.device, dtype=torch.int64)
    idx_c = torch.arange(1, 65, device=w.device, dtype=torch.int64)
    return torch.stack([rows.sum(), (rows * idx_r).sum(), (cols * idx_c).sum(),
                        torch.tensor(t.numel(), device=w.device)])


def check_same_weights(model: nn.Module, group, *, timeout: float) -> None:
    """ValueError on every rank unless every parameter and buffer is identical across
    ``group``. Two small all-gathers (count, then hashes)."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return
    named = list(model.named_parameters()) + list(model.named_buffers())
    device = named[0][1].device if named else torch.device("cpu")
    names_code = sum((i + 1) * sum(map(ord, n)) for i, (n, _) in enumerate(named))
    head = torch.tensor([[len(named), names_code]], dtype=torch.int64, device=device)
    heads = all_gather_dim(head, 0, group=group, op="parallelize weight check",
                           timeout=timeout)
    ranks = dist.get_process_group_ranks(group)
    if (heads != heads[0]).any():
        raise ValueError(f"parallelize on rank {dist.get_rank()}: the model differs in "
                         f"structure across TP ranks {ranks} (parameter+buffer counts "
                         f"{heads[:, 0].tolist()}); every rank must build the same model")
    if not named:
        return
    mine = torch.stack([tensor_hash(t) for _, t in named]).to(device)
    every = all_gather_dim(mine.unsqueeze(0), 0, group=group, op="parallelize weight check",
                           timeout=timeout)
    differs = (every != every[0:1]).any(-1).any(0)
    if differs.any():
        i = int(differs.nonzero()[0, 0])
        groups: dict[tuple, list[int]] = {}
        for r in range(tp):
            groups.setdefault(tuple(every[r, i].tolist()), []).append(ranks[r])
        split = " vs ".join(str(g) for g in groups.values())
        count = int(differs.sum())
        raise ValueError(
            f"parallelize on rank {dist.get_rank()}: the unsharded model is not the same on "
            f"every TP rank: {named[i][0]} differs between ranks {split} ({count} of "
            f"{len(named)} parameters/buffers differ). Build it from the same seed (or load "
            "the same checkpoint) on every rank before parallelize")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    want64 = want.detach().double()
    scale = max(want64.abs().max().item() if want64.numel() else 0.0, 1e-12)
    err = (got.detach().double() - want64).abs().max().item() if want64.numel() else 0.0
    return err / scale if err == err else float("inf")


def primary_output(out: Any) -> torch.Tensor | None:
    """The first floating tensor of a module's output (tensor, tuple, dict, ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) \
        else ()
    for v in values:
        p = primary_output(v)
        if p is not None:
            return p
    return None


def _tree(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(_tree(v, fn) for v in x)
    if isinstance(x, list):
        return [_tree(v, fn) for v in x]
    if isinstance(x, dict):
        return {k: _tree(v, fn) for k, v in x.items()}
    return x


def _randn(shape, like: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(like.device, like.dtype)


def default_probe(model: nn.Module, tp: int) -> Callable[[nn.Module], Any] | None:
    """model -> output on a deterministic input that is the same on every rank: token ids
    (2, T), T = 8 rounded up to a multiple of tp, for models that take ids (a config with
    vocab_size, or an nn.Embedding); else features (2, T, K) for a model whose first
    module is an nn.Linear with K inputs. None when neither applies (the caller's forward
    may still reject it: then only the layers are checked)."""
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear))), None)
    if not isinstance(vocab, int) and isinstance(first, nn.Embedding):
        vocab = first.num_embeddings
    limit = next((getattr(cfg, a) for a in ("max_position_embeddings", "seq_len", "n_positions")
                  if isinstance(getattr(cfg, a, None), int)), 1 << 30)
    t = -(-8 // tp) * tp
    if t > limit:
        t = limit - limit % tp
    if t < 1:
        return None
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    if not isinstance(vocab, int):
        if not isinstance(first, nn.Linear):
            return None
        x = _randn((2, t, first.in_features), first.weight, _SEED + 3)
        return lambda m: m(x)
    ids = torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(_SEED))
    ids = ids.to(device)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "input_ids" in params:
        kwargs = {"input_ids": ids}
        if "use_cache" in params or any(v.kind == v.VAR_KEYWORD for v in params.values()):
            kwargs["use_cache"] = False
        return lambda m: m(**kwargs)
    return lambda m: m(ids)


def user_probe(probe: Any) -> Callable[[nn.Module], Any]:
    if callable(probe) and not isinstance(probe, torch.Tensor):
        return probe
    if isinstance(probe, torch.Tensor):
        return lambda m: m(probe)
    if isinstance(probe, tuple):
        return lambda m: m(*probe)
    if isinstance(probe, dict):
        return lambda m: m(**probe)
    raise TypeError(f"parallelize: probe must be a tensor, a tuple of args, a dict of kwargs or "
                    f"a callable model -> output, got {type(probe).__name__}")


class LeafProbe:
    """One replaced column/row/embedding layer: reference output and input gradient of the
    unsharded module on a deterministic input, then the TP layer's on this rank's shard."""

    def __init__(self, name: str, module: nn.Module, kind: str, tp: int):
        self.name, self.kind, self.ok = name, kind, True
        b, t = 2, 2 * tp  # batch-first (the layers' seq_dim=1); t splits over tp with SP
        with torch.enable_grad():
            try:
                if kind == "embedding":
                    w = module.weight
                    self.x = torch.randint(0, module.num_embeddings, (b, t),
                                           generator=torch.Generator().manual_seed(_SEED))
                    self.x = self.x.to(w.device)
                    self.y = module(self.x).detach()
                    self.dx = None
                else:
                    w, _, transposed = linear_weight(module)
                    k = w.shape[0] if transposed else w.shape[1]
                    self.x = _randn((b, t, k), w, _SEED).requires_grad_()
                    y = module(self.x)
                    self.cot = _randn(y.shape, y, _SEED + 1)
                    self.dx = torch.autograd.grad(y, self.x, self.cot)[0].detach()
                    self.y = y.detach()
                    self.x = self.x.detach()
            except Exception:  # a forward that needs more than one tensor: regions cover it
                self.ok = False

    def errors(self, layer: nn.Module) -> tuple[float, float]:
        """(output error, input-gradient error) of the TP layer against the reference."""
        if not self.ok:
            return 0.0, 0.0
        tp, rank = layer.tp_size, layer.tp_rank
        sp = getattr(layer, "sequence_parallel", False)
        seq = getattr(layer, "seq_dim", 1)

        def seq_shard(t):
            return t.chunk(tp, seq)[rank] if sp else t

        with torch.enable_grad():
            if self.kind == "embedding":
                return rel_err(layer(self.x), seq_shard(self.y)), 0.0
            out_dim = self.y.dim() - 1
            if self.kind == "column":
                x = seq_shard(self.x).clone().requires_grad_()
                if layer.gather_output:
                    y_want, cot = self.y, self.cot
                else:
                    uneven = (tuple(layer.local_sizes) if len(set(layer.local_sizes)) > 1
                              else None)
                    spec = ShardSpec(dim=out_dim, parts=layer.parts, sizes=uneven)
                    y_want = sharding.shard(self.y, spec, rank, tp)
                    cot = sharding.shard(self.cot, spec, rank, tp)
                dx_want = seq_shard(self.dx)
            else:  # row: input sharded over features, output seq-sharded with SP
                spec = ShardSpec(dim=out_dim)
                x = (sharding.shard(self.x, spec, rank, tp) if layer.input_is_parallel
                     else self.x.clone()).requires_grad_()
                y_want, cot = seq_shard(self.y), seq_shard(self.cot)
                dx_want = (sharding.shard(self.dx, spec, rank, tp) if layer.input_is_parallel
                           else self.dx)
            y = layer(x)
            if y.shape != y_want.shape:
                return float("inf"), float("inf")
            dx = torch.autograd.grad(y, x, cot)[0]
        return rel_err(y, y_want), rel_err(dx, dx_want)


class UnitProbe:
    """Records, during one probe forward of the unsharded model, the inputs, output and input
    gradient of each named unit (a module that contains replaced layers)."""

    def __init__(self, model: nn.Module, names: list[str], run: Callable[[nn.Module], Any]):
        self.records: dict[str, list] = {}
        handles = []
        for name in names:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        try:
            with torch.no_grad():
                run(model)
        finally:
            for h in handles:
                h.remove()
        for name in list(self.records):
            args, kwargs, out = self.records[name]
            if out is None:
                del self.records[name]
                continue
            module = model.get_submodule(name)
            self.records[name].append(self._input_grad(module, args, kwargs, out, name))

    def _pre(self, name):
        def hook(module, args, kwargs):
            if name not in self.records:
                clone = lambda t: t.detach().clone()  # noqa: E731
                self.records[name] = [_tree(args, clone), _tree(kwargs, clone), None]
        return hook

    def _post(self, name):
        def hook(module, args, kwargs, out):
            rec = self.records.get(name)
            if rec is not None and rec[2] is None:
                p = primary_output(out)
                rec[2] = None if p is None else p.detach().clone()
        return hook

    @staticmethod
    def _grad_input(args, kwargs):
        """(args, kwargs) with the first floating tensor argument made a leaf requiring grad."""
        args = _tree(args, lambda t: t.clone())
        kwargs = _tree(kwargs, lambda t: t.clone())
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                args = (*args[:i], a.requires_grad_(), *args[i + 1:])
                return args, kwargs, a
        for k in ("hidden_states", "x", "input", "inputs_embeds"):
            a = kwargs.get(k)
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                a.requires_grad_()
                return args, kwargs, a
        return args, kwargs, None

    def _input_grad(self, module, args, kwargs, out, name):
        args, kwargs, x = self._grad_input(args, kwargs)
        if x is None:
            return None
        with torch.enable_grad():
            y = primary_output(module(*args, **kwargs))
            if y is None or not y.requires_grad:
                return None
            cot = _randn(y.shape, y, _SEED + 2)
            dx = torch.autograd.grad(y, x, cot, allow_unused=True)[0]
        return None if dx is None else (cot, dx.detach())

    def errors(self, name: str, module: nn.Module, tp_rank: int, tp: int) -> tuple[float, float]:
        """(output error, input-gradient error) of the parallel ``module`` re-run on the
        recorded inputs. An output that is this rank's shard of the reference along one dim
        (vocab-parallel logits) is compared with that shard."""
        args, kwargs, want, grad = self.records[name]
        args, kwargs, x = self._grad_input(args, kwargs)
        with torch.enable_grad():
            y = primary_output(module(*args, **kwargs))
            if y is None:
                return float("inf"), float("inf")
            want_local, narrow = _local_view(want, y, tp_rank, tp)
            if want_local is None:
                return float("inf"), float("inf")
            out_err = rel_err(y, want_local)
            if grad is None or x is None or not y.requires_grad:
                return out_err, 0.0
            cot, dx_want = grad
            dx = torch.autograd.grad(y, x, narrow(cot), allow_unused=True)[0]
        return out_err, (0.0 if dx is None and dx_want.abs().max() == 0
                         else float("inf") if dx is None else rel_err(dx, dx_want))


def _within(name: str, unit: str) -> bool:
    return unit == "" or name == unit or name.startswith(unit + ".")


class GradProbe:
    """The whole model on the probe: which modules see which input shapes, and the gradient of
    every parameter for a fixed cotangent on the output.

    Built on the unsharded model; then ``sharded_inputs(parallel)`` names the modules with
    parameters of their own (outside the replaced ones) whose inputs changed shape, i.e. that
    now run on activations sharded over TP (a per-head norm inside the attention region, a
    norm on sequence shards): their replicated parameters get partial gradients unless summed
    over TP. ``errors(parallel)`` compares every parameter's gradient, a sharded one with this
    rank's shard of the reference, a replicated one with the whole of it."""

    def __init__(self, model: nn.Module, run: Callable[[nn.Module], Any], skip: set[str]):
        self.run, self.skip = run, skip
        self.shapes = self._shapes(model)
        with torch.enable_grad():
            y = primary_output(run(model))
            if y is None:
                raise ValueError("the model's output holds no floating-point tensor")
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            if named and not y.requires_grad:
                raise ValueError("the model's output has no gradient, although parameters "
                                 "require one")
            self.y = y.detach()
            self.cot = _randn(y.shape, y, _SEED + 4)
            grads = (torch.autograd.grad(y, [p for _, p in named], self.cot, allow_unused=True)
                     if named else ())
        self.grads = {n: None if g is None else g.detach() for (n, _), g in zip(named, grads)}
        present = [g.abs().max().item() for g in self.grads.values()
                   if g is not None and g.numel()]
        self.largest = max(present, default=0.0)

    def _holders(self, model: nn.Module) -> dict[str, nn.Module]:
        return {n: m for n, m in model.named_modules()
                if any(p.requires_grad for p in m.parameters(recurse=False))
                and not any(_within(n, s) for s in self.skip if s)}

    def _shapes(self, model: nn.Module) -> dict[str, list]:
        seen: dict[str, list] = {}
        handles = []
        for name, module in self._holders(model).items():
            def hook(module, args, kwargs, name=name):
                shapes = []
                _tree((args, kwargs), lambda t: shapes.append(tuple(t.shape))
                      if t.is_floating_point() else None)
                seen.setdefault(name, []).append(shapes)
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            with torch.no_grad():
                self.run(model)
        finally:
            for h in handles:
                h.remove()
        return seen

    def sharded_inputs(self, model: nn.Module) -> list[str]:
        now = self._shapes(model)
        return sorted(n for n, shapes in now.items()
                      if n in self.shapes and shapes != self.shapes[n])

    def errors(self, model: nn.Module, rank: int, tp: int, shard_of) -> dict[str, float]:
        """{parameter name: gradient error} on this rank. ``shard_of(name)`` is the ShardSpec
        of a sharded parameter (None for a replicated one). The error is max |got - want|
        over the larger of max |want| (the whole parameter's) and 1% of the largest gradient
        of the model: a gradient that is zero in exact arithmetic (a key bias under softmax)
        is rounding noise on both sides and must not count as a relative error of 1."""
        floor = max(1e-2 * self.largest, 1e-30)
        with torch.enable_grad():
            y = primary_output(self.run(model))
            want_y, narrow = _local_view(self.y, y, rank, tp) if y is not None else (None, None)
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            if want_y is None or (named and not y.requires_grad):
                return {"<output>": float("inf")}
            grads = (torch.autograd.grad(y, [p for _, p in named], narrow(self.cot),
                                         allow_unused=True) if named else ())
        out = {}
        for (name, _), got in zip(named, grads):
            if name not in self.grads:
                continue
            want = self.grads[name]
            if want is None or got is None:
                nonzero = [g for g in (want, got) if g is not None and g.abs().max() > 0]
                out[name] = float("inf") if nonzero else 0.0
                continue
            scale = max(want.abs().max().item(), floor)
            spec = shard_of(name)
            if spec is not None:
                want = sharding.shard(want, spec, rank, tp)
            if got.shape != want.shape:
                out[name] = float("inf")
                continue
            err = (got.double() - want.double()).abs().max().item() / scale
            out[name] = err if err == err else float("inf")
        return out


def _local_view(want: torch.Tensor, got: torch.Tensor, rank: int, tp: int):
    """(reference restricted to what this rank's output holds, the same cut as a function)."""
    if want.shape == got.shape:
        return want, lambda t: t
    if want.dim() != got.dim():
        return None, None
    dims = [d for d in range(want.dim()) if want.shape[d] != got.shape[d]]
    if len(dims) != 1:
        return None, None
    d = dims[0]
    sizes = sharding.shard_sizes(want.shape[d], tp)
    if sizes[rank] != got.shape[d]:
        return None, None
    start = sum(sizes[:rank])

    def cut(t):
        return t.narrow(d, start, sizes[rank])

    return cut(want), cut


def all_max(values: list[float], group, *, timeout: float, device: torch.device) -> list[float]:
    """Element-wise max over ``group`` (every rank decides on the same numbers), carried on
    ``device`` (the group's: NCCL takes no host tensors)."""
    if not values or dist.get_world_size(group) == 1:
        return values
    t = torch.tensor([min(v, 1e300) for v in values], dtype=torch.float64, device=device)
    wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True),
         op="parallelize verification", group=group, timeout=timeout)
    return t.tolist()
