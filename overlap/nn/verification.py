"""The verification pass of ``parallelize`` (the probes themselves are in overlap.nn.probes):
what is recorded before the modules are replaced, what is compared after, and the error
message with its likely cause when something differs."""

from __future__ import annotations

import inspect
import re

import torch
import torch.nn as nn

from overlap.nn.layers import TPModule, linear_weight
from overlap.nn.probes import (HEAD_ATTR, GradProbe, LeafProbe, UnitProbe, _within, all_max,
                               default_probe, user_probe)
from overlap.nn.tp_plan import Style
from overlap.nn.wrap import base_of, overridden

__all__ = ["Verifier", "default_tol"]


def default_tol(model: nn.Module) -> float:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return 3e-2 if p is not None and p.element_size() < 4 else 1e-4


class _EvalMode:
    """Eval mode for the probe (no dropout); every module's own flag restored after."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.flags = [(m, m.training) for m in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc):
        for m, flag in self.flags:
            m.training = flag


def _read_in_forward(module: nn.Module) -> dict[str, set[str]] | None:
    """Attribute names ``forward`` reads as ``self.<name>`` and ``self.config.<name>`` (None
    when its source is not available)."""
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    return {"self": set(re.findall(r"self\.(\w+)", src)),
            "config": set(re.findall(r"self\.config\.(\w+)", src))}


def _shard_spec(model: nn.Module, name: str):
    """The ShardSpec of parameter ``name`` if a TP layer holds it sharded, else None."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return module.shard_specs.get(attr) if isinstance(module, TPModule) else None


# Why a probe that cannot run is an error, never a skipped check.
_NEEDED = (". Every check runs on it, and the whole-model pass finds the replicated modules that "
           "run on TP-sharded activations (per-head norms; norms and routers under sequence "
           "parallelism), whose gradients must be summed over TP: without it they would train "
           "on partial gradients. verify=False skips every check (then name such modules "
           "'sum_grads' in the plan)")


def _probe_failed(head: str, probe, exc: Exception) -> ValueError:
    if probe is not None:
        given, fix = "probe=", "fix probe= so that the model runs on it"
    else:
        given = ("the default probe (token ids of shape (2, T), or features for a model whose "
                 "first layer is an nn.Linear)")
        fix = ("pass probe=, the model's input: a tensor, a tuple of args, a dict of kwargs or "
               "a callable model -> output")
    return ValueError(f"{head}: the verification probe failed on the unsharded model ({fix}): "
                      f"{given} raised {type(exc).__name__}: {exc}{_NEEDED}")


class Verifier:
    """Built on the unsharded model (records references), run on the parallel one."""

    def __init__(self, model: nn.Module, chosen: dict[str, Style], divide, *, tp: int, comm,
                 probe, whole_model: bool, tol: float | None, sequence_parallel: bool,
                 head: str, ep_comm=None):
        self.chosen, self.tp, self.comm, self.head = chosen, tp, comm, head
        self.ep_comm = ep_comm
        self.divided = set(divide)
        self.tol = default_tol(model) if tol is None else float(tol)
        self.info: dict[str, dict] = {}
        self.leaves: dict[str, LeafProbe] = {}
        with _EvalMode(model):
            for name, style in chosen.items():
                module = model.get_submodule(name)
                info = {"type": type(module).__name__, "overrides": overridden(module),
                        "base": getattr(base_of(module), "__name__", None)}
                if style.kind in ("column", "row"):
                    w, _, transposed = linear_weight(module)
                    info["out"], info["in"] = (w.shape[1], w.shape[0]) if transposed else w.shape
                self.info[name] = info
                if style.kind in ("column", "row", "embedding"):
                    self.leaves[name] = LeafProbe(name, module, style.kind, tp)
            # Region inputs are sequence shards under sequence parallelism: there only the
            # whole model (verify="model") is compared, besides every layer.
            # A region's parent: where a column/row pair (or a custom module) meets. Parents
            # of only embeddings and vocabulary heads are covered by the layer checks (their
            # outputs are complete on every rank), which spares re-running a decoder stack.
            regional = {n for n, s in chosen.items()
                        if s.kind in ("row", "custom") or (s.kind == "column" and not s.uneven
                                                           and not s.gather_output)}
            units = set() if sequence_parallel else {n.rpartition(".")[0] for n in regional}
            # a mixture-of-experts block is a region of its own (routing, dispatch, experts)
            units |= set() if sequence_parallel else {n for n, s in chosen.items()
                                                       if s.kind == "experts"}
            # The root is the whole model: compared with verify="model", or when a region
            # (a row layer) closes directly under it, as in a bare nn.Sequential.
            root_region = any("." not in n and s.kind == "row" for n, s in chosen.items())
            if not (whole_model or (root_region and not sequence_parallel)):
                units.discard("")
            if whole_model:
                units.add("")
            run = user_probe(probe) if probe is not None else default_probe(model, tp)
            if run is None:
                raise ValueError(
                    f"{head}: verification needs probe= (the model's input: a tensor, a tuple "
                    f"of args, a dict of kwargs or a callable model -> output): "
                    f"{type(model).__name__} takes neither token ids (no config.vocab_size or "
                    f"nn.Embedding) nor features (its first layer is no nn.Linear){_NEEDED}")
            # The whole model once more: every parameter's gradient and which modules see which
            # input shapes (replicated modules on sharded activations)
            try:
                self.grads = GradProbe(model, run, skip=set(chosen))
            except Exception as exc:
                raise _probe_failed(head, probe, exc) from exc
            self.units, self.unit_names = None, sorted(units)
            if self.unit_names:
                try:
                    self.units = UnitProbe(model, self.unit_names, run)
                except Exception as exc:
                    raise _probe_failed(head, probe, exc) from exc
                self.unit_names = [n for n in self.unit_names if n in self.units.records]
        self.raised: Exception | None = None  # the first error a check raised (run)

    # ------------------------------------------------------------------ run
    def sharded_inputs(self, model: nn.Module) -> list[str]:
        """Modules outside the replaced ones, with parameters of their own, that now run on
        TP-sharded activations (their inputs changed shape on the probe). Same on every rank
        (the shapes follow from the plan, not from the data)."""
        with _EvalMode(model):
            return self.grads.sharded_inputs(model)

    def run(self, model: nn.Module) -> str | None:
        """None if the parallel model matches, else the error message (same on every rank)."""
        labels: list[tuple[str, str]] = []
        errors: list[float] = []
        notes: dict[str, str] = {}
        rank, tp = self.comm.rank, self.tp
        with _EvalMode(model):
            for name, probe in self.leaves.items():
                labels.append(("layer", name))
                try:
                    errors.append(max(probe.errors(model.get_submodule(name))))
                except Exception as exc:
                    errors.append(float("inf"))
                    notes[name] = f"{type(exc).__name__}: {exc}"
                    self.raised = self.raised or exc
            for name in self.unit_names:
                labels.append(("module", name))
                try:
                    errors.append(max(self.units.errors(name, model.get_submodule(name), rank,
                                                        tp)))
                except Exception as exc:
                    errors.append(float("inf"))
                    notes[name] = f"{type(exc).__name__}: {exc}"
                    self.raised = self.raised or exc
            try:
                grads = self._grad_errors(model, rank, tp)
            except Exception as exc:
                grads = {"<output>": float("inf")}
                notes["<output>"] = f"{type(exc).__name__}: {exc}"
                self.raised = self.raised or exc
            # the same list on every rank: every name of the reference, in its order
            for name in ["<output>", *self.grads.grads]:
                labels.append(("grad", name))
                errors.append(grads.get(name, 0.0))
        device = self.comm.device  # NCCL takes device tensors only
        errors = all_max(errors, self.comm.group, timeout=self.comm.timeout, device=device)
        if self.ep_comm is not None:  # the EP group spans TP groups: all decide alike
            errors = all_max(errors, self.ep_comm.group, timeout=self.ep_comm.timeout,
                             device=device)
        failing = {name: err for (kind, name), err in zip(labels, errors)
                   if kind != "grad" and not err <= self.tol}
        bad_grads = {name: err for (kind, name), err in zip(labels, errors)
                     if kind == "grad" and not err <= self.tol}
        if not failing and not bad_grads:
            return None
        if failing:
            return self._report(model, failing, notes)
        return self._report_grads(model, bad_grads, notes)

    def _grad_errors(self, model: nn.Module, rank: int, tp: int) -> dict[str, float]:
        """Every parameter's gradient error (GradProbe's), with the experts sharded over EP
        compared here: rank r of ep holds experts [r*El, (r+1)*El) of the reference; as every
        EP rank ran the same probe, each expert saw every token once per rank that sent it
        (``sources``: ep when the EP ranks hold their own tokens, 1 when they split them)."""
        shards = {f"{m_name}.{p_name}" if m_name else p_name: (p, m)
                  for m_name, m in model.named_modules() if getattr(m, "ep_sharded", False)
                  for p_name, p in m.named_parameters(recurse=False)}
        order = list(self.grads.grads)
        want = {n: self.grads.grads.pop(n) for n in shards if n in self.grads.grads}
        got: dict[str, torch.Tensor] = {}
        hooks = [p.register_hook(lambda g, n=n: got.__setitem__(n, g.detach()))
                 for n, (p, _) in shards.items() if n in want]
        try:
            out = self.grads.errors(model, rank, tp, lambda n: _shard_spec(model, n))
        finally:
            for h in hooks:
                h.remove()
            popped, self.grads.grads = self.grads.grads, {}
            for n in order:
                self.grads.grads[n] = want[n] if n in want else popped[n]
        floor = max(1e-2 * self.grads.largest, 1e-30)
        for n, ref in want.items():
            p, m = shards[n]
            if ref is None or n not in got:
                nonzero = ref is not None and ref.abs().max() > 0 or n in got
                out[n] = float("inf") if nonzero else 0.0
                continue
            sources = m.sources
            local = ref[m.first:m.first + m.num_local] * sources
            scale = max(ref.abs().max().item() * sources, floor)
            g = got[n]
            err = (float("inf") if g.shape != local.shape
                   else (g.double() - local.double()).abs().max().item() / scale)
            out[n] = err if err == err else float("inf")
        return out

    def _report_grads(self, model: nn.Module, bad: dict[str, float], notes) -> str:
        if "<output>" in bad:
            why = notes.get("<output>", "its output could not be matched with the unsharded "
                            "model's (not one shard of it along one dim)")
            return (f"{self.head}: verification failed: the parameter gradients could not be "
                    f"compared on the probe: {why}. Pass probe= (the model's input), or check "
                    "the plan (the model was restored unsharded)")
        lines = []
        for name, err in bad.items():
            sharded = _shard_spec(model, name) is not None
            owner = name.rpartition(".")[0]
            unit = next((u for u in sorted(self.unit_names, key=len, reverse=True)
                         if _within(owner, u)), None)
            where = f" in {unit or '<model>'}" if unit is not None else ""
            if sharded:
                cause = ("its TP layer computes a different weight gradient (a fused layout "
                         "or a style that does not match how the module uses it)")
            else:
                cause = ("a replicated parameter used on activations sharded over TP (heads "
                         "or features) inside its module's own forward, so each rank's "
                         "gradient is a partial sum: move that use into a submodule (which "
                         "parallelize then sums over TP), mark it with the style 'sum_grads', "
                         "or shard the parameter with a custom Style")
            lines.append(f"gradient of {name} ({'sharded' if sharded else 'replicated'}"
                         f"{where}) off by {err:.3g} (relative; tolerance {self.tol:g}); "
                         f"likely cause: {cause}")
        listed = "\n  - ".join(lines)
        return (f"{self.head}: verification failed, the parallel model's parameter gradients "
                f"differ from the unsharded model's (outputs and input gradients match; the "
                f"model was restored unsharded):\n  - {listed}")

    def _report(self, model: nn.Module, failing: dict[str, float], notes) -> str:
        # Report where it happens: a failing module that contains another failing one (a
        # layer or a smaller region) is left out.
        deepest = [n for n in failing
                   if not any(m != n and _within(m, n) for m in failing)]
        lines = []
        for name in deepest:
            err = failing[name]
            what = self._describe(name)
            amount = ("it raised " + notes[name]) if name in notes else (
                f"output or input gradient off by {err:.3g} (relative; tolerance "
                f"{self.tol:g})")
            lines.append(f"{what}: {amount}; likely cause: {self._cause(model, name)}")
        listed = "\n  - ".join(lines)
        return (f"{self.head}: verification failed, the parallel model does not compute what "
                f"the unsharded one does (the model was restored unsharded):\n  - {listed}")

    def _undivided(self, holder: str, attr: str, value) -> bool:
        return (isinstance(value, int) and not isinstance(value, bool) and value >= self.tp
                and value % self.tp == 0 and (holder, attr) not in self.divided)

    # ------------------------------------------------------------------ messages
    def _describe(self, name: str) -> str:
        if name in self.chosen:
            return (f"{name} ({self.info[name]['type']}, style "
                    f"{self.chosen[name].describe()!r})")
        inside = [f"{n.rpartition('.')[2] if name else n}: {self.chosen[n].describe()}"
                  for n in self.chosen if n != name and _within(n, name)]
        return f"{name or '<model>'} (containing {', '.join(inside)})"

    def around(self, model: nn.Module, name: str) -> tuple[str, str]:
        """For a module that raised: (the smallest module around ``name`` holding replaced
        layers, described with their styles; the specific likely causes there), '' if none."""
        units = [u for u in {n.rpartition(".")[0] for n in self.chosen}
                 if _within(name, u) or _within(u, name)]
        if not units:
            return "", ""
        unit = max(units, key=len)
        return self._describe(unit), self._cause(model, unit, raised=True)

    def _cause(self, model: nn.Module, name: str, raised: bool = False) -> str:
        """Likely causes of a mismatch in ``name``; ``raised``: of an error raised there (the
        ones that make a forward raise: no fused layouts, no generic fallback)."""
        hints = []
        inside = {n: s for n, s in self.chosen.items() if _within(n, name)}
        for n, s in inside.items():
            if s.kind == "experts":
                hints.append(f"the expert-parallel block that replaced {n} "
                             f"({self.info[n]['type']}) routes or computes its experts "
                             "differently from the model's own block (its family's routing: "
                             "scores, top-k, renormalisation, scaling; or the experts' "
                             "activation and layout)")
        for n in inside:
            info = self.info[n]
            if info["overrides"]:
                hints.append(f"module has its own forward: {n} is a {info['type']} whose "
                             f"forward differs from {info['base']}.forward, and the TP layer "
                             "does not reproduce it (give it a custom Style, or make its "
                             "forward call super().forward)")
        own = len(hints)
        undivided = []
        module = model.get_submodule(name)
        holders = [(name, module)] + [
            (f"{name}.{c}" if name else c, m) for c, m in module.named_children()
            if (f"{name}.{c}" if name else c) not in self.chosen]
        for hname, holder in holders:
            read = _read_in_forward(holder)
            for attr, value in vars(holder).items():
                if (HEAD_ATTR.search(attr) and self._undivided(hname, attr, value)
                        and (read is None or attr in read["self"])):
                    undivided.append(f"{hname}.{attr}={value}")
            config = getattr(holder, "config", None)
            for attr in (read or {}).get("config", ()):
                value = getattr(config, attr, None)
                if HEAD_ATTR.search(attr) and self._undivided(hname, f"config.{attr}", value):
                    undivided.append(f"{hname}.config.{attr}={value}")
        if undivided and any(s.kind == "column" for s in inside.values()):
            hints.append(f"head count attribute not divided: {', '.join(undivided)} (unsharded "
                         "counts that the forward reads); add them to the plan's divide= "
                         "(e.g. divide={'<pattern>': ('num_heads',)}, or "
                         "'config.num_attention_heads' for a count read from the config)")
        heads_hint = len(hints) > own
        rows = [n for n, s in inside.items() if s.kind == "row"]
        for n, s in inside.items():
            if raised or s.kind != "column" or s.gather_output or s.uneven or not rows:
                continue
            out_f = self.info[n]["out"]
            ins = [self.info[r]["in"] for r in rows]
            if out_f in ins:
                continue
            if s.num_parts() > 1 or s.layout == "per_head":
                if heads_hint:  # the parts were given; the counts are the likelier culprit
                    continue
                hints.append(f"fused layout: {n} was sharded as {s.describe()}, but its "
                             f"output is split differently; if q, k, v are interleaved per "
                             "head use Style(kind='column', layout='per_head', heads=<heads>), "
                             "if the parts differ in size use parts=(q, k, v)")
                continue
            k = next((out_f // i for i in ins if i and out_f % i == 0), None)
            if k is not None:
                hints.append(f"fused layout: {n} has {out_f} outputs but {rows[0]} takes "
                             f"{ins[0]}: its output holds {k} fused parts; use parts={k} "
                             "('gate_up' for [gate; up], 'qkv' for [q; k; v]), parts=(...) "
                             "for parts of unequal size, or layout='per_head' for heads "
                             "interleaved")
            else:
                hints.append(f"fused layout: {n} has {out_f} outputs but {rows[0]} takes "
                             f"{ins[0]}: its output holds fused parts of unequal size (e.g. "
                             "grouped-query [q | k | v]); use parts=(q, k, v) in features, or "
                             "in heads with head_dim=")
        if not hints and not raised:
            hints.append("the parallel layers compute a different function here; check the "
                         "styles of the layers inside and any attribute the module reads from "
                         "its config")
        return "; or ".join(hints)

