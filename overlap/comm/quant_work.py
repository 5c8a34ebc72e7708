"""Handles of the async quantized collectives, and the issue order they keep per group.

An INT8 all-reduce is two collectives with compute in between (quantize, all-to-all, dequantize
and reduce, requantize, all-gather, dequantize), so no single ``torch.distributed`` Work can
stand for it. An async op therefore runs on its own short-lived worker thread (the CPU twin of
a communication stream; torch and the C++ kernels release the GIL) and returns a ``QuantWork``.

Collectives are matched between ranks by the order in which each rank issues them, so the ops
of this module on one group run strictly in call order: each worker starts only when the
previous async op on that group has finished, and a synchronous call first waits for the
pending ones. Contract: while an async op of this module is in flight on a group, issue no
other collective on that group except through this module; call ``wait()`` on it, or
``drain(group)``, before a plain ``torch.distributed`` call on that group.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

__all__ = ["QuantWork", "submit", "drain", "DEFAULT_WAIT_TIMEOUT_S"]

DEFAULT_WAIT_TIMEOUT_S = 300.0

# id(group) -> the last async op submitted on it while it is still running. Only ordering lives
# here (no group registry): an entry disappears as soon as its op finishes.
_tails: dict[int, "QuantWork"] = {}
_tails_lock = threading.Lock()


class QuantWork:
    """Handle of an async quantized collective. ``wait()`` returns its result (re-raising the
    op's exception, or TimeoutError after ``timeout`` seconds); ``is_completed()`` polls."""

    def __init__(self, op: str, rank: int):
        self.op = op
        self.rank = rank
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._cuda_done: Any = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        limit = DEFAULT_WAIT_TIMEOUT_S if timeout is None else timeout
        if not self._done.wait(limit):
            raise TimeoutError(f"{self.op}: rank {self.rank}: not complete after {limit:.0f}s "
                               "(a peer may have died or not made the same call)")
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        if self._cuda_done is not None:
            # The caller's stream must not read the result before the comm stream wrote it.
            torch.cuda.current_stream().wait_event(self._cuda_done)
        return self._result


def _await_previous(op: str, rank: int, prev: QuantWork | None) -> None:
    if prev is None:
        return
    if not prev._done.wait(DEFAULT_WAIT_TIMEOUT_S):
        raise TimeoutError(f"{op}: rank {rank}: the earlier {prev.op} on this group did not "
                           f"finish within {DEFAULT_WAIT_TIMEOUT_S:.0f}s")
    if prev._error is not None:
        raise RuntimeError(f"{op}: rank {rank}: not started because the earlier {prev.op} on "
                           f"this group failed: {prev._error}") from prev._error


def drain(group: Any, timeout: float | None = None) -> None:
    """Wait until every async op of this module submitted on ``group`` has finished (their
    errors stay with their own ``wait()``), so plain collectives on the group are safe again."""
    with _tails_lock:
        last = _tails.get(id(group))
    if last is None:
        return
    limit = DEFAULT_WAIT_TIMEOUT_S if timeout is None else timeout
    if not last._done.wait(limit):
        raise TimeoutError(f"quant.drain: rank {last.rank}: {last.op} still running after "
                           f"{limit:.0f}s")


def submit(op: str, group: Any, rank: int, body: Callable[[], Any], *, async_op: bool,
           device: torch.device) -> Any:
    """Run ``body`` after every earlier async op of this module on ``group``: inline when not
    ``async_op`` (returns its result), else on a worker thread (returns a QuantWork)."""
    key = id(group)
    with _tails_lock:
        prev = _tails.get(key)
        if prev is not None and prev.is_completed():
            prev = None
        if async_op:
            work = QuantWork(op, rank)
            _tails[key] = work
    if not async_op:
        _await_previous(op, rank, prev)
        return body()

    ready = None
    if device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()  # the inputs are complete on the caller's stream at this point

    def run() -> None:
        try:
            _await_previous(op, rank, prev)
            if ready is None:
                work._result = body()
            else:
                stream = torch.cuda.Stream(device=device)
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    work._result = body()
                    work._cuda_done = torch.cuda.Event()
                    work._cuda_done.record(stream)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            work._error = exc
        finally:
            work._done.set()
            with _tails_lock:
                if _tails.get(key) is work:
                    del _tails[key]

    work._thread = threading.Thread(target=run, name=f"overlap-{op}", daemon=True)
    work._thread.start()
    return work
