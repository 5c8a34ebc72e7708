"""Split a stage's backward into an input-gradient pass (I) and a weight-gradient pass (W).

For ``y = f(x; w)`` with upstream gradient ``dy``: I computes only ``dx = dy @ df/dx`` (what the
previous stage waits for); W computes ``dw = dy @ df/dw`` later, to fill pipeline bubbles
(zero-bubble schedules), reusing gradients saved during I instead of redoing its work.

Contract: ``backward_input`` returns ``dx`` and a ``WeightGradState`` and leaves ``param.grad``
alone; ``backward_weight(state)`` accumulates into ``param.grad`` across micro-batches and fires
post-accumulate-grad hooks (a data-parallel reducer) exactly as a plain backward does, counting
a weight used in two places once.

The narrative: docs/design/pp.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGradState", "backward_input", "backward_weight"]


def _grad_node(t: torch.Tensor) -> Node:
    if t.grad_fn is not None:
        return t.grad_fn
    # A leaf's AccumulateGrad node is created lazily; a view exposes (and creates) it.
    return t.view_as(t).grad_fn.next_functions[0][0]


@dataclasses.dataclass(slots=True)
class _Group:
    nodes: list[Node]
    params: list[torch.Tensor]
    grads: list[tuple[torch.Tensor | None, ...] | None]


@dataclasses.dataclass(slots=True)
class WeightGradState:
    """What W needs after I: boundary nodes with their saved gradients, or, when the output
    does not depend on the input at all, the output itself for a plain backward."""

    groups: list[_Group]
    fallback: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _analyse(root: Node, input_node: Node, param_nodes: dict[Node, torch.Tensor]):
    parents: dict[Node, list[Node]] = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)

    def ancestors(starts) -> set[Node]:
        seen = set(n for n in starts if n in parents)
        todo = list(seen)
        while todo:
            for par in parents[todo.pop()]:
                if par not in seen:
                    seen.add(par)
                    todo.append(par)
        return seen

    on_input_path = ancestors([input_node])
    reaches_param = ancestors(param_nodes)
    boundary: dict[Node, set[Node]] = {}
    # Walk in discovery order (fixed by the graph's structure), never in set order (fixed by
    # node addresses): W runs the groups in this order, and a boundary node's backward may
    # issue collectives (the fused TP ops), which every TP rank must issue in the same order.
    for node in (n for n in parents if n in on_input_path):
        for child, _ in node.next_functions:
            if child is None or child in on_input_path or child not in reaches_param:
                continue
            # Everything below a child off the input path is off it too: collect its params.
            found, todo, seen = set(), [child], {child}
            while todo:
                n = todo.pop()
                if n in param_nodes:
                    found.add(n)
                for c, _ in n.next_functions:
                    if c is not None and c not in seen and c in reaches_param:
                        seen.add(c)
                        todo.append(c)
            boundary.setdefault(node, set()).update(found)
    return on_input_path, boundary


def _group(boundary: dict[Node, set[Node]], param_nodes) -> list[_Group]:
    groups: list[tuple[list[Node], set[Node]]] = []
    for node, params in boundary.items():
        merged_nodes, merged_params = [node], set(params)
        keep = []
        for nodes, ps in groups:
            if ps & merged_params:
                merged_nodes += nodes
                merged_params |= ps
            else:
                keep.append((nodes, ps))
        groups = keep + [(merged_nodes, merged_params)]
    order = {p: i for i, p in enumerate(param_nodes)}
    return [_Group(nodes=nodes, params=[param_nodes[p] for p in sorted(ps, key=order.get)],
                   grads=[None] * len(nodes))
            for nodes, ps in groups]


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None,
                   inp: torch.Tensor, params: list[torch.Tensor]
                   ) -> tuple[torch.Tensor, WeightGradState]:
    """I pass: return ``d output / d inp`` (times ``grad_output``) and the state for W.

    ``inp`` must be a leaf that requires grad; ``output`` a tensor (a scalar loss when
    ``grad_output`` is None). ``param.grad`` is not touched.
    """
    params = [p for p in params if p.requires_grad]
    root = output.grad_fn
    if root is None:
        raise ValueError("pp backward_input: the stage output has no autograd graph "
                         "(did the stage run under no_grad?)")
    param_nodes = {_grad_node(p): p for p in params}
    input_node = _grad_node(inp)
    on_input_path, boundary = _analyse(root, input_node, param_nodes)
    if root not in on_input_path:
        # The output ignores the input: its gradient is zero and W is a plain backward.
        return torch.zeros_like(inp), WeightGradState(groups=[], fallback=(output, grad_output))
    groups = _group(boundary, param_nodes)
    handles = []

    def saver(group: _Group, i: int):
        def hook(grad_outputs: tuple[Any, ...]):
            group.grads[i] = tuple(g if g is None else g.detach() for g in grad_outputs)
        return hook

    try:
        for group in groups:
            for i, node in enumerate(group.nodes):
                handles.append(node.register_prehook(saver(group, i)))
        (grad_inp,) = torch.autograd.grad(output, [inp], grad_output, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return grad_inp, WeightGradState(groups=groups)


def backward_weight(state: WeightGradState) -> None:
    """W pass: accumulate every parameter's gradient into ``param.grad``."""
    if state.fallback is not None:
        output, grad_output = state.fallback
        torch.autograd.backward(output, grad_output)
        state.fallback = None
        return
    params, grads = [], []
    for group in state.groups:
        edges, saved_grads = [], []
        for node, saved in zip(group.nodes, group.grads):
            if saved is None:
                raise RuntimeError("pp backward_weight: a boundary node never ran in the I "
                                   "pass (was backward_input called?)")
            for i, g in enumerate(saved):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    saved_grads.append(g)
        if not edges:
            continue
        handles = []
        if len(group.nodes) > 1:
            for node, saved in zip(group.nodes, group.grads):
                handles.append(node.register_prehook(lambda _g, s=saved: s))
        try:
            # retain_graph: several groups may share input-path nodes of one graph.
            got = torch.autograd.grad(edges, group.params, saved_grads, retain_graph=True,
                                      allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for p, g in zip(group.params, got):
            if g is not None:
                params.append(p)
                grads.append(g)
    state.groups = []
    if params:
        # One backward for the whole W (leaves as roots: straight into AccumulateGrad), so a
        # reducer driven by post-accumulate-grad hooks and an end-of-backward callback sees
        # W as one backward, like B: one backward per group would make it finish (reduce
        # every bucket) after the first group, before the other groups' gradients exist.
        torch.autograd.backward(params, grads)
