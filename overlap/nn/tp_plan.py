"""The data of a tensor-parallel plan: ``Style`` (how one module is parallelized), the named
``STYLES``, and ``TPPlan`` (module-name patterns -> styles). Plans for specific models live next
to the models (``overlap.models.tp_plans``); ``overlap.nn.parallelize`` applies them."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch.nn as nn

__all__ = ["Style", "STYLES", "TPPlan"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Style:
    """How one module is parallelized. ``kind``: column, row, embedding, sp_norm,
    sp_positions, sum_grads (a replicated module that runs on TP-sharded activations, e.g. a
    per-head norm: kept as it is, its parameters' gradients summed over TP), custom (``build(module, comm=, sequence_parallel=) -> module``, a
    model-specific replacement of a module whose exact type is in ``accepts``), experts
    (``build(module, ep_comm=, tokens=) -> module``: a mixture-of-experts block of a type in
    ``accepts`` whose experts shard over parallelize's ``ep_comm``) or replicated (left as
    it is on purpose: experts kept whole on every rank). ``uneven``:
    the sharded size need not be divisible by tp (vocabularies). ``sp_only``: applied only
    with sequence_parallel=True.

    Fused column outputs (``kind="column"``), as data:

    - ``layout="blocks"`` (default): the output is blocks laid end to end, each sharded over
      tp separately. ``parts``: an int (that many equal blocks: "qkv" is 3, "gate_up" is 2) or
      a tuple of block sizes in features, e.g. Phi-3's GQA ``qkv_proj``
      ``parts=(H*d, KV*d, KV*d)``; with ``head_dim=d`` the tuple counts heads instead,
      ``parts=(H, KV, KV)``, and each count must be divisible by tp (whole heads per rank).
    - ``layout="per_head"``: the output is ``heads`` equal groups, each holding every part of
      one head interleaved (GPT-NeoX / Bloom ``query_key_value``: ``[h0: q k v | h1: q k v |
      ...]``; with grouped-query attention, one group per kv head). Each rank keeps
      ``heads / tp`` whole groups, so ``heads`` must be divisible by tp. Without ``heads`` the
      output is cut into tp contiguous pieces (``parts`` per head only checks the size) and
      verification catches a cut through a head.
    """

    kind: str
    parts: int | tuple[int, ...] = 1
    layout: str = "blocks"
    heads: int | None = None
    head_dim: int | None = None
    gather_output: bool = False
    uneven: bool = False
    sp_only: bool = False
    build: Callable[..., nn.Module] | None = None
    accepts: tuple[type, ...] = ()  # custom: the exact module types ``build`` takes

    def __post_init__(self) -> None:
        if isinstance(self.parts, list):  # a list reads naturally in a plan; keep it hashable
            object.__setattr__(self, "parts", tuple(self.parts))

    def feature_parts(self) -> int | tuple[int, ...]:
        """The layer's ``parts`` in features (what ColumnParallelLinear takes)."""
        if self.layout == "per_head":
            return 1
        if isinstance(self.parts, tuple) and self.head_dim is not None:
            return tuple(h * self.head_dim for h in self.parts)
        return self.parts

    def num_parts(self) -> int:
        return len(self.parts) if isinstance(self.parts, tuple) else self.parts

    def describe(self) -> str:
        if self.layout == "per_head":
            return f"{self.kind}(layout='per_head', heads={self.heads})"
        if self.num_parts() > 1:
            unit = f", head_dim={self.head_dim}" if self.head_dim else ""
            return f"{self.kind}(parts={self.parts}{unit})"
        return self.kind


STYLES: dict[str, Style] = {
    "column": Style(kind="column"),
    "qkv": Style(kind="column", parts=3),
    "gate_up": Style(kind="column", parts=2),
    "row": Style(kind="row"),
    "embedding": Style(kind="embedding", uneven=True),
    "vocab_head": Style(kind="column", uneven=True),
    "head": Style(kind="column", uneven=True, gather_output=True),
    "sp_norm": Style(kind="sp_norm", sp_only=True),
    "sp_positions": Style(kind="sp_positions", sp_only=True),
    "sum_grads": Style(kind="sum_grads"),
    "replicated": Style(kind="replicated"),
}


@dataclasses.dataclass(kw_only=True, slots=True)
class TPPlan:
    """``layers``: pattern -> style; ``divide``: pattern -> attribute names divided by tp
    (``"config.num_attention_heads"``: the module gets its own copy of ``config`` with that
    attribute divided, so other modules sharing the config are unaffected);
    ``check(model, tp) -> [problems]``: arch-specific checks; ``sequence_parallel``: whether
    the plan keeps the whole residual stream sequence-sharded (else SP is refused)."""

    name: str
    layers: dict[str, str | Style]
    divide: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    check: Callable[[nn.Module, int], list[str]] | None = None
    sequence_parallel: bool = False
