"""Subclass safety: a matched module whose type overrides ``forward`` keeps its own behaviour.

Contract: a subclass of ``nn.Linear`` / ``nn.Embedding`` / HF ``Conv1D`` with its own ``forward``
is *wrapped*, not swapped: its replacement is an instance of a class ``Parallel<Original>``
built here (MRO: Original, TPLayer, ..., Base), so ``Original.forward`` still runs and its
``super().forward(...)`` reaches the TP layer's forward. The wrapped module keeps the
original's extra attributes, buffers and submodules, and is a ``TPModule``. A forward that does
not go through ``super().forward`` cannot be rescued this way; ``parallelize``'s verification
catches it ("module has its own forward"). ``subclasses="refuse"`` refuses such modules up
front instead, ``subclasses="replace"`` swaps in the plain TP layer (verification still runs).
The narrative: docs/design/nn.md.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["base_of", "overridden", "wrap_subclass", "SUBCLASS_MODES"]

SUBCLASS_MODES = ("wrap", "refuse", "replace")
_classes: dict[tuple[type, type], type] = {}


def base_of(module: nn.Module) -> type | None:
    """The leaf type a style replaces (nn.Linear, nn.Embedding or transformers Conv1D)."""
    for cls in type(module).__mro__:
        if cls in (nn.Linear, nn.Embedding) or (cls.__name__ == "Conv1D"
                                                  and "transformers" in cls.__module__):
            return cls
    return None


def overridden(module: nn.Module) -> list[str]:
    """Methods the style replaces that ``type(module)`` defines differently from its base."""
    base = base_of(module)
    if base is None or type(module) is base:
        return []
    return [m for m in ("forward",) if getattr(type(module), m) is not getattr(base, m)]


def _wrapper_class(original: type, parallel: type, base: type) -> type:
    key = (original, parallel)
    if key not in _classes:
        shim = type(f"{parallel.__name__}As{base.__name__}", (parallel, base),
                    {"__module__": __name__})
        _classes[key] = type(f"Parallel{original.__name__}", (original, shim),
                             {"__module__": __name__})
    return _classes[key]


def wrap_subclass(old: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` (a TP layer built from ``old``) as an instance of a class whose MRO puts
    ``type(old)`` first, so its forward runs on top of the TP layer's."""
    base = base_of(old)
    try:
        cls = _wrapper_class(type(old), type(new), base)
    except TypeError as exc:  # an MRO that cannot be linearized
        raise TypeError(f"cannot wrap {type(old).__name__} around {type(new).__name__}: "
                        f"{exc}") from None
    obj = cls.__new__(cls)
    state = dict(new.__dict__)
    for key, value in old.__dict__.items():
        if not key.startswith("_") and key not in state:
            state[key] = value
    state["_parameters"] = {**{k: v for k, v in old._parameters.items()
                               if k not in ("weight", "bias")}, **new._parameters}
    state["_buffers"] = {**old._buffers, **new._buffers}
    state["_non_persistent_buffers_set"] = (set(old._non_persistent_buffers_set)
                                            | set(new._non_persistent_buffers_set))
    state["_modules"] = {**old._modules, **new._modules}
    state["training"] = old.training
    obj.__dict__.update(state)
    return obj
