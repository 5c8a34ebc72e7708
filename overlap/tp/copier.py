"""The copier of the symmetric backend: where peer copies run while the GEMM runs.

Two implementations of one small interface, chosen by device:

- ``StreamCopier`` (GPU): a side CUDA stream, i.e. the copy engine. ``submit(fn)`` first makes
  the side stream wait for the current stream (so the copy sees the tensors the caller just
  produced), runs ``fn`` with the side stream current (its copies, signal sets and signal waits
  are enqueued there) and records an event; ``wait(ticket)`` makes the *current stream* wait
  for that event. The host never blocks.
- ``ThreadCopier`` (CPU): one thread that runs submitted functions in order. torch releases the
  GIL inside ``copy_`` and the workspace releases it while waiting on a signal, so the copies
  really run beside the GEMM. ``wait(ticket)`` blocks the caller, with a timeout.

Both run submitted work in submission order, so "wait for peer, copy, signal" sequences never
reorder. A failure inside the copier is sticky: it is re-raised by every later ``wait`` until
the owner closes the copier (the op's context is then unusable, see overlap.tp.context).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch
from overlap.profile.timers import comm_wait

__all__ = ["ThreadCopier", "StreamCopier", "make_copier"]


class _Ticket:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class ThreadCopier:
    """Runs submitted functions on one daemon thread, in order (CPU twin of a copy stream)."""

    def __init__(self, name: str, timeout: float):
        self.timeout = timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._last: _Ticket | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, ticket = item
            if self._error is None:
                try:
                    fn()
                except BaseException as exc:  # handed to the waiting op, never swallowed
                    self._error = exc
            ticket.error = self._error
            ticket.done.set()

    def submit(self, fn: Callable[[], None], *tensors: torch.Tensor) -> _Ticket:
        if not self._thread.is_alive():
            raise RuntimeError("ThreadCopier.submit: the copier is closed")
        ticket = _Ticket()
        self._queue.put((fn, ticket))
        self._last = ticket
        return ticket

    def wait(self, ticket: _Ticket, what: str) -> None:
        # The copier's own signal waits time out after `timeout`; the margin lets their error,
        # which names the peer and slot, arrive before this generic one.
        with comm_wait("tp.copier"):
            done = ticket.done.wait(self.timeout + 5.0)
        if not done:
            raise TimeoutError(f"{what}: the copy thread did not finish a copy within "
                               f"{self.timeout + 5.0:g}s")
        if ticket.error is not None:
            raise ticket.error

    def drain(self, what: str) -> None:
        if self._last is not None:
            self.wait(self._last, what)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(self.timeout + 5.0)


class StreamCopier:
    """Runs submitted functions with a side CUDA stream current; orders by events."""

    def __init__(self, device: torch.device, timeout: float):
        self.device = device
        self.timeout = timeout
        self.stream = torch.cuda.Stream(device)
        self._last: torch.cuda.Event | None = None

    def submit(self, fn: Callable[[], None], *tensors: torch.Tensor) -> torch.cuda.Event:
        # The copy reads or writes tensors the current stream produced or allocated.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fn()
        for t in tensors:
            t.record_stream(self.stream)  # the allocator must not recycle them under the copy
        event = torch.cuda.Event()
        event.record(self.stream)
        self._last = event
        return event

    def wait(self, ticket: torch.cuda.Event, what: str) -> None:
        torch.cuda.current_stream(self.device).wait_event(ticket)

    def drain(self, what: str) -> None:
        if self._last is not None:
            self.wait(self._last, what)

    def close(self) -> None:
        self.stream.synchronize()


def make_copier(device: torch.device, name: str, timeout: float) -> ThreadCopier | StreamCopier:
    if device.type == "cuda":
        return StreamCopier(device, timeout)
    return ThreadCopier(name, timeout)
