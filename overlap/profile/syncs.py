"""Count host-device synchronisations: the runtime's own counter, which tests keep at 0 in
steady state.

On a GPU every one of these stalls the host until the device catches up, so the host cannot
queue the next GEMM and the overlap is lost: ``Tensor.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, and the implicit ones (``bool(t)``, ``int(t)``, ``float(t)``, ``t.__index__``),
plus explicit stream or event synchronisation (counted by ``overlap.dist.streams`` through
:func:`record`). The CPU twin counts them on CPU tensors too, where they cost nothing: a twin
must be as strict as the GPU, so an op that would sync there shows a non-zero count here.

    with count_host_syncs() as syncs:
        y = all_gather_matmul(x, w, comm=comm)
    assert syncs.count == 0, syncs.where

Counting covers the calling thread (torch function modes are per thread); work that the
runtime runs on its own threads (copy threads, stream twins) does not block the host.
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
