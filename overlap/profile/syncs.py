"""Count host-device synchronisations: the runtime's own counter, which tests keep at 0 in
steady state.

Counted, on CPU tensors too: ``Tensor.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``bool(t)``, ``int(t)``, ``float(t)``, ``t.__index__``, and explicit stream or event
synchronisation (reported through :func:`record`). Only the calling thread is counted (torch
function modes are per thread). Use::

    with count_host_syncs() as syncs:
        y = all_gather_matmul(x, w, comm=comm)
    assert syncs.count == 0, syncs.where

The narrative: docs/design/profiling.md.
"""

from __future__ import annotations

import threading
import traceback

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["count_host_syncs", "HostSyncCounter", "record", "not_a_device_sync"]

_SYNC_METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
                 torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                 torch.Tensor.__index__}
_active = threading.local()


class HostSyncCounter(TorchFunctionMode):
    """``count``: host syncs seen; ``where``: (what, innermost overlap frame) of each."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.where: list[tuple[str, str]] = []

    def _note(self, what: str) -> None:
        self.count += 1
        frames = [f for f in traceback.extract_stack()[:-2] if "/overlap/" in f.filename
                  and not f.filename.endswith("syncs.py")]
        at = f"{frames[-1].filename.rsplit('/overlap/', 1)[-1]}:{frames[-1].lineno}" if frames \
            else "?"
        self.where.append((what, at))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_METHODS and not getattr(_active, "exempt", 0):
            self._note(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "HostSyncCounter":
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        _active.stack.pop()
        return super().__exit__(*exc)


def count_host_syncs() -> HostSyncCounter:
    """A context manager counting the host syncs made by this thread inside it."""
    return HostSyncCounter()


def record(what: str) -> None:
    """Count an explicit synchronisation (a stream or event synchronize) in every active
    counter of this thread."""
    for counter in getattr(_active, "stack", None) or ():
        counter._note(what)


class not_a_device_sync:
    """Stop counting inside this block, for host reads of tensors that stay on the host on a
    GPU too (say why at the call site: the exemption must be as true there as here)."""

    def __init__(self, why: str):
        self.why = why

    def __enter__(self) -> None:
        _active.exempt = getattr(_active, "exempt", 0) + 1

    def __exit__(self, *exc) -> None:
        _active.exempt -= 1
