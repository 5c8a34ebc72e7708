"""Two compute actions of one pipeline rank that hand the host to each other at every EP wait,
so one micro-batch's expert all-to-all is in flight while another micro-batch computes.

Contract: ``Interleaver.run(main, helper)`` runs ``main`` on the calling thread and ``helper``
on a helper thread, never both at once: the running one keeps the host until it calls
``switch()`` (``EPComm`` does, right before each blocking EP wait) or returns; then the other
one runs until its own next switch. The order is fixed by the code, never by timing, so every
EP rank issues its collectives in the same order (NCCL matches them by position); it is the
order :func:`overlap.pp.programs.expand` proves deadlock-free. Outside ``run``, ``switch()``
does nothing. A failure in either action stops the other at its next switch and is raised by
``run``. The narrative: docs/design/pp.md.
"""

from __future__ import annotations

import threading
from typing import Callable

from overlap.errors import OverlapError
from overlap.profile.timers import add_exposed, axis_totals, exposed_seconds

__all__ = ["Interleaver", "PartnerFailed"]


class PartnerFailed(OverlapError, RuntimeError):
    """Raised inside one action of a pair when the other one failed (``run`` raises the cause)."""


class Interleaver:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._turn: int | None = None  # the action holding the host; None outside run()
        self._alive: set[int] = set()
        self._failed = False
        self.trace: list[str] | None = None  # set to a list to record the switches (tests)
        self._labels = ("", "")

    def switch(self) -> None:
        """Hand the host to the other action of the pair and wait for it back (no-op outside a
        pair or once the other action has finished)."""
        with self._cv:
            me = self._turn
            if me is None or 1 - me not in self._alive:
                self._raise_if_failed()
                return
            if self.trace is not None:
                self.trace.append(self._labels[me])
            self._turn = 1 - me
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn == me or self._failed)
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._failed:
            raise PartnerFailed("pp pair: the other action of this overlapped pair failed")

    def _finish(self, me: int, failed: bool) -> None:
        with self._cv:
            self._alive.discard(me)
            self._failed |= failed
            if self._alive:
                self._turn = 1 - me
            self._cv.notify_all()

    def run(self, main: Callable[[], None], helper: Callable[[], None], *,
            helper_first: bool = False, labels: tuple[str, str] = ("main", "helper")) -> None:
        """Run both actions interleaved at their switches; ``main`` starts unless
        ``helper_first`` (a forward runs on the calling thread, whose thread-local state, such
        as saved-tensor hooks, it may need)."""
        errors: list[BaseException | None] = [None, None]
        helper_exposed: list = [0.0, {}]

        def body(i: int, fn: Callable[[], None]) -> None:
            with self._cv:
                self._cv.wait_for(lambda: self._turn == i or self._failed)
            try:
                self._raise_if_failed()
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to run() and re-raised there
                errors[i] = exc
            finally:
                self._finish(i, errors[i] is not None)

        def on_helper() -> None:  # a new thread: its exposed-time counters start at zero
            try:
                body(1, helper)
            finally:
                helper_exposed[:] = [exposed_seconds(), axis_totals()]

        with self._cv:
            self._turn, self._alive, self._failed = int(helper_first), {0, 1}, False
            self._labels = labels
        thread = threading.Thread(target=on_helper, name="overlap-pp-pair", daemon=True)
        thread.start()
        try:
            body(0, main)
        finally:
            thread.join()
            with self._cv:
                self._turn = None
            # the helper's blocked time is this step's exposed communication too
            add_exposed(*helper_exposed)
        for exc in errors:
            if exc is not None and not isinstance(exc, PartnerFailed):
                raise exc
        for exc in errors:
            if exc is not None:
                raise exc
