"""apply_plan(model, plan, ...): swap a model's modules for tensor-parallel ones, in place, by a
plan; the core of ``overlap.nn.parallelize``, which finds a model's shipped plan.

A plan (``TPPlan``) maps module-name glob patterns (``fnmatch``, ``*`` also matches dots) to a
style; the first pattern that matches a module wins. Styles (strings or ``Style`` objects):
``column``, ``qkv``, ``gate_up``, ``row``, ``embedding``, ``vocab_head``, ``head``, ``sp_norm``,
``sp_positions``, ``sum_grads``, ``replicated``, ``experts`` (a mixture-of-experts block over
the EP group of ``ep_comm``; what each does: docs/design/nn.md).

Contract: every check (patterns, module types, divisibility, ties) runs before anything is
changed and all failures come in one ValueError; with ``verify`` (the default, overlap.nn.probes)
the parallel model is compared with the unsharded one on a probe (one the model rejects is an
error). A mismatch, or anything raising later (the model's own forward included), restores the
model exactly and raises one ValueError on every rank naming the module and the cause.
Fused layouts, subclasses, ``divide``, ties, gather helpers: docs/parallelize.md.
"""

from __future__ import annotations

import copy
import fnmatch

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.errors import OverlapError
from overlap.nn.embedding import VocabParallelEmbedding
from overlap.nn.layers import (ColumnParallelLinear, RowParallelLinear, TPModule, linear_weight,
                               require_comm)
from overlap.nn.probes import check_same_weights, user_probe
from overlap.nn.sequence import (SequenceShardedPositions, sequence_parallel_norm,
                                 sum_grads_over_tp, sums_grads_over_tp,
                                 undo_sum_grads_over_tp)
from overlap.nn.tp_plan import STYLES, Style, TPPlan
from overlap.nn.verification import Verifier
from overlap.nn.wrap import SUBCLASS_MODES, base_of, overridden, wrap_subclass
from overlap.tp.collectives import all_gather_dim
from overlap.tp.comm import TPComm

__all__ = ["apply_plan", "gather_state_dict", "gather_grads", "expert_modules"]


def expert_modules(model: nn.Module) -> list[tuple[str, str]]:
    """(name, class name) of every module of a transformers model that holds the experts of a
    mixture-of-experts block: a transformers class named ``*Experts``, or a child named
    ``experts`` of a transformers module. overlap's own MoE layers are not listed."""
    modules = dict(model.named_modules())
    out = []
    for name, m in modules.items():
        parent = modules.get(name.rpartition(".")[0]) if name else None
        own = type(m).__module__.startswith("transformers.")
        if (own and type(m).__name__.endswith("Experts")) or (
                name.rpartition(".")[2] == "experts" and parent is not None
                and type(parent).__module__.startswith("transformers.")):
            if not any(n != name and name.startswith(n + ".") for n, _ in out):
                out.append((name, type(m).__name__))
    return out


def _style(value) -> Style | None:
    if isinstance(value, Style):
        return value
    return STYLES.get(value)


def _check_column(name: str, style: Style, n: int, tp: int) -> list[str]:
    if style.layout not in ("blocks", "per_head"):
        return [f"{name}: layout must be 'blocks' or 'per_head', got {style.layout!r}"]
    parts = style.parts
    if not (isinstance(parts, int) and not isinstance(parts, bool) and parts >= 1) and not (
            isinstance(parts, tuple) and parts
            and all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in parts)):
        return [f"{name}: parts must be a positive int or a tuple of positive sizes, got "
                f"{parts!r}"]
    if style.layout == "per_head":
        heads = style.heads
        if heads is None:  # whole heads per rank cannot be checked here; verification does
            group = style.num_parts()
            if n % (group * tp):
                return [f"{name}: out_features={n} is not divisible by tp={tp} x {group} "
                        "parts per head (layout='per_head'; pass heads= to check whole heads)"]
            return []
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            return [f"{name}: layout='per_head' needs heads=<number of head groups>, got "
                    f"{heads!r}"]
        if n % heads:
            return [f"{name}: out_features={n} is not {heads} equal head groups"]
        if heads % tp:
            return [f"{name}: heads={heads} (layout='per_head') is not divisible by tp={tp}; "
                    "each rank keeps whole heads"]
        return []
    parts = style.feature_parts()
    if isinstance(parts, tuple):
        unit = "heads" if style.head_dim else "features"
        given = style.parts
        if sum(parts) != n:
            return [f"{name}: parts={given} ({unit}) make {sum(parts)} features, but "
                    f"out_features={n}"]
        bad = [p for p in given if p % tp]
        if bad:
            return [f"{name}: parts={given} ({unit}): {bad} not divisible by tp={tp}"]
        return []
    if style.uneven:
        return [] if n >= tp else [f"{name}: out_features={n} is smaller than tp={tp}"]
    if n % (parts * tp):
        split = f"{parts} parts x tp={tp}" if parts > 1 else f"tp={tp}"
        return [f"{name}: out_features={n} is not divisible by {split}"]
    return []


def _check_module(name: str, module: nn.Module, style: Style, tp: int,
                  subclasses: str, ep: int | None = None) -> list[str]:
    """Problems with applying ``style`` to ``module`` at this tp (and ep; empty: fine)."""
    kind = style.kind
    if kind == "replicated":
        return []
    if kind == "experts":
        if not callable(style.build) or type(module) not in style.accepts:
            return [f"{name}: style 'experts' needs build=callable and accepts the exact type, "
                    f"got {type(module).__name__} (accepts {[t.__name__ for t in style.accepts]})"]
        if ep is None:
            return [f"{name}: style 'experts' shards a {type(module).__name__} over EP: pass "
                    "ep_comm= (an EPComm; a group of one rank keeps every expert)"]
        experts = getattr(module, "experts", None)
        first = next(iter(experts.parameters(recurse=False)), None) if experts else None
        if first is None:
            return [f"{name}: style 'experts' needs a child 'experts' with parameters "
                    f"[num_experts, ...], {type(module).__name__} has none"]
        if first.shape[0] % ep:
            return [f"{name}: {first.shape[0]} experts are not divisible by ep={ep}"]
        return []
    if kind in ("column", "row", "embedding") and subclasses == "refuse" and overridden(module):
        return [f"{name}: {type(module).__name__} overrides {overridden(module)} of "
                f"{base_of(module).__name__}; style {kind!r} would replace it "
                "(subclasses='refuse'; 'wrap' keeps its forward on top of the TP layer)"]
    if kind in ("column", "row"):
        try:
            weight, _, transposed = linear_weight(module)
        except TypeError:
            return [f"{name}: style {kind!r} needs nn.Linear or Conv1D, got "
                    f"{type(module).__name__}"]
        out_f, in_f = (weight.shape[1], weight.shape[0]) if transposed else weight.shape
        if kind == "column":
            return _check_column(name, style, out_f, tp)
        if style.uneven:
            return [] if in_f >= tp else [f"{name}: in_features={in_f} is smaller than tp={tp}"]
        return [f"{name}: in_features={in_f} is not divisible by tp={tp}"] if in_f % tp else []
    if kind in ("embedding", "sp_positions"):
        if not isinstance(module, nn.Embedding):
            return [f"{name}: style {kind!r} needs nn.Embedding, got {type(module).__name__}"]
        if kind == "embedding" and module.num_embeddings < tp:
            return [f"{name}: num_embeddings={module.num_embeddings} is smaller than tp={tp}"]
        return []
    if kind == "custom":
        if not callable(style.build):
            return [f"{name}: custom style needs build=callable"]
        if type(module) not in style.accepts:
            return [f"{name}: custom style accepts {[t.__name__ for t in style.accepts]}, got "
                    f"{type(module).__name__}"]
        return []
    if kind == "sum_grads":
        if not any(True for _ in module.parameters(recurse=False)):
            return [f"{name}: style 'sum_grads' on a {type(module).__name__} without "
                    "parameters of its own"]
        return []
    if kind == "sp_norm":
        if not isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return [f"{name}: style 'sp_norm' needs nn.LayerNorm or nn.RMSNorm, got "
                    f"{type(module).__name__}"]
        return []
    return [f"{name}: unknown style kind {kind!r}"]


def _tie_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Parameters held by more than one (module, attribute): [[(module name, attr), ...]]."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mname, pname))
    return [sorted(set(h)) for h in holders.values() if len(set(h)) > 1]


def _plan_matches(model, plan, sequence_parallel, tp, problems, subclasses, ep=None):
    """{module name: Style} for the modules this call will replace."""
    modules = dict(model.named_modules())
    chosen: dict[str, Style] = {}
    for pattern, value in plan.layers.items():
        style = _style(value)
        if style is None:
            problems.append(f"pattern {pattern!r}: unknown style {value!r} (known: "
                            f"{sorted(STYLES)} or a Style)")
            continue
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            problems.append(f"pattern {pattern!r} ({value}) matched no module")
        if style.sp_only and not sequence_parallel:
            continue
        for n in names:
            if n not in chosen:
                chosen[n] = style
                problems.extend(_check_module(n, modules[n], style, tp, subclasses, ep))
    return chosen


def _get_attr(module: nn.Module, path: str):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _check_divide(model, plan, tp, problems) -> list[tuple[str, str]]:
    todo = []
    for pattern, attrs in plan.divide.items():
        names = [n for n, _ in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            problems.append(f"divide pattern {pattern!r} matched no module")
        for n in names:
            module = model.get_submodule(n)
            for attr in attrs:
                value = _get_attr(module, attr)
                if attr.count(".") > 1 or (attr.count(".") == 1
                                           and not attr.startswith("config.")):
                    problems.append(f"{n}: divide attribute {attr!r} must be a name or "
                                    "'config.<name>'")
                elif not isinstance(value, int) or isinstance(value, bool):
                    problems.append(f"{n}.{attr}: expected an int attribute (a head count or "
                                    f"split size), got {value!r}; transformers version mismatch?")
                elif value % tp:
                    problems.append(f"{n}.{attr}={value} is not divisible by tp={tp}")
                else:
                    todo.append((n, attr))
    return todo


def _is_transposed(module: nn.Module) -> bool:
    try:
        return linear_weight(module)[2]
    except TypeError:
        return False  # reported as a wrong module type already


def _check_ties(model, chosen, problems) -> list[list[tuple[str, str]]]:
    ties = []
    for group in _tie_groups(model):
        members = [m for m, _ in group]
        if not any(m in chosen for m in members):
            continue
        same_rows = all(m in chosen and p == "weight" and chosen[m].num_parts() == 1
                        and chosen[m].kind in ("embedding", "column") for m, p in group)
        transposed = any(m in chosen and chosen[m].kind == "column"
                         and _is_transposed(model.get_submodule(m)) for m in members)
        if not same_rows or transposed:
            problems.append(f"tied parameter {['.'.join(h) for h in group]}: every module of a "
                            "tie must be parallelized as 'embedding' or a one-part column "
                            "over nn.Linear (same rows sharded)")
        else:
            ties.append(group)
    return ties


def _build(module, style: Style, comm: TPComm, sequence_parallel, ep=None) -> nn.Module:
    kind = style.kind
    if kind == "experts":
        ep_comm, tokens = ep
        return style.build(module, ep_comm=ep_comm, tokens=tokens)
    if kind == "column":
        return ColumnParallelLinear.from_linear(
            module, comm=comm, gather_output=style.gather_output, parts=style.feature_parts(),
            sequence_parallel=sequence_parallel)
    if kind == "row":
        return RowParallelLinear.from_linear(module, comm=comm,
                                             sequence_parallel=sequence_parallel)
    if kind == "embedding":
        return VocabParallelEmbedding.from_embedding(module, comm=comm,
                                                     sequence_parallel=sequence_parallel)
    if kind == "custom":
        return style.build(module, comm=comm, sequence_parallel=sequence_parallel)
    if kind == "sp_norm":
        return sequence_parallel_norm(module, comm=comm)
    return SequenceShardedPositions.from_embedding(module, comm=comm)


def _sum_grads(module: nn.Module, comm: TPComm, undo) -> None:
    fresh = not sums_grads_over_tp(module)  # one that summed before this call keeps doing so
    sum_grads_over_tp(module, comm=comm)
    if fresh:
        undo.append(lambda m=module: undo_sum_grads_over_tp(m))


def _replace(model, chosen, comm, sequence_parallel, subclasses, undo, ep=None) -> None:
    for name, style in chosen.items():
        if style.kind == "replicated":
            continue
        if style.kind == "sum_grads":
            _sum_grads(model.get_submodule(name), comm, undo)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        try:
            new = _build(old, style, comm, sequence_parallel, ep)
            if (style.kind in ("column", "row", "embedding") and subclasses == "wrap"
                    and overridden(old)):
                new = wrap_subclass(old, new)
        except Exception as exc:
            raise _Step(f"building the replacement of {name} ({type(old).__name__}, style "
                        f"{style.describe()!r})") from exc
        undo.append(lambda p=parent, c=child, o=old: setattr(p, c, o))
        setattr(parent, child, new)


def _divide(model, divide, tp, undo) -> None:
    copied: set[int] = set()
    for name, attr in divide:
        module = model.get_submodule(name)  # by name: the module may have been replaced
        target, leaf = module, attr
        if attr.startswith("config."):
            if id(module) not in copied:  # this module's own config; others keep theirs
                old_cfg = module.config
                undo.append(lambda m=module, c=old_cfg: setattr(m, "config", c))
                module.config = copy.copy(old_cfg)
                copied.add(id(module))
            target, leaf = module.config, attr.split(".", 1)[1]
        old = getattr(target, leaf)
        undo.append(lambda t=target, a=leaf, v=old: setattr(t, a, v))
        setattr(target, leaf, old // tp)


def apply_plan(model: nn.Module, plan: TPPlan, *, comm: TPComm | None = None, ep_comm=None,
               sequence_parallel: bool = False, verify: bool | str = True, probe=None,
               verify_tol: float | None = None, subclasses: str = "wrap",
               cp_comm=None) -> nn.Module:
    """Replace ``model``'s modules by TP ones per ``plan`` on one TP communicator; returns
    ``model`` (changed in place). The arguments, the checks and the errors are
    ``overlap.nn.parallelize``'s, which looks up the plan when none is given and checks that
    ``ep_comm`` is an ``overlap.moe.EPComm``."""
    where = f" (rank {dist.get_rank()})" if dist.is_initialized() else ""
    if verify not in (True, False, "model"):
        raise ValueError(f"parallelize: verify must be True, False or 'model', got "
                         f"{verify!r}{where}")
    if subclasses not in SUBCLASS_MODES:
        raise ValueError(f"parallelize: subclasses must be one of {SUBCLASS_MODES}, got "
                         f"{subclasses!r}{where}")
    if verify_tol is not None and not (isinstance(verify_tol, (int, float))
                                       and not isinstance(verify_tol, bool) and verify_tol > 0):
        raise ValueError(f"parallelize: verify_tol must be a positive number, got "
                         f"{verify_tol!r}{where}")
    if probe is not None:
        user_probe(probe)  # its type, before anything changes
    comm = require_comm("parallelize", comm)
    group = comm.group
    if cp_comm is not None:
        from overlap.cp.hf import check_context_parallel

        check_context_parallel(model, comm=cp_comm)
    if sequence_parallel and not plan.sequence_parallel:
        raise NotImplementedError(
            f"parallelize: plan {plan.name!r} does not support sequence_parallel=True: its "
            "model keeps the residual stream replicated between TP regions (norms would need "
            "sequence-sharded activations). Use sequence_parallel=False.")
    tp, rank = dist.get_world_size(group), dist.get_rank()
    ep, tokens = _check_ep_comm(ep_comm, group, where)
    problems: list[str] = []
    chosen = _plan_matches(model, plan, sequence_parallel, tp, problems, subclasses, ep)
    problems.extend(_unplanned_experts(model, plan, chosen))
    if ep_comm is not None and not any(s.kind == "experts" for s in chosen.values()):
        problems.append(f"ep_comm was given but plan {plan.name!r} shards no experts (no "
                        "module with the style 'experts')")
    divide = _check_divide(model, plan, tp, problems)
    if plan.check is not None:
        problems.extend(plan.check(model, tp))
    ties = _check_ties(model, chosen, problems)
    head = f"parallelize(plan={plan.name!r}, tp={tp}) on rank {rank}"
    if problems:
        listed = "\n  - ".join(problems)
        raise ValueError(f"{head}: {len(problems)} problem(s), nothing was changed:\n  - "
                         f"{listed}")

    if verify:
        check_same_weights(model, group, timeout=comm.timeout)
        if ep_comm is not None:
            check_same_weights(model, ep_comm.group, timeout=ep_comm.timeout)
    # From here every failure, the model's own errors included, restores the model and raises
    # one ValueError on every rank: each stage ends with the ranks agreeing (_agree).
    checker, undo, failure = None, [], None
    try:
        if verify:
            checker = Verifier(model, chosen, divide, tp=tp, comm=comm, ep_comm=ep_comm,
                               probe=probe, whole_model=verify == "model", tol=verify_tol,
                               sequence_parallel=sequence_parallel, head=head)
        _replace(model, chosen, comm, sequence_parallel, subclasses, undo, (ep_comm, tokens))
        _tie(model, ties, undo)
        _divide(model, divide, tp, undo)
    except Exception as exc:
        failure = _failure(model, head, exc, "the verification's pass on the unsharded model"
                           if checker is None and verify else "the replacement", checker)
    _agree(failure, model, undo, comm, ep_comm, head)
    if checker is not None:
        try:  # the parallel model runs whole: the model's own code meets the sharded shapes
            for name in checker.sharded_inputs(model):
                _sum_grads(model.get_submodule(name), comm, undo)
        except Exception as exc:
            failure = _failure(model, head, exc, "the parallel model's probe", checker)
        _agree(failure, model, undo, comm, ep_comm, head)
        try:
            message = checker.run(model)  # the same verdict on every rank
            failure = None if message is None else (message, checker.raised)
        except Exception as exc:
            failure = _failure(model, head, exc, "the verification", checker)
        _agree(failure, model, undo, comm, ep_comm, head)
    if cp_comm is not None:
        from overlap.cp.hf import enable_context_parallel

        try:
            enable_context_parallel(model, comm=cp_comm)
        except Exception as exc:
            failure = _failure(model, head, exc, "enabling context parallelism", None)
        _agree(failure, model, undo, comm, ep_comm, head)
    return model


def _tie(model, ties, undo) -> None:
    for group_members in ties:
        (first, attr), *rest = group_members
        shared = getattr(model.get_submodule(first), attr)
        for mname, pname in rest:
            holder = model.get_submodule(mname)
            undo.append(lambda h=holder, a=pname, v=getattr(holder, pname): setattr(h, a, v))
            setattr(holder, pname, shared)


class _Step(OverlapError):
    """What parallelize was doing when the exception it is raised from happened."""


def _raised_in(model: nn.Module, exc: BaseException) -> str | None:
    """The innermost module of ``model`` whose method was running when ``exc`` was raised."""
    names = {id(m): n for n, m in model.named_modules()}
    found, tb = None, exc.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, nn.Module) and id(obj) in names:
            found = names[id(obj)]
        tb = tb.tb_next
    return found


_FORWARD_CAUSE = ("the model's own code meets this rank's shard of an activation it computes "
                  "over the full width or over every head (a norm across all heads' features, "
                  "as OLMo2's q_norm; per-head position biases, as Bloom's ALiBi; a head count "
                  "the plan does not divide=): shard that module with a custom Style, or leave "
                  "the layers around it unsharded")


def _failure(model, head: str, exc: Exception, stage: str, checker) -> tuple[str, BaseException]:
    """(the error message naming the module and the cause, the original exception)."""
    if isinstance(exc, _Step):
        return (f"{head}: {exc} raised {type(exc.__cause__).__name__}: {exc.__cause__} (the "
                "model was restored unsharded)", exc.__cause__)
    if isinstance(exc, ValueError) and str(exc).startswith(head):  # parallelize's own verdict
        return str(exc), exc.__cause__
    name = _raised_in(model, exc)
    label = "" if name is None else (f"{name or '<model>'} "
                                     f"({type(model.get_submodule(name)).__name__}")
    where = f" in {label})" if label else ""
    cause = ""
    if stage == "the parallel model's probe":
        region, hint = checker.around(model, name) if name is not None else ("", "")
        if region.startswith(f"{name or '<model>'} ("):  # it holds replaced layers itself
            where = f" in {label}, {region.partition(' (')[2]}"
        elif region:
            where += f", inside {region}"
        cause = "; likely cause: " + "; or ".join(h for h in (_FORWARD_CAUSE, hint) if h)
    return (f"{head}: {stage} raised{where}: {type(exc).__name__}: {exc} (the model was "
            f"restored unsharded){cause}", exc)


def _agree(failure, model, undo, comm: TPComm, ep_comm, head: str) -> None:
    """Every rank of the TP group (and of the EP group, which spans TP groups) learns whether
    any failed, restores the model and raises the same ValueError (a failing rank's message)."""
    message, cause = failure if failure is not None else (None, None)
    for c in (comm, ep_comm):
        if c is not None and dist.get_world_size(c.group) > 1:
            message = _first_message(message, c, head)
    if message is None:
        return
    for step in reversed(undo):
        step()
    undo.clear()
    raise ValueError(message) from cause


def _first_message(message: str | None, comm, head: str) -> str | None:
    """``message`` if set, else the first failing rank's of ``comm``'s group (None: none)."""
    data = (message or "").encode()
    device, op = comm.device, "parallelize failure check"
    sizes = all_gather_dim(torch.tensor([len(data)], dtype=torch.int64, device=device), 0,
                           group=comm.group, op=op, timeout=comm.timeout)
    if not sizes.any():
        return None
    first = int(sizes.nonzero()[0, 0])
    buf = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    every = all_gather_dim(buf.to(device).unsqueeze(0), 0, group=comm.group, op=op,
                           timeout=comm.timeout)
    if message is not None:
        return message
    peer = bytes(every[first, :int(sizes[first])].cpu().tolist()).decode()
    rank = dist.get_process_group_ranks(comm.group)[first]
    return f"{head}: refused because rank {rank} failed (restored unsharded here too): {peer}"


def _check_ep_comm(ep_comm, group, where: str) -> tuple[int | None, str]:
    """(EP size, tokens) after checking ``ep_comm``'s group (its type: parallelize): "local"
    when its group meets the TP group in this rank only (each EP rank has its own tokens),
    "split" when it lies inside the TP group (the EP ranks hold the same tokens and split
    them); (None, "local") without one."""
    if ep_comm is None:
        return None, "local"
    tp_ranks = set(dist.get_process_group_ranks(group))
    ep_ranks = set(dist.get_process_group_ranks(ep_comm.group))
    both = tp_ranks & ep_ranks
    if len(both) > 1 and not ep_ranks <= tp_ranks:
        raise ValueError(f"parallelize: the EP group {sorted(ep_ranks)} shares ranks "
                         f"{sorted(both)} with the TP group {sorted(tp_ranks)} without lying "
                         f"inside it{where}: some EP ranks would hold the same tokens and "
                         "others not. Use EP groups from the data-parallel ranks "
                         "(ParallelDims.build(tp=..., ep=...)) or inside the TP group")
    return ep_comm.world, "split" if len(both) > 1 else "local"


def _unplanned_experts(model, plan, chosen) -> list[str]:
    """Experts of a transformers model that no 'experts' or 'replicated' style covers."""
    covered = [n for n, s in chosen.items() if s.kind in ("experts", "replicated")]
    left = [(n, t) for n, t in expert_modules(model)
            if not any(n == c or n.startswith(c + ".") for c in covered)]
    if not left:
        return []
    listed = ", ".join(f"{n} ({t})" for n, t in left[:3])
    more = f" and {len(left) - 3} more" if len(left) > 3 else ""
    return [f"plan {plan.name!r} leaves the experts of {listed}{more} without a style: they "
            "would be replicated on every rank. Shard their sparse blocks over EP with "
            "Style(kind='experts', ...) (shipped: overlap.models.moe_plans) or name them "
            "'replicated' to keep every expert on every rank on purpose"]


def _gathered(model: nn.Module, *, grads: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TPModule) or getattr(module, "ep_sharded", False):
            out.update(module.full_state_dict(f"{name}." if name else "", grads=grads))
    return out


def gather_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (same keys and shapes as before ``parallelize``), on every
    rank. Collective over the TP group(s) of the model's TP modules and the EP group of its
    expert shards."""
    full = _gathered(model, grads=False)
    return {k: full[k] if k in full else v.detach().clone() for k, v in model.state_dict().items()}


def gather_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameter gradients keyed like ``named_parameters()`` of the original model
    (None where a parameter has no gradient). Collective over the TP and EP group(s)."""
    full = _gathered(model, grads=True)
    return {n: full[n] if n in full else (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}
