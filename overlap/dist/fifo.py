"""FifoWorker: one daemon thread that runs queued items one at a time, in the order they were
put. The CPU twins of a CUDA stream (``overlap.dist.streams``) and of an NCCL communicator
(``overlap.dist.nccl_twin``) are both one of these; what an item is, what its failure means and
what a closed queue says are the owner's (the ``run`` and ``closed_error`` parameters).

The worker drops its reference to an item before it sleeps again, so an idle worker keeps no
closure (and no tensor it holds) alive.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

__all__ = ["FifoWorker"]


class FifoWorker:
    """``run(item)`` is called on the worker thread for each item, in ``put`` order; it must
    not raise (an owner records its own errors). ``closed_error(item)`` is raised by ``put``
    after ``close``. ``cv`` (a reentrant condition) guards the queue; an owner may hold it to
    change its own state atomically with a ``put`` or ``drain``. ``running`` is held while an
    item runs, by the worker or by a host thread that ``pop``s to help."""

    def __init__(self, name: str, run: Callable[[Any], None],
                 closed_error: Callable[[Any], BaseException]):
        self._run_item = run
        self._closed_error = closed_error
        self._queue: collections.deque = collections.deque()
        self.cv = threading.Condition()  # an RLock underneath: owners may nest
        self.running = threading.Lock()
        self.closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def put(self, item, *, admit: Callable[[], bool] | None = None) -> bool:
        """Queue ``item``. ``admit`` runs under the lock first (after the closed check) and may
        refuse the item by returning False (then ``put`` returns False and nothing is queued)."""
        with self.cv:
            if self.closed:
                raise self._closed_error(item)
            if admit is not None and not admit():
                return False
            self._queue.append(item)
            self.cv.notify()
        return True

    def pop(self, accept: Callable[[Any], bool] | None = None):
        """Take the head without waiting: None if the queue is empty or ``accept(head)`` is
        False. A caller that runs the item must hold ``running``."""
        with self.cv:
            if not self._queue or (accept is not None and not accept(self._queue[0])):
                return None
            return self._queue.popleft()

    def drain(self) -> list:
        """Remove and return every queued item (not the one running)."""
        with self.cv:
            items, self._queue = list(self._queue), collections.deque()
        return items

    def queued(self) -> list:
        with self.cv:
            return list(self._queue)

    def close(self) -> None:
        """No more puts; the worker ends once the queue is empty."""
        with self.cv:
            self.closed = True
            self.cv.notify()

    def join(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` for the worker to end; True if it has ended, or if called
        from the worker itself (which cannot wait for its own end)."""
        if threading.current_thread() is self._thread:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self._queue and not self.closed:
                    self.cv.wait()
                if not self._queue:
                    return
            with self.running:
                item = self.pop()
                if item is not None:
                    self._run_item(item)
            item = None  # an idle worker holds nothing
