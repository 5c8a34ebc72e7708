"""The copier of the symmetric backend: where peer copies run while the GEMM runs.

A copier is one stream of the device-neutral stream layer (``overlap.dist.streams``): a side
CUDA stream on a GPU, the stream twin (a worker thread) on CPU; the symmetric ops issue the same
ordering code on both.

Contract: ``submit(fn, *tensors)`` makes the copier stream wait for the caller's stream,
enqueues ``fn`` and returns an event (the ticket); ``tensors`` are what ``fn`` touches that the
caller's stream allocated. ``wait(ticket)`` makes the caller's stream wait for the ticket (on
CPU the host blocks, with a timeout). Work runs in submission order. A failure inside the
copier is sticky: it is re-raised by every later ``wait`` until the owner closes the copier.
The narrative: docs/design/tp.md.
"""

from __future__ import annotations

from typing import Callable

import torch

from overlap.dist.streams import Event, Stream, StreamTimeout
from overlap.profile.timers import comm_wait

__all__ = ["Copier"]


class Copier:
    """One copy stream of a fused op's context (see the module docstring)."""

    def __init__(self, device: torch.device, name: str, timeout: float):
        self.device = torch.device(device)
        self.timeout = timeout
        self.stream = Stream(self.device, name=name)
        self._last: Event | None = None

    def submit(self, fn: Callable[[], None], *tensors: torch.Tensor) -> Event:
        self.stream.wait_current()
        self.stream.enqueue(fn, tensors)
        self._last = self.stream.record_event()
        return self._last

    def wait(self, ticket: Event, what: str) -> None:
        # The copier's own signal waits time out after `timeout`; the margin lets their error,
        # which names the peer and slot, arrive before this generic one.
        with comm_wait("tp.copier"):
            try:
                ticket.wait(self.timeout + 5.0, what)
            except StreamTimeout as exc:
                raise TimeoutError(f"{what}: the copy stream did not finish a copy within "
                                   f"{self.timeout + 5.0:g}s") from exc

    def drain(self, what: str) -> None:
        if self._last is not None:
            self.wait(self._last, what)

    def close(self) -> None:
        if self.stream.cuda is not None:
            self.stream.cuda.synchronize()
        self.stream.close(self.timeout + 5.0)
