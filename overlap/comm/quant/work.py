"""How the quantized collectives run: issue order per group, async handles, bounded waits.

An async op runs on the group's communication stream (``overlap.dist.streams``) and returns a
``QuantWork``. The ops of this package on one group run strictly in call order. Contract: while
one is in flight on a group, issue no other collective on that group except through this
package; call ``wait()`` on it, or ``drain(group)``, before a plain ``torch.distributed`` call
on that group.

``OpRun`` issues every collective of an op. On CPU tensors each wait is bounded by ``timeout``
seconds, checked in 50 ms slices for a failed or exited peer (``state``); on CUDA tensors the
wait is stream-ordered and bounded by the NCCL watchdog (the process group's timeout).
The narrative: docs/design/quantized.md.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from overlap.comm.quant.state import (GroupState, QuantCommError, QuantTimeout, existing_state)
from overlap.dist.stamp import Disagreement
from overlap.dist.streams import work_completion

__all__ = ["QuantWork", "OpRun", "submit", "drain"]

_SLICE_S = 0.05
_EXIT_GRACE_S = 1.0  # see _raise_if_peer_failed
_DIAGNOSE_S = 0.5  # after a transport error, how long to look for the peer that caused it

# torch >= 2.9 renamed the *_tensor collectives; both names reach the same backend op.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _completion(work) -> tuple[threading.Event, Callable[..., None]]:
    return work_completion(work, name="overlap-quant-wait")


class OpRun:
    """One call of a quantized op on one group: its scratch and its collectives, each wait
    bounded by ``timeout`` and each failure named (op, group, this rank, the peer if known)."""

    def __init__(self, state: GroupState, group: Any, op: str, timeout: float,
                 device: torch.device):
        self.state, self.group, self.op = state, group, op
        self.timeout, self.device = timeout, device
        # Set by the op for a group of more than one rank (``stamps``): the group's Agreement
        # and this call's stamp words, so a refused size can still name both calls.
        self.agree = None
        self.stamp: list[int] | None = None
        self.stamps_agreed = False  # set once this call's stamps were exchanged alone
        self.peers = [q for q in range(state.world) if q != state.rank]

    def buffer(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.state.buffer(slot, shape, dtype, self.device)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._run("all_to_all", lambda: dist.all_to_all_single(out, inp, group=self.group,
                                                               async_op=True))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_gather") -> None:
        self._run(what, lambda: _all_gather(out, inp, group=self.group, async_op=True))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op) -> None:
        self._run("reduce_scatter", lambda: _reduce_scatter(out, inp, op=op, group=self.group,
                                                            async_op=True))

    def all_reduce(self, t: torch.Tensor, op) -> None:
        self._run("all_reduce", lambda: dist.all_reduce(t, op=op, group=self.group,
                                                        async_op=True))

    # -- waiting and naming failures

    def _run(self, what: str, issue: Callable[[], Any]) -> None:
        if not self.state.joined:
            self._join(what)
        try:
            work = issue()
        except Exception as exc:  # noqa: BLE001 - e.g. a communicator that failed earlier
            self._raise_if_sizes_differ(exc)
            raise self._transport_error(what, exc) from exc
        if self.device.type == "cuda":
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001
                self._raise_if_sizes_differ(exc)
                raise self._transport_error(what, exc) from exc
            return
        done, finish = _completion(work)
        deadline = time.monotonic() + self.timeout
        while not done.wait(max(0.0, min(_SLICE_S, deadline - time.monotonic()))):
            self._raise_if_peer_failed(what, done)
            if time.monotonic() >= deadline:
                raise self._timeout(what)
        try:
            finish()
        except Exception as exc:  # noqa: BLE001
            self._raise_if_sizes_differ(exc)
            raise self._transport_error(what, exc) from exc

    def _join(self, what: str) -> None:
        """Before this rank's first collective on the group, wait until every rank has reached
        its own: NCCL creates the group's communicator at that op and blocks the issuing thread,
        with no timeout of its own, until every rank has issued its first op on it, so a peer
        that refused its first call, or stalls before it, would hold this rank there for good.
        Bounded by the timeout, watching for a failed or exited peer; the store decides once
        for all ranks whether they go or give up (``GroupState.first_op``), so no rank issues
        the op that another has given up on."""
        deadline = time.monotonic() + self.timeout
        while True:
            decided = self.state.first_op()
            if decided == "go":
                break
            self._raise_if_peer_failed(what)
            if time.monotonic() >= deadline:
                if self.state.first_op(give_up=True) == "go":
                    break  # every rank arrived just now
                raise self._timeout(what)
            time.sleep(_SLICE_S)
        self.state.joined = True

    def _raise_if_sizes_differ(self, exc: BaseException) -> None:
        """The transport refused sizes that differ between ranks (nccl_twin raises so on every
        rank): no stamp crossed, so exchange them through the store and name both calls."""
        if self.stamp is None:
            return
        if type(exc).__name__ != "SizeMismatch" and "disagree on the sizes" not in str(exc):
            return
        from overlap.comm.quant.stamps import exchange_on_failure

        exchange_on_failure(self.state, self.op, self.stamp, exc)

    def _raise_if_peer_failed(self, what: str, done=None) -> None:
        """Raise naming the culprit: a peer's own published error first (it may have exited
        since), then a peer process that exited without reporting anything, then a peer that
        gave up on the group. Deaths are read before failures: a rank publishes its failure
        before it exits, so a dead rank missing from the later read never reported one.

        A peer that exited may have finished its part first (its data is already on the wire:
        the last collective of its program), so before calling an exit a failure the op gets
        ``_EXIT_GRACE_S`` to complete (``done``); it raises only if it still cannot."""
        st = self.state
        dead = st.dead_peers()
        failures = st.peer_failures()
        for peer, kind, msg in failures:
            if kind != "disagreement":
                continue
            # Every rank received the stamps in the same exchange: let this rank's own
            # comparison name the disagreement; if its op cannot finish, carry the peer's.
            if done is not None and done.wait(_EXIT_GRACE_S):
                return
            raise Disagreement(f"{self.op}: {st.place}: {what} cannot complete: peer rank "
                               f"{peer} found that the ranks' calls disagree: {msg}",
                               op=self.op, call=self.stamp[1] if self.stamp else -1,
                               ranks=(st.rank, peer))
        for peer, kind, msg in failures:
            if kind == "error":
                raise QuantCommError(f"{self.op}: {st.place}: {what} cannot complete: peer rank "
                                     f"{peer} failed: {msg}", op=self.op, group=st.name,
                                     rank=st.rank, peer=peer, kind="peer_failed")
        reported = {peer for peer, _, _ in failures}
        if done is not None and any(peer not in reported for peer, _ in dead) \
                and done.wait(_EXIT_GRACE_S):
            return
        for peer, pid in dead:
            if peer not in reported:
                raise QuantCommError(f"{self.op}: {st.place}: {what} cannot complete: peer "
                                     f"rank {peer} (pid {pid}) has exited", op=self.op,
                                     group=st.name, rank=st.rank, peer=peer, kind="died")
        for peer, _, msg in failures:
            raise QuantCommError(f"{self.op}: {st.place}: {what} cannot complete: peer rank "
                                 f"{peer} gave up waiting on the group: {msg}", op=self.op,
                                 group=st.name, rank=st.rank, kind="peer_failed")

    def _timeout(self, what: str) -> QuantTimeout:
        st = self.state
        absent = st.absent_peers()
        who = (f"rank(s) {absent} never called a quantized op on this group" if absent else
               "no peer reported an error and none on this host exited: a peer is stalled "
               "or did not make the same call")
        return QuantTimeout(f"{self.op}: {st.place}: {what} did not complete within "
                            f"{self.timeout:g}s; {who}", op=self.op, group=st.name,
                            rank=st.rank, peer=absent[0] if len(absent) == 1 else None,
                            kind="timeout")

    def _transport_error(self, what: str, exc: BaseException) -> QuantCommError:
        """The backend raised (e.g. gloo's "Connection closed by peer"): look briefly for the
        peer behind it, then name op, group and rank around the backend's message."""
        deadline = time.monotonic() + _DIAGNOSE_S
        while True:
            try:
                self._raise_if_peer_failed(what)
            except QuantCommError as named:
                named.args = (f"{named} (backend error: {exc})",)
                return named
            if time.monotonic() >= deadline:
                break
            time.sleep(_SLICE_S)
        st = self.state
        return QuantCommError(f"{self.op}: {st.place}: {what} failed (peer not identified): "
                              f"{exc}", op=self.op, group=st.name, rank=st.rank)


class QuantWork:
    """Handle of an async quantized collective. ``wait(timeout=None)`` returns its result or
    raises the op's error; a wait that times out (default: the op's ``timeout``) raises
    ``QuantTimeout`` and fails the group. ``is_completed()`` polls."""

    def __init__(self, op: str, state: GroupState, timeout: float):
        self.op, self.state, self.timeout = op, state, timeout
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._cuda_done: Any = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        limit = self.timeout if timeout is None else timeout
        if not self._done.wait(limit):
            err = QuantTimeout(f"{self.op}: {self.state.place}: wait(): not complete after "
                               f"{limit:g}s", op=self.op, group=self.state.name,
                               rank=self.state.rank, kind="timeout")
            self.state.fail(err)
            raise err
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        if self._cuda_done is not None:
            # The caller's stream must not read the result before the comm stream wrote it.
            torch.cuda.current_stream().wait_event(self._cuda_done)
        return self._result


def _await_previous(op: str, state: GroupState, prev: QuantWork | None, timeout: float) -> None:
    if prev is not None and not prev._done.wait(timeout):
        raise QuantTimeout(f"{op}: {state.place}: the earlier {prev.op} on this group did not "
                           f"finish within {timeout:g}s", op=op, group=state.name,
                           rank=state.rank, kind="timeout")
    state.check_usable(op)  # the earlier op's failure, if any, is the group's


def submit(op: str, state: GroupState, body: Callable[[], Any], *, async_op: bool,
           device: torch.device, timeout: float, tensors: tuple[torch.Tensor, ...] = ()) -> Any:
    """Run ``body`` after every earlier async op of this package on the group: inline when not
    ``async_op`` (returns its result; the caller fails the group on error), else on the group's
    communication stream (returns a QuantWork; an error fails the group and is raised by
    ``wait()``). ``tensors``: the caller's buffers ``body`` uses (the input, the error
    feedback), given to the stream's work (CUDA: ``record_stream``), so the caller may drop
    them before ``wait()``.

    Every async op of a group runs on that group's one stream (``overlap.dist.streams``), so
    the ops that share the group's scratch buffers are ordered on the device, not only on the
    host: an op's kernels cannot overwrite scratch that an earlier op's kernels still read. (A
    fresh stream per op, ordered only by the host seeing the previous op issued, lets two
    reductions' kernels interleave on a GPU and return wrong gradients.)"""
    with state.lock:
        prev = state.tail
        if prev is not None and prev.is_completed():
            prev = None
        if async_op:
            work = QuantWork(op, state, timeout)
            state.tail = work
    if not async_op:
        _await_previous(op, state, prev, timeout)
        if device.type == "cuda" and state.stream_ is not None:
            # Device order too: this call's kernels follow the async ops' on the comm stream.
            torch.cuda.current_stream().wait_event(state.stream_.record_event()._cuda)
        return body()

    stream = state.stream(device)
    # After the caller's stream: the inputs are written there, and memory it freed since the
    # last op (results this stream allocated) may come back to this op's allocations at once.
    stream.wait_current()

    def run() -> None:
        try:
            state.check_usable(op)  # an earlier op on the stream may have failed the group
            work._result = body()
            if device.type == "cuda":
                work._cuda_done = stream.record_event()._cuda
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            work._error = exc
            state.fail(exc)
        finally:
            work._done.set()
            with state.lock:
                if state.tail is work:
                    state.tail = None

    stream.enqueue(run, tensors)
    return work


def drain(group: Any, timeout: float | None = None) -> None:
    """Wait until every async op of this package submitted on ``group`` has finished (their
    errors stay with their own ``wait()``), so plain collectives on the group are safe again.
    ``timeout`` defaults to the last op's; running out raises ``QuantTimeout`` and fails the
    group."""
    state = existing_state(group)
    if state is None:
        return
    with state.lock:
        last = state.tail
    if last is None:
        return
    limit = last.timeout if timeout is None else timeout
    if not last._done.wait(limit):
        err = QuantTimeout(f"quant.drain: {state.place}: {last.op} still running after "
                           f"{limit:g}s", op="quant.drain", group=state.name, rank=state.rank,
                           kind="timeout")
        state.fail(err)
        raise err
