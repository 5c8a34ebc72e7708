"""Dropout randomness under tensor parallelism: one generator per kind of region.

Replicated regions (the same tensor on every TP rank) draw the *same* mask on every TP rank from
torch's default generator; TP-sharded regions (a different slice per TP rank) run inside
``tracker.fork()`` and draw an *independent* mask per rank from a second generator seeded with
``+ 2718 + tp_rank``.

Contract: ``state()`` / ``load_state()`` carry both generators through a checkpoint (a resumed
run draws the masks of the uninterrupted one); ``recompute_context()`` gives the context
managers for ``torch.utils.checkpoint(context_fn=...)`` that replay the forward's masks.

The narrative: docs/design/training.md.
"""

from __future__ import annotations

import contextlib
import io
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["RNGTracker", "TrackedDropout", "install_dropout"]

_TP_OFFSET = 2718


class RNGTracker:
    def __init__(self, *, seed: int, tp_rank: int, pp_rank: int, dp_rank: int):
        base = seed * 1_000_003 + 7919 * pp_rank + 104_729 * dp_rank + 1
        torch.manual_seed(base)  # replicated regions: same on every TP rank
        self.tp_state = torch.Generator().manual_seed(base + _TP_OFFSET + tp_rank).get_state()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on this TP rank's own generator (TP-sharded regions)."""
        outer = torch.get_rng_state()
        torch.set_rng_state(self.tp_state)
        try:
            yield
        finally:
            self.tp_state = torch.get_rng_state()
            torch.set_rng_state(outer)

    def recompute_context(self):
        """``context_fn`` for ``torch.utils.checkpoint``: every recomputation (the zero-bubble
        weight pass recomputes a second time) starts from the forked generator state the
        forward started from, and leaves the live state alone."""
        start = _Start(self)
        return start, _Replay(self, start)

    def state(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"default": torch.get_rng_state(), "tp": self.tp_state}, buf)
        return buf.getvalue()

    def load_state(self, blob: bytes) -> None:
        st = torch.load(io.BytesIO(blob), weights_only=True)
        torch.set_rng_state(st["default"])
        self.tp_state = st["tp"]


class _Start:
    """Forward context: remember the forked generator state at the start (re-enterable)."""

    def __init__(self, tracker: RNGTracker):
        self.tracker, self.state = tracker, None

    def __enter__(self):
        self.state = self.tracker.tp_state.clone()

    def __exit__(self, *exc):
        return False


class _Replay:
    """Recompute context: run on the remembered state, then restore the live one."""

    def __init__(self, tracker: RNGTracker, start: _Start):
        self.tracker, self.start, self.live = tracker, start, []

    def __enter__(self):
        self.live.append(self.tracker.tp_state)
        self.tracker.tp_state = self.start.state.clone()

    def __exit__(self, *exc):
        self.tracker.tp_state = self.live.pop()
        return False


class TrackedDropout(nn.Module):
    """``nn.Dropout`` that draws from the TP rank's own generator when ``sharded``."""

    def __init__(self, p: float, tracker: RNGTracker, *, sharded: bool):
        super().__init__()
        self.p, self.tracker, self.sharded = p, tracker, sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.sharded:
            with self.tracker.fork():
                return F.dropout(x, self.p, True)
        return F.dropout(x, self.p, True)

    def extra_repr(self) -> str:
        return f"p={self.p}, {'tp-sharded' if self.sharded else 'replicated'} generator"


def install_dropout(model: nn.Module, tracker: RNGTracker, *, sequence_parallel: bool) -> None:
    """Route every dropout of an (overlap) GPT through ``tracker``: the attention core always
    forks (heads are sharded); the residual and embedding dropouts fork only with sequence
    parallelism (their activations are sequence shards), else they use the replicated
    generator."""
    from overlap.models.gpt import CausalSelfAttention

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                setattr(module, child_name, TrackedDropout(child.p, tracker,
                                                           sharded=sequence_parallel))
        if isinstance(module, CausalSelfAttention):
            core = module.core

            def forked_core(q, k, v, _core=core):
                with tracker.fork():
                    return _core(q, k, v)
            module.core = forked_core
