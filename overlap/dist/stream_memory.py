"""The stream twin's view of the CUDA caching allocator in the work a stream runs.

A block belongs to the stream it was allocated on; freed, it goes to that stream's next
allocation at once. Two rules follow, checked in every twin work item (a dispatch mode on the
thread running it sees each op's tensors):

- memory a stream's work allocated and the caller then freed may still be read by kernels the
  caller queued before freeing it: the stream's next work that allocates must have been
  enqueued after a ``wait_current()`` that follows the free, or that allocation raises;
- a caller buffer that work uses without being given it (``enqueue(..., tensors=)``: CUDA
  records it on the stream) must outlive the work: if the work held its last reference, the
  stream keeps a violation that its next ``enqueue``, synchronize or event wait raises.

Memory not the allocator's (``torch.frombuffer`` over shared memory) is exempt. ``STRICT =
False`` switches both off (tests show the rules, not luck, catch a buffer). docs/design/dist.md.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["STRICT", "Work", "StreamMemory"]

STRICT = True

_running = threading.local()  # .memory: the StreamMemory whose work this thread is running


def _storage(t: torch.Tensor):
    if t.device.type != "cpu" or t.layout != torch.strided:
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return None
    return st if st.nbytes() else None


def _what(t: torch.Tensor, st) -> str:
    return f"{st.nbytes()} bytes, seen as {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


class Work:
    """One work item of a twin stream: ``fn``, dropped once it ran (CUDA dropped it when the
    work was issued), the tensors it was given (``keep``), and the caller points at which it
    was enqueued (``issued``) and up to which its stream was ordered after the caller
    (``ordered``)."""

    __slots__ = ("fn", "keep", "issued", "ordered")

    def __init__(self, fn: Callable[[], None], keep: tuple[torch.Tensor, ...], issued: int,
                 ordered: int):
        self.fn, self.keep, self.issued, self.ordered = fn, keep, issued, ordered


class _Seen(TorchDispatchMode):
    """What one work item touches: caller buffers it was not given (``used``) and storages its
    ops allocated (``made``), both held weakly."""

    def __init__(self, memory: "StreamMemory", work: Work):
        super().__init__()
        self.memory, self.work = memory, work
        self.given = {st._cdata for st in map(_storage, work.keep) if st is not None}
        self.known: set[int] = set()
        self.used: list[tuple[weakref.ref, str]] = []
        self.made: list[tuple[weakref.ref, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for a in tree_flatten((args, kwargs))[0]:
            st = _storage(a) if isinstance(a, torch.Tensor) else None
            if st is None:
                continue
            inputs.add(st._cdata)
            if st._cdata not in self.known:
                self.known.add(st._cdata)
                if (st._cdata not in self.given and st.resizable()
                        and not self.memory.owns(st)):
                    self.used.append((weakref.ref(st), _what(a, st)))
        for o in tree_flatten(out)[0]:
            st = _storage(o) if isinstance(o, torch.Tensor) else None
            if st is None or st._cdata in inputs or st._cdata in self.known:
                continue
            self.known.add(st._cdata)
            if not self.made:
                self.memory.check_allocation(self.work)
            self.made.append((weakref.ref(st), _what(o, st)))
        return out


class StreamMemory:
    """The allocator state of one twin stream: the storages its work allocated that are alive,
    those the caller freed since (with the caller point of the free), and the first violation
    of the second rule. ``clock()`` takes a fresh caller point."""

    def __init__(self, name: str, clock: Callable[[], int]):
        self.name, self._clock = name, clock
        self._lock = threading.RLock()  # finalizers may run on a thread that holds it
        self._owned: dict[int, weakref.ref] = {}
        self._freed: list[tuple[int, str]] = []
        self._callers: set[int] = set()  # threads that issued work: the caller's stream
        self.violation: RuntimeError | None = None

    def work(self, fn: Callable[[], None], keep: tuple[torch.Tensor, ...], ordered: int) -> Work:
        """The item for ``fn``, issued now by this thread on the caller's stream."""
        self._callers.add(threading.get_ident())
        return Work(fn, keep, self._clock(), ordered)

    def run(self, work: Work) -> BaseException | None:
        """Run ``work.fn`` on this thread as the stream's work; returns what it raised."""
        fn, work.fn = work.fn, None
        before = getattr(_running, "memory", None)
        _running.memory = self
        try:
            if not STRICT:
                return _call(fn)
            seen = _Seen(self, work)
            with seen:
                error = _call(fn)
            used = [(ref, what) for ref, what in seen.used if ref() is not None]
            del fn  # now the work's own references are gone, as on CUDA once it was issued
            for ref, what in used:
                if ref() is None and self.violation is None:
                    self.violation = RuntimeError(
                        f"streams: work on stream {self.name!r} used a buffer of the caller's "
                        f"({what}) that it was not given (enqueue(..., tensors=)), and the "
                        "caller dropped it before that work was done: on CUDA nothing recorded "
                        "it on the stream, so the caching allocator could hand its memory out "
                        "again at once while the work still used it")
            for ref, what in seen.made:
                st = ref()
                if st is not None:
                    self._own(st, what)
            return error
        finally:
            _running.memory = before
            work.keep = ()

    def owns(self, st) -> bool:
        with self._lock:
            ref = self._owned.get(st._cdata)
        return ref is not None and ref() is st

    def check_allocation(self, work: Work) -> None:
        """The first rule, at the first allocation of ``work``."""
        with self._lock:
            freed = self._freed
            self._freed = [(p, what) for p, what in freed if p > work.issued]
        late = [(p, what) for p, what in freed if work.ordered < p < work.issued]
        if late:
            p, what = late[0]
            raise RuntimeError(
                f"streams: work on stream {self.name!r} allocates, but memory that the "
                f"stream's earlier work allocated ({what}) was freed by the caller at caller "
                f"point {p} and the stream is ordered after the caller only up to point "
                f"{work.ordered}: the caching allocator hands that memory out again at once on "
                "this stream while kernels the caller queued before freeing it may still use "
                "it (call wait_current() after the caller frees it, before enqueueing work "
                "that allocates)")

    def _own(self, st, what: str) -> None:
        with self._lock:
            self._owned[st._cdata] = weakref.ref(st)
        weakref.finalize(st, _freed, weakref.ref(self), st._cdata, what).atexit = False


def _call(fn: Callable[[], None]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the stream's error, surfaced at a sync
        return exc
    return None


def _freed(memory_ref: weakref.ref, key: int, what: str) -> None:
    memory = memory_ref()
    if memory is None:
        return
    with memory._lock:
        memory._owned.pop(key, None)
        # Freed by the caller: not by the stream's own work, nor by a transport's thread (NCCL
        # keeps what its own stream uses: record_stream, or held until the work completes).
        if getattr(_running, "memory", None) is not memory \
                and threading.get_ident() in memory._callers:
            memory._freed.append((memory._clock(), what))
