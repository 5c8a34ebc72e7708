"""bf16 training without the sharded optimizer: fp32 master weights for a plain torch optimizer.

``MasterOptimizer`` steps fp32 masters from the fp32 ``p.main_grad`` of a ``GradReducer`` built
with ``grad_dtype=torch.float32``, then casts them into the bf16 parameters:

    step:  w_master (fp32) = inner_step(w_master, main_grad (fp32))   (no cast of the grad)
           w (bf16)        = cast(w_master)

fp32 parameters are their own masters. ``param_groups`` and ``state`` (fp32, keyed by the
masters) are the inner optimizer's; ``master_of(p)`` maps a parameter to its master.

The narrative: docs/design/training.md.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from overlap.profile.syncs import not_a_device_sync

__all__ = ["MasterOptimizer", "grad_of"]


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient an optimizer must read: the fp32 main grad when the reducer keeps one,
    else ``p.grad``."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


class MasterOptimizer:
    """``optimizer_cls(groups, **kwargs)`` over fp32 masters of the parameters in ``groups``
    (torch's param-group format)."""

    def __init__(self, groups: Sequence[dict], optimizer_cls: type[torch.optim.Optimizer],
                 **optimizer_kwargs: Any) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._master: dict[int, torch.Tensor] = {}
        inner_groups = []
        for g in groups:
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"MasterOptimizer: each group must be a dict with 'params', "
                                f"got {g!r}")
            masters = []
            for p in g["params"]:
                if not p.is_floating_point():
                    raise TypeError(f"MasterOptimizer: parameter of shape {tuple(p.shape)} has "
                                    f"dtype {p.dtype}; expected a floating dtype")
                m = p if p.dtype == torch.float32 else \
                    nn.Parameter(p.detach().to(torch.float32, copy=True))
                self._pairs.append((p, m))
                self._master[id(p)] = m
                masters.append(m)
            inner_groups.append({**g, "params": masters})
        self.inner = optimizer_cls(inner_groups, **optimizer_kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def params(self) -> list[torch.Tensor]:
        """The model parameters these masters stand for, in order."""
        return [p for p, _ in self._pairs]

    @property
    def state(self):
        return self.inner.state

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        return self._master[id(p)]

    @torch.no_grad()
    def step(self) -> None:
        for p, m in self._pairs:
            if m is not p:
                g = grad_of(p)
                # the main grad is already fp32: the master reads it in place
                m.grad = None if g is None else (g if g.dtype == torch.float32 else g.float())
        with not_a_device_sync("torch optimizer step counters live on the host"):
            self.inner.step()
        for p, m in self._pairs:
            if m is not p:
                p.copy_(m)
                m.grad = None  # never alias the reducer's buffer beyond the step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the fp32 parameters' gradients (torch's semantics); the main grads of the
        others restart with the next backward (``GradReducer``), or are zeroed here when
        there is no reducer."""
        self.inner.zero_grad(set_to_none=set_to_none)
        for p, m in self._pairs:
            if m is not p:
                if getattr(p, "main_grad", None) is None and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the parameters into the masters (after loading weights into the model)."""
        for p, m in self._pairs:
            if m is not p:
                m.copy_(p)

    @torch.no_grad()
    def publish_masters(self) -> None:
        """Cast the masters into the parameters (after loading masters from a checkpoint)."""
        for p, m in self._pairs:
            if m is not p:
                p.copy_(m)
