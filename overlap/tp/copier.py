"""The copier of the symmetric backend: where peer copies run while the GEMM runs.

Two implementations of one small interface, chosen by device:

- ``StreamCopier`` (GPU): a side CUDA stream, i.e. the copy engine. ``submit(fn)`` first makes
  the side stream wait for the current stream (so the copy sees the tensors the caller just
  produced), runs ``fn`` with the side stream current (its copies, signal sets and signal waits
  are enqueued there) and records an event; ``wait(ticket)`` makes the *current stream* wait
  for that event. The host never blocks.
- ``ThreadCopier`` (CPU): one thread that runs submitted functions in order. torch releases the
  GIL inside ``copy_`` and the workspace releases it while waiting on a signal, so the copies
  really run beside the GEMM. ``wait(ticket)`` blocks the caller, with a timeout, and runs
  queued copies itself if the thread has not got to them.

Both run submitted work in submission order, so "wait for peer, copy, signal" sequences never
reorder. A failure inside the copier is sticky: it is re-raised by every later ``wait`` until
the owner closes the copier (the op's context is then unusable, see overlap.tp.context).
"""

from __future__ import annotations

import collections
import threading
import time
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
    """Runs submitted functions in order on one daemon thread (CPU twin of a copy stream).

    A waiter whose ticket is not done yet runs the queued functions itself when the thread is
    not running one: on a busy CPU a woken thread can wait milliseconds for a core (the
    scheduler lets the running GEMM finish its slice), and the op would wait with it. One lock
    lets only one runner at a time pop and run, so submission order always holds."""

    def __init__(self, name: str, timeout: float):
        self.timeout = timeout
        self._tasks: collections.deque = collections.deque()
        self._cv = threading.Condition()  # guards _tasks and _closing
        self._run = threading.Lock()       # held while a task runs, by the thread or a waiter
        self._closing = False
        self._error: BaseException | None = None
        self._last: _Ticket | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _run_next(self) -> bool:
        """Run the oldest queued task (caller holds ``_run``); False if there was none."""
        with self._cv:
            if not self._tasks:
                return False
            fn, ticket = self._tasks.popleft()
        if self._error is None:
            try:
                fn()
            except BaseException as exc:  # handed to the waiting op, never swallowed
                self._error = exc
        ticket.error = self._error
        ticket.done.set()
        return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._tasks and not self._closing:
                    self._cv.wait()
                if self._closing and not self._tasks:
                    return
            with self._run:
                self._run_next()

    def submit(self, fn: Callable[[], None], *tensors: torch.Tensor) -> _Ticket:
        ticket = _Ticket()
        with self._cv:
            if self._closing:
                raise RuntimeError("ThreadCopier.submit: the copier is closed")
            self._tasks.append((fn, ticket))
            self._cv.notify()
        self._last = ticket
        return ticket

    def wait(self, ticket: _Ticket, what: str) -> None:
        # The copier's own signal waits time out after `timeout`; the margin lets their error,
        # which names the peer and slot, arrive before this generic one.
        limit = self.timeout + 5.0
        deadline = time.monotonic() + limit
        with comm_wait("tp.copier"):
            while not ticket.done.is_set():
                if self._run.acquire(blocking=False):
                    try:
                        if self._run_next():
                            continue
                    finally:
                        self._run.release()
                ticket.done.wait(0.001)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: the copy thread did not finish a copy within "
                                       f"{limit:g}s")
        if ticket.error is not None:
            raise ticket.error

    def drain(self, what: str) -> None:
        if self._last is not None:
            self.wait(self._last, what)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
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
