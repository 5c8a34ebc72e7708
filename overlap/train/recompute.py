"""Activation recomputation for the main job (Korthikanti et al., 2022).

- ``selective``: the attention core of every block (scores, softmax, dropout, weighted sum of
  v: ``CausalSelfAttention.core``) keeps only its inputs q, k, v; the backward recomputes it.
  Its saved activations grow with s^2 (the ``5as/h`` term), the rest with s, so this drops the
  largest term at the cost of a few percent of the FLOPs.
- ``full``: every transformer block keeps only its input; the backward reruns the whole block
  (including its TP collectives, in the same order on every TP rank).

Both use ``torch.utils.checkpoint`` (non-reentrant), which works with autograd hooks (the DP
reducer's), with ``torch.autograd.grad`` (the zero-bubble schedule's split backward: the weight
pass recomputes again) and restores the default generator for dropout; the TP-sharded
generator is restored through ``RNGTracker.recompute_context``. The wrappers are instance
attributes, so the parameters and module names do not change (checkpoints are unaffected).
"""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_recompute", "RECOMPUTE_MODES"]

RECOMPUTE_MODES = ("none", "selective", "full")


def _checkpointed(fn, tracker):
    kwargs = {"use_reentrant": False}
    if tracker is not None:
        kwargs["context_fn"] = tracker.recompute_context

    @functools.wraps(fn)
    def run(*args):
        return checkpoint(fn, *args, **kwargs)
    return run


def apply_recompute(model: nn.Module, mode: str, *, tracker=None) -> int:
    """Wrap ``model``'s blocks (full) or attention cores (selective); returns how many."""
    from overlap.models.gpt import Block, CausalSelfAttention

    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"apply_recompute: mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
    n = 0
    for module in model.modules():
        if mode == "full" and isinstance(module, Block):
            module.forward = _checkpointed(module.forward, tracker)
            n += 1
        elif mode == "selective" and isinstance(module, CausalSelfAttention):
            module.core = _checkpointed(module.core, tracker)
            n += 1
    return n
