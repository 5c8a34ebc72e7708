"""``nccl_twin``: a torch.distributed backend that runs on gloo but orders operations like NCCL.

It enforces the NCCL rules that matter for deadlocks, in their strictest form: one op at a time
per communicator, in issue order (a lone ``isend``/``irecv`` gets a communicator per rank pair);
a batch completes only when all its ops do; a send completes only once the receiver has started
the matching receive. Every op returns at once; ``work.wait()`` blocks until it has run. A wait
that times out raises ``NcclOrderTimeout`` (naming the op, the communicator and the op it is
stuck behind) and fails the communicator: every later op on it raises that first error.
``OVERLAP_STREAM_DELAY_MS=D`` delays each op by a random 0..D ms; ``recv`` from any source raises.

Use: ``launch(fn, n, backend="nccl_twin")`` (the test harness's default), or :func:`register`
then ``dist.init_process_group("nccl_twin", ...)``; groups from ``dist.new_group`` inherit it.

The narrative: docs/design/dist.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from overlap.dist import host_tensors, streams
from overlap.dist.device import RANKS_PER_GPU_ENV
from overlap.dist.fifo import FifoWorker
from overlap.errors import OverlapError
from overlap.profile import names

__all__ = ["BACKEND", "register", "NcclOrderTimeout", "CommunicatorFailed", "NcclTwinGroup",
           "is_twin"]

BACKEND = "nccl_twin"
_OP_NAME = re.compile(r"[a-z_]+")  # an op's name: the head of its description


class NcclOrderTimeout(OverlapError, RuntimeError):
    """An op did not complete within its timeout under NCCL's ordering rules."""


class CommunicatorFailed(OverlapError, RuntimeError):
    """An op on a communicator that failed earlier (the message carries the first error)."""


def is_twin(group) -> bool:
    return isinstance(group, NcclTwinGroup)


def label(group, axis: str) -> None:
    """Name ``group``'s operations after ``axis`` (one of overlap.profile.names.AXES) in a
    trace: each runs on the twin's worker thread inside a ``comm:<axis>.<op>`` range, so the
    trace readers charge it to its axis (NCCL's device kernels need no label: their launch
    ranges carry it). No effect on a group that is not a twin."""
    if is_twin(group):
        group.axis = axis


# ---------------------------------------------------------------------------------- work


class _Work(dist._Work):
    """The handle of one op (one per P2P op of a batch, all completing together)."""

    def __init__(self, op: "_Op", result: list[torch.Tensor]):
        super().__init__()
        self._op = op
        self._result = result
        self._future: Future | None = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        op = self._op
        seconds = timeout.total_seconds() if timeout else 0.0
        limit = seconds if seconds > 0 else op.comm.timeout
        if not op.done.wait(limit):
            err = NcclOrderTimeout(op.comm.blocked_report(op, limit))
            op.comm.fail(err)  # as NCCL's watchdog aborts the communicator
            raise err
        if op.error is not None:
            raise op.error
        return True

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def is_success(self) -> bool:
        return self._op.done.is_set() and self._op.error is None

    def exception(self):
        return self._op.error

    def result(self) -> list[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> Future:
        with self._op.lock:
            if self._future is None:
                self._future = Future()
                if self._op.done.is_set():
                    self._settle(self._future)
                else:
                    self._op.futures.append((self, self._future))
        return self._future

    def _settle(self, fut: Future) -> None:
        if self._op.error is not None:
            fut.set_exception(self._op.error)
        else:
            fut.set_result(self._result)


# ---------------------------------------------------------------------------------- ops


class _Op:
    """One unit of a communicator's queue: a collective, or a P2P batch of ``items``."""

    def __init__(self, comm: "_Comm", desc: str, *, run: Callable[[], Any] | None = None,
                 items: list[tuple[bool, torch.Tensor, int, int]] | None = None,
                 sizes: list[int] | None = None):
        self.comm, self.desc = comm, desc
        self.run, self.items, self.sizes = run, items, sizes
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.futures: list[tuple[_Work, Future]] = []
        self.issued = time.monotonic()
        self.state = "queued"
        self.seq = 0

    def finish(self, error: BaseException | None = None) -> None:
        with self.lock:
            self.error = error
            self.done.set()
            futures, self.futures = self.futures, []
        for work, fut in futures:
            work._settle(fut)


_POISON = 0xFF  # NaN in every float dtype: what a receive gets from a send of the wrong size


class SizeMismatch(OverlapError, RuntimeError):
    """Ranks passed different sizes to one collective or to a send and its receive."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Comm:
    """One emulated NCCL communicator: a FIFO of ops run one at a time by a worker thread.

    It comes into being as NCCL's does, lazily: the first op a rank issues on it blocks the
    issuing thread until every rank of it (``members``, group ranks) has issued its first op
    on it. Two ranks that first touch two communicators in crossed order wait for each other
    until the timeout, as on NCCL (where they wait forever)."""

    def __init__(self, group: "NcclTwinGroup", name: str, tag_base: int, key: str,
                 members: list[int]):
        self.group, self.name, self.tag_base = group, name, tag_base
        self.timeout = group.timeout
        self._key, self._members = key, members
        self._created = False
        self._creating = threading.Lock()
        self._failed: BaseException | None = None
        self._current: _Op | None = None
        self._issued = 0
        self._delay = streams.InjectedDelay(name)
        self._worker = FifoWorker(f"nccl_twin {name}", self._run_op, self._destroyed_error)

    # -- host side
    def _create(self, op: _Op) -> None:
        """NCCL's lazy communicator creation, on the thread that issues the first op."""
        with self._creating:
            if self._created or not LAZY_CREATION:
                self._created = True
                return
            store, me = self.group.store, self.group.rank()
            store.set(f"{self._key}/{me}", _placement())
            missing = [r for r in self._members if r != me]
            deadline, pause = time.monotonic() + self.timeout, 0.0005
            # Polled, not store.wait: a blocking wait holds the process's store client, and
            # another thread creating another communicator could then not announce itself.
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([f"{self._key}/{r}"])]
                if missing:
                    time.sleep(pause)
                    pause = min(2 * pause, 0.02)
            if missing:
                err = NcclOrderTimeout(
                    f"nccl_twin: {op.desc} (rank {me}): creating {self.name} timed out after "
                    f"{self.timeout:g}s: group rank(s) {missing} never issued their first op "
                    "on it. NCCL creates a communicator when every rank of it issues its first "
                    "op on it, and blocks the issuing thread until then: ranks whose first ops "
                    "on two communicators come in crossed order wait for each other forever. "
                    "Create communicators eagerly, in one order on every rank")
                self.fail(err)
                raise err
            self._refuse_shared_gpu(op)
            self._created = True

    def _refuse_shared_gpu(self, op: _Op) -> None:
        """NCCL refuses a communicator with two ranks of one host on one GPU ("Duplicate GPU
        detected"); with ranks sharing GPUs (OVERLAP_RANKS_PER_GPU > 1) so does the twin, from
        the GPU each rank would take and the NCCL host id it presents."""
        if int(os.environ.get(RANKS_PER_GPU_ENV) or 1) == 1:
            return  # one rank per GPU: LOCAL_RANK tells the GPUs apart
        store = self.group.store
        seen = {r: store.get(f"{self._key}/{r}").decode() for r in self._members}
        by: dict[str, list[int]] = {}
        for r, v in seen.items():
            if not v.endswith("|?"):  # no LOCAL_RANK: no GPU to compare
                by.setdefault(v.split("|", 1)[1], []).append(r)
        dup = next((rs for rs in by.values() if len(rs) > 1), None)
        if dup is not None:
            host, gpu = seen[dup[0]].split("|")[1:]
            err = CommunicatorFailed(
                f"nccl_twin: {op.desc} (rank {self.group.rank()}): creating {self.name}: "
                f"group ranks {dup} both on GPU {gpu} with NCCL host id {host!r}; NCCL refuses "
                "two ranks of one host on one GPU (Duplicate GPU detected). Ranks sharing a "
                "GPU need their own NCCL_HOSTID (overlap.dist.device.sharing_env)")
            self.fail(err)
            raise err

    def submit(self, op: _Op) -> None:
        if not self._created:
            self._create(op)

        def admit() -> bool:  # under the queue's lock: numbering and failure check are atomic
            self._issued += 1
            op.seq = self._issued
            return self._failed is None

        if not self._worker.put(op, admit=admit):
            op.finish(self._failed_error(op, self._failed))

    def _destroyed_error(self, op: _Op) -> CommunicatorFailed:
        return CommunicatorFailed(f"nccl_twin: {op.desc} on {self.name}: the process group was "
                                  "destroyed")

    def _failed_error(self, op: _Op, first: BaseException) -> CommunicatorFailed:
        return CommunicatorFailed(f"nccl_twin: {op.desc} on {self.name} (rank "
                                  f"{self.group.rank()}): the communicator failed earlier: "
                                  f"{first}")

    def fail(self, error: BaseException) -> None:
        """Fail the communicator (as NCCL aborts one): queued and later ops raise ``error``."""
        with self._worker.cv:
            if self._failed is None:
                self._failed = error
            error = self._failed
            queued = self._worker.drain()
        for op in queued:
            op.finish(self._failed_error(op, error))

    def close(self) -> None:
        self._worker.close()

    def blocked_report(self, op: _Op, waited: float) -> str:
        head = self._current
        behind = self._worker.queued()
        msg = (f"nccl_twin: {op.desc} (op #{op.seq} on {self.name}, rank "
               f"{self.group.rank()}) did not complete within {waited:g}s. Under NCCL's "
               "ordering a communicator runs one op at a time in issue order")
        if head is None:
            return msg + "; it is idle, so the op itself failed to start"
        if head is op:
            return msg + f"; this op is running and is {head.state}"
        return (msg + f"; it is stuck at op #{head.seq}: {head.desc}, {head.state}, issued "
                f"{time.monotonic() - head.issued:.1f}s ago, with {len(behind)} op(s) queued "
                "behind it")

    # -- worker side
    def _run_op(self, op: _Op) -> None:
        failed = self._failed
        if failed is not None:
            op.finish(self._failed_error(op, failed))
            return
        self._current = op
        self._delay()
        deadline = time.monotonic() + self.timeout
        axis = self.group.axis
        rng = (torch.profiler.record_function(names.comm(f"{axis}.{_OP_NAME.match(op.desc)[0]}"))
               if axis else contextlib.nullcontext())
        try:
            with rng:
                self._run(op, deadline)
            op.finish()
        except BaseException as exc:  # noqa: BLE001 - the error belongs to the op
            err = exc if isinstance(exc, (NcclOrderTimeout, SizeMismatch)) else RuntimeError(
                f"nccl_twin: {op.desc} on {self.name} (rank {self.group.rank()}) failed: "
                f"{exc}")
            self.fail(err)
            op.finish(err)
        self._current = None  # an idle communicator holds no op (nor what its closure holds)

    def _run(self, op: _Op, deadline: float) -> None:
        if op.run is not None:
            op.state = "waiting for every rank of the group to join"
            if op.sizes is not None:
                self._agree_sizes(op, deadline)
            self._wait(op.run(), deadline, op)
        else:
            self._run_batch(op, deadline)

    def _wait(self, work, deadline: float, op: _Op, why: str | None = None) -> None:
        left = deadline - time.monotonic()
        try:
            ok = work.wait(timedelta(seconds=max(left, 1e-3)))
        except RuntimeError as exc:
            if time.monotonic() >= deadline - 1e-3:
                raise NcclOrderTimeout(f"nccl_twin: {op.desc} on {self.name} (rank "
                                       f"{self.group.rank()}): "
                                       f"{why or f'timed out after {self.timeout:g}s, {op.state}'}"
                                       ) from exc
            raise
        if ok is False:
            raise RuntimeError("the gloo op reported failure")

    def _agree_sizes(self, op: _Op, deadline: float) -> None:
        """gloo kills the process (a receive smaller than the send) or truncates silently
        when ranks pass different sizes, and NCCL hangs or reads garbage: so before a
        collective every rank shares its size vector and all raise if any differ."""
        n = self.group.size()
        mine = torch.tensor(op.sizes, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(n)]
        self._wait(self.group.inner.allgather([every], [mine]), deadline, op)
        rows = [t.tolist() for t in every]
        if op.sizes[0] == _ALLTOALL:  # [kind, dtype, sent to 0..n-1, received from 0..n-1]
            ok = all(rows[i][2 + j] == rows[j][2 + n + i] and rows[i][1] == rows[j][1]
                     for i in range(n) for j in range(n))
        else:
            ok = all(r == rows[0] for r in rows)
        if not ok:
            shown = "; ".join(f"rank {r}: {_describe_sizes(row, n)}" for r, row in
                              enumerate(rows))
            raise SizeMismatch(f"nccl_twin: {op.desc} on {self.name} (rank "
                               f"{self.group.rank()}): ranks disagree on the sizes ({shown}); "
                               "NCCL would hang or read garbage, gloo would abort the process")

    def _tag(self, tag: int, kind: int) -> int:
        # kind: 0 payload, 1 clear-to-send (the receive's byte count), 2 the sender's count
        return (tag * 4 + self.tag_base) * 4 + kind

    def _run_batch(self, op: _Op, deadline: float) -> None:
        inner = self.group.inner
        works, counts = [], []
        # Receives first: post them (and the sender's byte count that precedes the payload),
        # then tell each sender its receive has started and how many bytes it takes.
        for is_send, t, peer, tag in op.items:
            if not is_send:
                theirs = torch.zeros(1, dtype=torch.int64)
                works.append(inner.recv([t], peer, self._tag(tag, 0)))
                counts.append((inner.recv([theirs], peer, self._tag(tag, 2)), theirs, t, peer))
                works.append(inner.send([torch.tensor([_nbytes(t)])], peer, self._tag(tag, 1)))
        # Rendezvous: a payload goes out only after its receiver's clear-to-send token. gloo
        # reports completion only from wait(), so each token is awaited by a thread of its
        # own when there are several (the sends of one batch progress together, as in NCCL).
        sends = [(t, peer, tag) for is_send, t, peer, tag in op.items if is_send]
        errors: list[BaseException] = []
        if sends:
            peers = sorted({peer for _, peer, _ in sends})
            op.state = (f"waiting for rank(s) {peers} to start the matching receive "
                        "(rendezvous send)")
            posted: list = [None] * len(sends)

            def release(i: int) -> None:
                t, peer, tag = sends[i]
                wanted = torch.zeros(1, dtype=torch.int64)
                try:
                    self._wait(inner.recv([wanted], peer, self._tag(tag, 1)), deadline, op,
                               f"rank {peer} did not start the matching receive within "
                               f"{self.timeout:g}s (a send completes only once its receive "
                               "has started)")
                    mine, theirs = _nbytes(t), int(wanted[0])
                    posted[i] = [inner.send([torch.tensor([mine])], peer, self._tag(tag, 2))]
                    if mine == theirs:
                        posted[i].append(inner.send([t], peer, self._tag(tag, 0)))
                        return
                    # gloo would abort the receiver. NCCL delivers what fits of the front of
                    # the message (a larger receive then hangs); so does the twin, with poison
                    # after it, and both sides raise.
                    poison = torch.full((theirs,), _POISON, dtype=torch.uint8)
                    front = min(mine, theirs)
                    poison[:front].copy_(t.reshape(-1).view(torch.uint8)[:front])
                    posted[i].append(inner.send([poison], peer, self._tag(tag, 0)))
                    errors.append(SizeMismatch(
                        f"nccl_twin: {op.desc} on {self.name} (rank {self.group.rank()}): a "
                        f"send of {mine} bytes to group rank {peer}, whose matching receive "
                        f"takes {theirs} bytes; NCCL would truncate, hang or read garbage"))
                except BaseException as exc:  # noqa: BLE001 - reported by the op
                    errors.append(exc)

            # Sends to one peer are released in order (its receives were all posted, and its
            # tokens sent, when its worker reached its batch); sends to different peers
            # progress together, each peer on a thread of its own.
            by_peer: dict[int, list[int]] = {}
            for i, (_, peer, _) in enumerate(sends):
                by_peer.setdefault(peer, []).append(i)

            def release_all(indexes: list[int]) -> None:
                for i in indexes:
                    release(i)

            groups = list(by_peer.values())
            if len(groups) == 1:
                release_all(groups[0])
            else:
                helpers = [threading.Thread(target=release_all, args=(g,), daemon=True)
                           for g in groups]
                for h in helpers:
                    h.start()
                for h in helpers:
                    h.join()
            works += [w for ws in posted if ws for w in ws]
        op.state = "transferring"
        # Every transfer of the batch completes (so no peer is left waiting) before an error.
        for w in works:
            self._wait(w, deadline, op)
        for w, theirs, t, peer in counts:
            self._wait(w, deadline, op)
            if int(theirs[0]) != _nbytes(t):
                errors.append(SizeMismatch(
                    f"nccl_twin: {op.desc} on {self.name} (rank {self.group.rank()}): a "
                    f"receive of {_nbytes(t)} bytes from group rank {peer}, which sent "
                    f"{int(theirs[0])} bytes (the buffer holds what fit of the front of the message, "
                    "then poison, 0xFF bytes); NCCL would truncate, hang or read garbage"))
        if errors:
            raise errors[0]


# ---------------------------------------------------------------------------------- group


def _placement() -> str:
    """"ranks per GPU|NCCL host id|GPU" of this rank as its GPU twin would have them."""
    per_gpu = int(os.environ.get(RANKS_PER_GPU_ENV) or 1)
    local = os.environ.get("LOCAL_RANK")
    gpu = str(int(local) // per_gpu) if local is not None else "?"
    return f"{per_gpu}|{os.environ.get('NCCL_HOSTID', socket.gethostname())}|{gpu}"


def _shapes(tensors) -> str:
    flat = []
    for t in tensors:
        if isinstance(t, (list, tuple)):
            flat.extend(t)
        else:
            flat.append(t)
    return ",".join(f"{tuple(t.shape)}" for t in flat[:4]) + ("..." if len(flat) > 4 else "")


class NcclTwinGroup(dist.ProcessGroup):
    """A process group on gloo with NCCL's ordering (see the module docstring)."""

    axis: str | None = None  # the trace name of its ops (``label``)

    def __init__(self, store, rank: int, size: int, timeout: timedelta, name: str,
                 global_ranks: list[int] | None):
        super().__init__(rank, size)
        self.timeout = timeout.total_seconds()
        self.store = store
        self._name = name
        self.global_ranks = list(global_ranks or range(size))
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        # torch internals that call the C++ backend directly (not this Python group) get a
        # separate plain gloo communicator, so they never interleave with the ordered one.
        self._direct = dist.ProcessGroupGloo(dist.PrefixStore("direct", store), rank, size,
                                             timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               self._direct)
        where = f"group {name!r} (global ranks {self.global_ranks})"
        self.comm = _Comm(self, f"the communicator of {where}", 0, "overlap_twin_init/group",
                          list(range(size)))
        self._pairs: dict[tuple[int, int], _Comm] = {}
        self._pairs_lock = threading.Lock()
        self._where = where

    # pybind trampolines ask for these
    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        return self._name

    def getGroupDesc(self) -> str:
        return self._name

    def _pair(self, peer: int) -> _Comm:
        key = (min(self.rank(), peer), max(self.rank(), peer))
        with self._pairs_lock:
            comm = self._pairs.get(key)
            if comm is None:
                comm = _Comm(self, f"the point-to-point communicator of group ranks {key} in "
                                   f"{self._where}", 1,
                             f"overlap_twin_init/pair/{key[0]}-{key[1]}", list(key))
                self._pairs[key] = comm
        return comm

    def refuse_host(self, what: str, tensors) -> None:
        """NCCL's rule: every tensor of a collective or P2P is device memory (torch raises
        ``No backend type associated with device type cpu`` at the call)."""
        if not host_tensors.STRICT:
            return
        for t in tensors:
            if host_tensors.is_host(t) and not getattr(t, "_is_param", False):
                site = host_tensors.made_at(t)
                made = (f"made on the host at {site}" if site else
                        "computed from a tensor made on the host")
                raise RuntimeError(
                    f"No backend type associated with device type cpu: nccl_twin {what} on "
                    f"{self._where} (rank {self.rank()}) got a host tensor "
                    f"{tuple(t.shape)} {t.dtype}, {made}; NCCL refuses CPU tensors, and this "
                    "group stands for NCCL. Create it on the rank's device (device=...)")

    def _submit(self, comm: _Comm, desc: str, **kw) -> _Op:
        op = _Op(comm, desc, **kw)
        comm.submit(op)
        return op

    def _collective(self, name: str, result: list, run: Callable[[], Any],
                    sizes: list[int] | None = None) -> _Work:
        """Queue ``run`` (it issues the gloo op and returns its work) as one op of the group's
        communicator; ``result`` is what the op's work reports; ``sizes`` (if given) must
        agree across the ranks before the op runs."""
        op = self._submit(self.comm, f"{name}[{_shapes(result)}]", run=run, sizes=sizes)
        return _Work(op, result)

    # -- point to point
    def _check_peer(self, what: str, peer: int) -> None:
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"nccl_twin {what}: peer {peer} is not another rank of "
                             f"{self._where} (this is rank {self.rank()})")

    def send(self, tensors, dstRank: int, tag: int = 0) -> _Work:  # noqa: N803 - torch's name
        self._check_peer("send", dstRank)
        self.refuse_host("send", tensors)
        comm = self._pair(dstRank)
        op = self._submit(comm, f"send{tuple(tensors[0].shape)} to group rank {dstRank}",
                          items=[(True, tensors[0], dstRank, tag)])
        return _Work(op, tensors)

    def recv(self, tensors, srcRank: int, tag: int = 0) -> _Work:  # noqa: N803
        self._check_peer("recv", srcRank)
        self.refuse_host("recv", tensors)
        comm = self._pair(srcRank)
        op = self._submit(comm, f"recv{tuple(tensors[0].shape)} from group rank {srcRank}",
                          items=[(False, tensors[0], srcRank, tag)])
        return _Work(op, tensors)

    def recv_anysource(self, tensors, tag: int = 0):
        raise RuntimeError("nccl_twin: recv from any source is not supported (NCCL has none)")

    def batch(self, p2p_ops: list) -> list[_Work]:
        """``batch_isend_irecv`` on this group: one op on the group's communicator."""
        items, parts = [], []
        for o in p2p_ops:
            is_send = o.op in (dist.isend, dist.send)
            peer = o.group_peer
            self._check_peer("batch_isend_irecv", peer)
            self.refuse_host("batch_isend_irecv", [o.tensor])
            items.append((is_send, o.tensor, peer, o.tag))
            parts.append(f"{'send to' if is_send else 'recv from'} {peer}")
        op = self._submit(self.comm, f"batch_isend_irecv[{', '.join(parts)}]", items=items)
        return [_Work(op, [o.tensor]) for o in p2p_ops]

    # -- lifetime
    def shutdown(self) -> None:
        self.comm.close()
        for c in list(self._pairs.values()):
            c.close()

    def abort(self) -> None:
        self.shutdown()


_ALLTOALL = 1
_ROOTED = ("gather", "scatter", "barrier")  # per-rank arguments differ by design


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _size_vector(name: str, args: tuple, world: int) -> list[int] | None:
    """What every rank must pass alike to collective ``name``: [kind, dtype, bytes...]."""
    if name in _ROOTED:
        return None
    ts = _tensors(args)
    if not ts:
        return None
    dtype = _DTYPES.get(ts[0].dtype, 0)
    if name == "alltoall_base":
        out, inp, out_splits, in_splits = args[:4]
        return [_ALLTOALL, dtype, *_split_bytes(inp, in_splits, world),
                *_split_bytes(out, out_splits, world)]
    if name == "alltoall":
        return [_ALLTOALL, dtype, *(_nbytes(t) for t in args[1]), *(_nbytes(t) for t in args[0])]
    return [0, dtype, sum(_nbytes(t) for t in ts)]


def _split_bytes(t: torch.Tensor, splits, world: int) -> list[int]:
    if not splits:
        return [_nbytes(t) // world] * world
    row = _nbytes(t) // max(1, t.shape[0]) if t.dim() else _nbytes(t)
    return [int(s) * row for s in splits]


def _describe_sizes(row: list[int], world: int) -> str:
    if row[0] == _ALLTOALL:
        return f"sends {row[2:2 + world]} bytes, receives {row[2 + world:]} bytes"
    return f"{row[2]} bytes of dtype #{row[1]}"


_DTYPES = {dt: i + 1 for i, dt in enumerate(
    (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
     torch.int16, torch.int32, torch.int64, torch.bool))}


def _add_collective(name: str, result_of: Callable[[tuple], list], inner: str | None = None
                    ) -> None:
    """``name`` on the twin group runs gloo's ``inner`` (default: the same name) as one op of
    the ordered communicator."""
    def method(self, *args, **kwargs):
        fn = getattr(self.inner, inner or name)
        self.refuse_host(name, _tensors(args))
        return self._collective(name, result_of(args), lambda: fn(*args, **kwargs),
                                _size_vector(inner or name, args, self.size()))

    method.__name__ = name
    setattr(NcclTwinGroup, name, method)


class _Finished:
    """The work of an op its run function already waited for."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


def _sequenced(base: str):
    """gloo has no coalesced tensor collectives (FSDP2 and DTensor call them): run them as
    their per-tensor ops in order, inside one op of the ordered communicator, as one NCCL
    group call would complete them together."""
    def run_all(inner, outputs, inputs, *opts):
        fn = getattr(inner, base)
        for out, inp in zip(outputs, inputs):
            fn(out, inp, *opts).wait()
        return _Finished()
    return run_all


def _add_sequenced(name: str, base: str) -> None:
    impl = _sequenced(base)

    def method(self, outputs, inputs, *opts):
        self.refuse_host(name, _tensors((outputs, inputs)))
        return self._collective(name, list(outputs),
                                lambda: impl(self.inner, outputs, inputs, *opts),
                                _size_vector(name, (outputs, inputs), self.size()))

    method.__name__ = name
    setattr(NcclTwinGroup, name, method)


for _name, _result in {
    "allreduce": lambda a: a[0], "allreduce_coalesced": lambda a: a[0],
    "broadcast": lambda a: a[0], "reduce": lambda a: a[0],
    "allgather": lambda a: a[0][0] if a[0] else [], "allgather_coalesced": lambda a: a[0][0],
    "_allgather_base": lambda a: [a[0]],
    "reduce_scatter": lambda a: a[0], "_reduce_scatter_base": lambda a: [a[0]],
    "alltoall_base": lambda a: [a[0]], "alltoall": lambda a: a[0],
    "gather": lambda a: a[0][0] if a[0] else [], "scatter": lambda a: a[0],
    "barrier": lambda a: [],
}.items():
    _add_collective(_name, _result)
# torch >= 2.12 calls the tensor collectives by these names; gloo has them as the *_base ops.
# (Without these the calls reached the plain gloo backend, outside the ordered communicator.)
_add_collective("all_gather_single", lambda a: [a[0]], "_allgather_base")
_add_collective("reduce_scatter_single", lambda a: [a[0]], "_reduce_scatter_base")
_add_collective("all_to_all_single", lambda a: [a[0]], "alltoall_base")
_add_sequenced("allgather_into_tensor_coalesced", "_allgather_base")
_add_sequenced("reduce_scatter_tensor_coalesced", "_reduce_scatter_base")
_add_sequenced("all_gather_single_coalesced", "_allgather_base")
_add_sequenced("reduce_scatter_single_coalesced", "_reduce_scatter_base")


# ---------------------------------------------------------------------------------- setup


def _create(opts, backend_options) -> NcclTwinGroup:
    return NcclTwinGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                         opts.group_id, list(opts.global_ranks_in_group or []))


# A communicator comes into being when every rank of it has issued its first op on it (NCCL's
# lazy creation); tests switch this off to show the rule is what catches a crossed first touch.
LAZY_CREATION = True
_registered = False
_batch_isend_irecv = dist.batch_isend_irecv


def _batch_isend_irecv_twin(p2p_op_list):
    group = p2p_op_list[0].group if p2p_op_list else None
    if group is None and p2p_op_list:
        group = dist.distributed_c10d._get_default_group()
    if isinstance(group, NcclTwinGroup):
        if any((o.group or dist.distributed_c10d._get_default_group()) is not group
               for o in p2p_op_list):
            raise ValueError("batch_isend_irecv: every op of a batch must use the same group "
                             "(one NCCL communicator runs a batch)")
        return group.batch(p2p_op_list)
    return _batch_isend_irecv(p2p_op_list)


def register() -> None:
    """Register the ``nccl_twin`` backend with torch.distributed (idempotent, per process).

    torch's ``batch_isend_irecv`` only batches for backends that coalesce on a device, so it is
    routed to :meth:`NcclTwinGroup.batch` for twin groups (other groups are untouched)."""
    global _registered
    if _registered:
        return
    host_tensors.install()
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    dist.batch_isend_irecv = _batch_isend_irecv_twin
    dist.distributed_c10d.batch_isend_irecv = _batch_isend_irecv_twin
    _registered = True
