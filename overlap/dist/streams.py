"""Device-neutral streams and events: CUDA streams on a GPU, a faithful twin on CPU.

A buffer is safe to reuse only once the work that reads it is ordered before the write on the
device (``Event.record(stream)``, ``stream.wait_event(event)``), not once the host issued it.
On CPU each ``Stream`` is a worker thread running enqueued work in order; on CUDA
``enqueue(fn)`` runs ``fn`` at once with the stream current. ``event.query()`` says whether the
event's point has run; ``event.synchronize()`` blocks the host (a counted sync);
``event.wait(timeout)`` makes the caller's stream wait. ``OVERLAP_STREAM_DELAY_MS=D`` delays
every twin work item by a random 0..D ms. Errors raised by twin work are re-raised by the next
host ``synchronize``/event wait. Work that touches a buffer ``device_empty`` allocated must be
ordered after the caller's stream since that allocation (the caching allocator reuses memory
freed on the caller's stream at once); ``Stream.enqueue`` checks it on every device and raises.
``stream_memory``: the rules for memory twin work allocates, or uses without being given it.
The narrative: docs/design/dist.md.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from overlap.dist import run_stats
from overlap.dist.fifo import FifoWorker
from overlap.dist.stream_memory import StreamMemory
from overlap.errors import OverlapError
from overlap.profile import syncs

__all__ = ["Stream", "Event", "StreamTimeout", "StreamStillRunning", "delay_ms",
           "InjectedDelay", "fill_poison", "device_empty", "work_completion"]


def _ranged(name: str, fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with torch.profiler.record_function(name):
            fn()
    return run


def fill_poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with what no computation produces by chance (NaN; -1 for integers; True
    for bools): the twin's stand-in for device memory nobody wrote."""
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else -1)


# The caller's stream as the streams see it: a point is taken at every allocation of
# device_empty and at every wait_current, so "this stream is ordered after the caller up to
# point q" compares with "this buffer was allocated at point p". One clock per process: on a
# GPU every thread's current stream is the device's default one (this code picks no other).
_caller_points = itertools.count(1)


class _Allocations:
    """The caller point at which ``device_empty`` allocated each live buffer, by storage (a
    view finds its base's; a storage that died and whose address was reused is not found)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._points: dict[int, tuple[StorageWeakRef, int]] = {}
        self._limit = 1024

    def stamp(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.nbytes() == 0:
            return
        with self._lock:
            self._points[st.data_ptr()] = (StorageWeakRef(st), next(_caller_points))
            if len(self._points) > self._limit:  # forget dead storages, keep the dict small
                self._points = {k: v for k, v in self._points.items() if not v[0].expired()}
                self._limit = max(1024, 2 * len(self._points))

    def point(self, t: torch.Tensor) -> int:
        """The caller point of ``t``'s allocation; 0 if ``device_empty`` did not make it."""
        st = t.untyped_storage()
        with self._lock:
            entry = self._points.get(st.data_ptr())
        if entry is None or entry[0].expired() or entry[0].cdata != st._cdata:
            return 0
        return entry[1]


_allocations = _Allocations()


def device_empty(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized device buffer, allocated on the caller's stream: ``torch.empty`` on
    CUDA; poisoned on the CPU twin, so reading it before the copy that fills it has run gives
    wrong numbers, as on a GPU. Its caller point is kept: work on another stream that touches
    it must be ordered after the caller since then (``Stream.enqueue``)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    _allocations.stamp(out)
    return out if out.is_cuda else fill_poison(out)


class StreamTimeout(OverlapError, TimeoutError):
    """A host wait for an event ran out of time (the stream's own errors keep their type)."""


class StreamStillRunning(OverlapError, RuntimeError):
    """``Stream.close(timeout)`` ran out of time with the twin's worker still inside a work
    item: memory that item may touch must not be freed (a GPU would wait for the stream)."""


def delay_ms() -> float:
    """The injected maximum delay per twin work item, in ms (0: none)."""
    try:
        return float(os.environ.get("OVERLAP_STREAM_DELAY_MS", "0") or 0)
    except ValueError:
        return 0.0


class InjectedDelay:
    """The test mode's random wait before each work item of one twin worker (a stream, an
    ``nccl_twin`` communicator): 0..``OVERLAP_STREAM_DELAY_MS`` ms, seeded by
    ``OVERLAP_STREAM_SEED``, the worker's name and the pid. Settings are read once, at
    construction; calling it is a no-op when the mode is off."""

    __slots__ = ("limit_ms", "_rng", "_note")

    def __init__(self, name: str):
        self.limit_ms = delay_ms()
        self._note = run_stats.enabled()  # CI: which test files reach this point
        seed = int(os.environ.get("OVERLAP_STREAM_SEED", "0") or 0)
        self._rng = random.Random(hash((seed, name, os.getpid())))

    def __call__(self) -> None:
        if self._note:
            run_stats.note_twin_op()
        if self.limit_ms > 0:
            time.sleep(self._rng.uniform(0, self.limit_ms) / 1e3)


class Event:
    """A point in a stream (see the module docstring). On CPU an event is the count of items
    its stream had been given when it was recorded: it is reached once the stream has run that
    many (items run in order), so recording one queues nothing. On every device an event also
    carries the caller point its stream had been ordered after (``Stream.enqueue``)."""

    __slots__ = ("device", "_cuda", "_stream", "_seq", "_caller_point")

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = device if isinstance(device, torch.device) else torch.device(device)
        self._cuda = torch.cuda.Event() if self.device.type == "cuda" else None
        self._stream: Stream | None = None  # never recorded: complete, as in CUDA
        self._seq = 0
        self._caller_point = 0  # the caller point its stream had been ordered after

    def record(self, stream: "Stream") -> "Event":
        self._caller_point = stream._caller_point
        if self._cuda is not None:
            self._cuda.record(stream.cuda)
            return self
        self._stream, self._seq = stream, stream._issued_count()
        return self

    def query(self) -> bool:
        if self._cuda is not None:
            return self._cuda.query()
        return self._stream is None or self._stream._finished >= self._seq

    def wait(self, timeout: float | None = None, what: str = "") -> None:
        """The caller's stream waits for this event (see the module docstring): a device-side
        wait on CUDA; on CPU the host blocks (helping the stream along), raises the stream's
        error, and raises TimeoutError after ``timeout`` seconds."""
        if self._cuda is not None:
            torch.cuda.current_stream(self.device).wait_event(self._cuda)
            return
        stream, seq = self._stream, self._seq
        if stream is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while stream._finished < seq:
            if stream._help():
                continue
            stream._await(seq, 0.001)
            if deadline is not None and time.monotonic() > deadline:
                raise StreamTimeout(f"{what or 'streams'}: stream {stream.name!r} did not reach "
                                    f"the event within {timeout:g}s")
        stream._raise_error()

    def synchronize(self, timeout: float | None = None) -> None:
        syncs.record("Event.synchronize")
        if self._cuda is not None:
            self._cuda.synchronize()
            return
        if self._stream is None:
            return
        if not self._stream._await(self._seq, timeout):
            raise TimeoutError(f"streams: event not reached within {timeout:g}s")
        self._stream._raise_error()


class Stream:
    """One in-order queue of device work (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu", name: str = "stream"):
        self.device = torch.device(device)
        self.name = name
        self.cuda = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._error: BaseException | None = None
        # The caller point this stream is ordered after, and that point when it last ran work
        # on caller tensors (see enqueue).
        self._caller_point = 0
        self._caller_used = 0
        if self.cuda is None:
            self._delay = InjectedDelay(name)
            self._issued = 0  # items queued (under the worker's lock), in queue order
            self._finished = 0  # items run to their end (written under _progress)
            self._progress = threading.Condition(threading.Lock())
            self._worker = FifoWorker(f"overlap-stream-{name}", lambda item: self._execute(*item),
                                      self._closed_error)
            self._memory = StreamMemory(name, lambda: next(_caller_points))

    # -- issuing
    def enqueue(self, fn: Callable[[], None], tensors: tuple[torch.Tensor, ...] = ()) -> None:
        """Run ``fn`` on this stream after everything enqueued before it. ``tensors``: what
        ``fn`` reads or writes that the caller's stream allocated (CUDA: ``record_stream``, so
        the caching allocator does not hand their memory out again while ``fn``'s kernels
        may still use it; the twin keeps them until ``fn`` ran, then drops ``fn``: a caller
        buffer ``fn`` used without being given it and held the last reference to is a
        violation, raised by the next ``enqueue`` or sync; see ``stream_memory``).

        Two rules, checked on every device (on CPU the caller's work is always done by then,
        so breaking them could never show as wrong numbers; it raises instead):

        - work that touches caller tensors is ordered after the caller's stream anew since
          this stream's last such work (``wait_current``, or ``wait_event`` on an event of a
          stream that did so later), or it may read them before they are written;
        - a buffer ``device_empty`` allocated is touched only once this stream is ordered after
          the caller since that allocation: the caching allocator may have handed it memory
          freed on the caller's stream whose earlier kernels, queued there, still use it."""
        if tensors:
            self._check_caller_order(tensors)
        if self.cuda is not None:
            with torch.cuda.stream(self.cuda):
                fn()
            for t in tensors:
                if t.is_cuda:  # pinned host memory is not the caching allocator's
                    t.record_stream(self.cuda)
            return
        if self._memory.violation is not None:
            raise self._memory.violation
        self._put(("run", self._memory.work(fn, tuple(tensors), self._caller_point)))

    def enqueue_copy(self, dst: torch.Tensor, src: torch.Tensor, *,
                     keep_src: bool = True, name: str | None = None) -> None:
        """``dst.copy_(src)`` on this stream (order it first, as for ``enqueue``); ``dst`` is
        kept allocated until the copy ran. ``keep_src``: so is ``src`` (CUDA:
        ``record_stream``), and the caller may drop its last reference at once. False models
        a caller that skips that rule: on CUDA the allocator may hand ``src``'s memory out
        again before the copy reads it; the twin copies poison (NaN, or -1 for integers) when
        by the time the copy runs nothing but the copy still holds ``src``. ``name``: a
        profiler range around the copy (on the twin's worker, where it runs)."""
        keep = (dst, src) if keep_src else (dst,)
        ranged = (lambda fn: fn) if name is None else (lambda fn: _ranged(name, fn))
        if keep_src or self.cuda is not None:
            self.enqueue(ranged(lambda: dst.copy_(src, non_blocking=True)), tensors=keep)
            return
        holder = [src]

        def copy() -> None:
            t = holder.pop()
            # references to the storage: this tensor, the temporary storage object and any
            # tensor of the caller's still alive
            if torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2:
                fill_poison(dst)  # the allocator could have reused the memory
            else:
                dst.copy_(t)

        self.enqueue(ranged(copy), tensors=keep)

    def wait_current(self) -> None:
        """Later work on this stream waits for everything the caller's stream has issued (on
        CPU the caller is the host, whose work is done when it calls)."""
        self._caller_point = next(_caller_points)
        if self.cuda is not None:
            self.cuda.wait_stream(torch.cuda.current_stream(self.device))

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits until ``event``'s point has run (and so for what
        the event's stream had been ordered after on the caller's stream)."""
        self._caller_point = max(self._caller_point, event._caller_point)
        if self.cuda is not None:
            if event._cuda is not None:
                self.cuda.wait_event(event._cuda)
            return
        if event._stream is not None:
            self._put(("wait", (event._stream, event._seq)))

    def record_event(self) -> Event:
        return Event(self.device).record(self)

    def synchronize(self) -> None:
        """Block the host until everything enqueued so far has run (a counted host sync)."""
        self.record_event().synchronize()

    def close(self, timeout: float | None = None) -> None:
        """Stop the twin's worker once its queue is empty (no-op on CUDA); ``timeout`` bounds
        the join (a worker blocked in a bounded wait ends with it). A worker still running
        after ``timeout`` raises StreamStillRunning: the caller must then keep every buffer
        the stream's work may touch (on a GPU, freeing them would wait for the stream)."""
        if self.cuda is None:
            self._worker.close()
            if not self._worker.join(timeout):
                raise StreamStillRunning(
                    f"streams: stream {self.name!r}: its worker is still inside a work "
                    f"item {timeout:g} s after close(); buffers that work may touch must "
                    "not be freed")

    def _check_caller_order(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if self._caller_point <= self._caller_used:
            raise RuntimeError(f"streams: work on stream {self.name!r} touches caller tensors "
                               "but the stream was not ordered after the caller since its last "
                               "such work (call wait_current(), or wait_event() on an event "
                               "recorded after one)")
        for t in tensors:
            born = _allocations.point(t)
            if born > self._caller_point:
                raise RuntimeError(
                    f"streams: work on stream {self.name!r} touches a buffer allocated on the "
                    f"caller's stream (device_empty, at caller point {born}) but the stream is "
                    f"ordered after the caller only up to point {self._caller_point}: the "
                    "caching allocator reuses memory freed on the caller's stream at once, while "
                    "kernels queued there before the allocation may still use it (call "
                    "wait_current() after allocating)")
        self._caller_used = self._caller_point

    # -- twin internals
    def _put(self, item: tuple) -> None:
        with self._worker.cv:  # reentrant: put takes it again
            self._worker.put(item)
            self._issued += 1

    def _issued_count(self) -> int:
        with self._worker.cv:
            return self._issued

    def _await(self, seq: int, timeout: float | None) -> bool:
        """Block until ``seq`` items have run or ``timeout`` seconds passed (None: no limit);
        True if they have."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._progress:
            while self._finished < seq:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._progress.wait(left)
            return True

    def _closed_error(self, item) -> RuntimeError:
        return RuntimeError(f"streams: stream {self.name!r} is closed")

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
        if self._memory.violation is not None:
            raise self._memory.violation

    def _execute(self, kind: str, arg) -> None:
        try:
            if kind == "wait":
                stream, seq = arg
                stream._await(seq, None)
            else:
                self._delay()
                if self._error is None:  # after an error the stream's later work is void
                    error = self._memory.run(arg)  # surfaces at the next sync
                    if error is not None:
                        self._error = error
                arg.fn, arg.keep = None, ()
        finally:
            with self._progress:
                self._finished += 1
                self._progress.notify_all()

    def _help(self) -> bool:
        """Run the head of the queue on the calling (host) thread if no one is running an
        item; True if it ran one."""
        if not self._worker.running.acquire(blocking=False):
            return False
        try:
            # Not a cross-stream wait: only the worker blocks on those.
            item = self._worker.pop(accept=lambda head: head[0] != "wait")
            if item is None:
                return False
            self._execute(*item)
            return True
        finally:
            self._worker.running.release()


def work_completion(work, name: str = "overlap-work-wait"):
    """(an event set when the ``torch.distributed`` ``work`` completes, ``finish(seconds=None)``
    that then raises its error, if any). A caller waits on the event in slices, watching for
    failed peers between them. Most works have a future to hook; some have none (gloo's
    send, recv and reduce-scatter), and their blocking ``wait()`` must not be cut short, so a
    helper thread makes it, bounded by the process group's timeout. ``seconds``: how long
    ``finish`` may wait for a work that has not completed (None: the backend's own bound)."""
    from datetime import timedelta

    done = threading.Event()
    try:
        work.get_future().add_done_callback(lambda _: done.set())
        return done, lambda seconds=None: (work.wait() if seconds is None else
                                           work.wait(timedelta(seconds=seconds)))
    except RuntimeError:
        pass
    error: list[BaseException] = []

    def wait() -> None:
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - raised by finish on the caller's thread
            error.append(exc)
        finally:
            done.set()

    def finish(seconds: float | None = None) -> None:
        # the backend's own timeout ends the helper's wait first
        if seconds is not None and not done.wait(seconds + 1.0):
            raise TimeoutError(f"no completion within {seconds:g}s")
        if error:
            raise error[0]

    threading.Thread(target=wait, name=name, daemon=True).start()
    return done, finish
