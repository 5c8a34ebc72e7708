"""Find a lost peer in seconds, not at the collective timeout, when no local launcher watches.

Under torchrun or srun a rank blocked in a collective whose peer's node died waits until the
process group's timeout (gloo and NCCL alike), and torchrun restarts nothing until then.
``Heartbeat`` runs a thread per rank that bumps a counter in the job's store every
``interval`` s and reads the counters of the ranks it watches (the next rank, and the same local
rank on the next node). A watched counter that stops moving for ``timeout`` s, or a store that
stops answering for as long, means a lost node: the rank publishes ``abort`` (the reason) and
exits, and every other rank reads ``abort`` within ``interval`` and exits too, so the launcher
restarts all of them (and the job shrinks, ``overlap.train.shrink``). A rank that finishes says so first
(``bye``), so an early finisher is not taken for a lost one. O(1) store operations per rank
per interval; the counters are read with ``add(key, 0)``, which never blocks. ``fault_file``
receives the time the lost peer was last seen alive.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

__all__ = ["Heartbeat", "watched_ranks", "INTERVAL_S"]

INTERVAL_S = 1.0  # between a rank's beats (and its reads of the watched ranks)


def watched_ranks(rank: int, world: int, ranks_per_node: int) -> list[int]:
    """The next rank and the same local rank on the next node (without this rank)."""
    out = []
    for r in ((rank + 1) % world, (rank + ranks_per_node) % world):
        if r != rank and r not in out:
            out.append(r)
    return out


def _exit(reason: str) -> None:
    print(reason, file=sys.stderr, flush=True)
    os._exit(1)  # a rank blocked in a collective cannot be woken any other way


class Heartbeat:
    """``with Heartbeat(store, rank, world, ranks_per_node, timeout=15):`` around the work.
    ``on_lost(reason)`` defaults to printing the reason and exiting the process."""

    def __init__(self, store, rank: int, world: int, ranks_per_node: int, *, timeout: float,
                 interval: float = INTERVAL_S, label: str = "overlap",
                 fault_file: str | None = None,
                 on_lost: Callable[[str], None] = _exit):
        if timeout <= interval:
            raise ValueError(f"Heartbeat: timeout {timeout} s must exceed the interval "
                             f"{interval} s")
        self.store, self.rank, self.timeout, self.interval = store, rank, timeout, interval
        self.label, self.on_lost, self.fault_file = label, on_lost, fault_file
        self.watch = watched_ranks(rank, world, ranks_per_node) if world > 1 else []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Heartbeat":
        if self.watch:
            self.store.add(f"hb/{self.rank}", 1)
            self._thread = threading.Thread(target=self._run, name="overlap-heartbeat",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close(finished=exc[0] is None)

    def close(self, *, finished: bool = True) -> None:
        """Stop beating; ``finished``: tell the watchers this rank is done, not lost."""
        if finished and self.watch:
            try:
                self.store.set(f"bye/{self.rank}", "1")
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                pass
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        seen = {r: (-1, time.monotonic()) for r in self.watch}
        failing_since = None
        while not self._stop.wait(self.interval):
            try:
                reason = self._beat(seen)
                failing_since = None
            except Exception as exc:  # noqa: BLE001 - an unreachable store is a lost host
                # ... once it stays unreachable for the timeout: the rank hosting it may just
                # have finished first, and this rank is about to.
                now = time.monotonic()
                failing_since = failing_since or now
                reason = (None if now - failing_since <= self.timeout else
                          f"{self.label}: rank {self.rank}: the job's store stopped answering "
                          f"for {now - failing_since:.0f} s ({type(exc).__name__}: {exc}); "
                          "its host is lost")
            if reason is not None and not self._stop.is_set():
                self.on_lost(reason)
                return

    def _beat(self, seen: dict[int, tuple[int, float]]) -> str | None:
        store, now = self.store, time.monotonic()
        store.add(f"hb/{self.rank}", 1)
        if store.check(["abort"]):
            return store.get("abort").decode()
        for r, (count, since) in seen.items():
            current = store.add(f"hb/{r}", 0)
            if current != count:
                seen[r] = (current, now)
            elif now - since > self.timeout and not store.check([f"bye/{r}"]):
                reason = (f"{self.label}: rank {r} stopped its heartbeat {now - since:.0f} s "
                          f"ago (seen by rank {self.rank}): its node is lost; every rank "
                          "stops so that the launcher can restart the job on the nodes left")
                store.set("abort", reason)
                if self.fault_file:  # when the peer was last seen alive (a restart reports it)
                    with open(self.fault_file, "w") as f:
                        f.write(repr(time.time() - (now - since)))
                return reason
        return None
