"""The data of a tensor-parallel plan: ``Style`` (how one module is parallelized), the named
``STYLES``, and ``TPPlan`` (module-name patterns -> styles). Plans for specific models live next
to the models (``overlap.models.plans``); ``overlap.nn.parallelize`` applies them."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch.nn as nn

__all__ = ["Style", "STYLES", "TPPlan"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Style:
    """How one module is parallelized. ``kind``: column, row, embedding, sp_norm,
    sp_positions, or custom (``build(module, comm=, sequence_parallel=) -> module``, a
    model-specific replacement of a module whose exact type is in ``accepts``). ``uneven``:
    the sharded size need not be divisible by tp (vocabularies). ``sp_only``: applied only
    with sequence_parallel=True."""

    kind: str
    parts: int = 1
    gather_output: bool = False
    uneven: bool = False
    sp_only: bool = False
    build: Callable[..., nn.Module] | None = None
    accepts: tuple[type, ...] = ()  # custom: the exact module types ``build`` takes


STYLES: dict[str, Style] = {
    "column": Style(kind="column"),
    "qkv": Style(kind="column", parts=3),
    "row": Style(kind="row"),
    "embedding": Style(kind="embedding", uneven=True),
    "vocab_head": Style(kind="column", uneven=True),
    "head": Style(kind="column", uneven=True, gather_output=True),
    "sp_norm": Style(kind="sp_norm", sp_only=True),
    "sp_positions": Style(kind="sp_positions", sp_only=True),
}


@dataclasses.dataclass(kw_only=True, slots=True)
class TPPlan:
    """``layers``: pattern -> style; ``divide``: pattern -> attribute names divided by tp;
    ``check(model, tp) -> [problems]``: arch-specific checks; ``sequence_parallel``: whether
    the plan keeps the whole residual stream sequence-sharded (else SP is refused)."""

    name: str
    layers: dict[str, str | Style]
    divide: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    check: Callable[[nn.Module, int], list[str]] | None = None
    sequence_parallel: bool = False
