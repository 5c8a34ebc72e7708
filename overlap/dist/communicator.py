"""``Communicator``: what every communicator of a process group shares; ``CommOptions``.

A communicator (TPComm, CPComm, EPComm, the quantized collectives' GroupState, a TP workspace
context, the DP GradReducer) holds a group, this rank's place in it (``rank``, ``world``,
``global_ranks``, ``place``/``where``), a ``timeout`` and one failure rule: the first error
inside an op (``guard(op)``, or ``fail(exc)``) is kept, the subclass's ``_abort_peers`` wakes
the peers with it, and every later ``check_usable(op)`` raises the subclass's ``CommFailed``
naming it. ``close()`` releases the subclass's resources once (``_release``). Subclasses
override only the hooks (``_place``, ``_failure_text``, ``_refused``, ``_abort_peers``,
``_release``), never ``fail``, ``check_usable``, ``guard`` or ``close``. ``CommOptions``: the
settings every communicator takes (second argument; loose keywords override it). The
narrative: docs/design/communicator.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

import torch.distributed as dist

from overlap.defaults import TIMEOUT_S, positive_seconds
from overlap.errors import OverlapError

__all__ = ["Communicator", "CommFailed", "CommOptions"]


class CommFailed(OverlapError, RuntimeError):
    """A call on a communicator that failed earlier (the message carries the first error) or
    was closed. ``TPCommFailed``, ``CPCommFailed``, ``EPCommFailed`` and ``QuantCommFailed``
    derive from it."""


@dataclasses.dataclass(frozen=True)
class CommOptions:
    """Settings a communicator takes. ``timeout``: seconds any wait may take (a slower peer is
    dead); ``backend``: the transport where a communicator has a choice (None: its default);
    ``chunks``: pieces per fused op (TPComm; None: its default); ``check_inputs``: run the
    per-call local input checks (TPComm); ``device``: where the small agreement tensors travel
    (None: the group's device). ``ParallelDims.comm_options(axis)`` makes them per axis."""

    timeout: float = TIMEOUT_S
    backend: str | None = None
    chunks: int | str | None = None
    check_inputs: bool = True
    device: Any = None

    def __post_init__(self):
        positive_seconds(self.timeout, "CommOptions: timeout")

    def merged(self, **given) -> "CommOptions":
        """These options with every keyword that is not None put over them."""
        changes = {k: v for k, v in given.items() if v is not None}
        return dataclasses.replace(self, **changes) if changes else self


def options_of(options: CommOptions | None, who: str, *, where: str = "",
               **given) -> CommOptions:
    """``options`` (default: ``CommOptions()``) with the loose keywords not None put over them.
    A bad ``timeout=`` raises "<who>: timeout must be ...<where>"; options of another type a
    TypeError naming ``who``."""
    if options is None:
        options = CommOptions()
    elif not isinstance(options, CommOptions):
        raise TypeError(f"{who}: options must be an overlap.dist.communicator.CommOptions, got "
                        f"{type(options).__name__}{where}")
    if given.get("timeout") is not None:
        positive_seconds(given["timeout"], f"{who}: timeout", where=where)
    return options.merged(**given)


class Communicator:
    """Group, place, timeout, the fail-once rule and the lifetime of one communicator."""

    failed_type: type[Exception] = CommFailed
    refused_failed = "{op}: communicator failed earlier{where}: {failure}"
    refused_closed = "{op}: the communicator was closed{where}"
    # False where the communicator is kept in a dictionary keyed weakly by its group (the
    # quantized collectives' state): holding the group there would keep it alive for good.
    holds_group = True

    def __init__(self, group: Any, *, timeout: float = TIMEOUT_S):
        self.group = group if self.holds_group else None
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.global_ranks = dist.get_process_group_ranks(group)
        self.timeout = float(timeout)
        self.closed = False
        # The first error as text: an exception object would keep its traceback's frames, and
        # with them the tensors of the failed call (and a group keyed weakly), alive for good.
        self.failure: str | None = None
        self._fail_lock = threading.Lock()  # the caller's thread and async workers both fail

    # -- where: the one description of this rank in messages, " (<place>)"
    def _place(self) -> str:
        """This rank in the group, for messages (hook: a subclass names its axis)."""
        return f"rank {self.rank} of group {self.global_ranks}"

    @property
    def place(self) -> str:
        return self._place()

    @property
    def where(self) -> str:
        return f" ({self._place()})"

    # -- the failure rule
    @property
    def failed(self) -> str | None:
        return self.failure

    def fail(self, exc: BaseException, op: str = "") -> None:
        """Record ``exc`` as the failure (the first one wins) and abort the peers (hook)."""
        with self._fail_lock:
            if self.failure is not None:
                return
            self.failure = self._failure_text(exc, op)
        try:
            self._abort_peers(exc)
        except Exception:  # noqa: BLE001 - the abort is best effort; the first error stands
            pass

    def check_usable(self, op: str) -> None:
        """Raise the subclass's ``CommFailed`` if the communicator failed or was closed."""
        if self.failure is not None or self.closed:
            raise self._refused(op)

    @contextlib.contextmanager
    def guard(self, op: str) -> Iterator[None]:
        """Any error leaving this block fails the communicator (the first error is kept)."""
        try:
            yield
        except BaseException as exc:
            self.fail(exc, op)
            raise

    def close(self, *, wait_for_peers: bool | None = None) -> None:
        """Release the resources once (hook ``_release``). ``wait_for_peers`` (default: unless
        failed): wait, bounded, until the peers let go of this rank's buffers."""
        if self.closed:
            return
        self.closed = True
        self._release(self.failure is None if wait_for_peers is None else wait_for_peers)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- hooks
    def _failure_text(self, exc: BaseException, op: str) -> str:
        return f"{type(exc).__name__}: {exc}"

    def _refused(self, op: str) -> Exception:
        """The error of a call after a failure or a close: ``failed_type`` with the subclass's
        text (``refused_failed`` / ``refused_closed``; fields op, failure, where, place)."""
        text = self.refused_failed if self.failure is not None else self.refused_closed
        return self.failed_type(text.format(op=op, failure=self.failure, where=self.where,
                                            place=self.place))

    def _abort_peers(self, exc: BaseException) -> None:
        """Wake the peers waiting on this rank with the failure (default: nothing to wake)."""

    def _release(self, wait_for_peers: bool) -> None:
        """Free what the communicator holds (default: nothing)."""
