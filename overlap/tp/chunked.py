"""Chunked backend: portable collective matmuls built from async ``torch.distributed`` calls.

Works unchanged on gloo (CPU) and NCCL (GPU); every function takes 2-D, already validated
inputs (overlap.tp.ops validates, reshapes and differentiates). all_gather_matmul and
matmul_reduce_scatter are rings whose next transfer is in flight while a piece is multiplied;
matmul_all_reduce is the reduce-scatter ring then a ring all-gather (two ranks: one exchange of
the partial products); ``chunks=1`` runs the whole collective then the whole GEMM. Each call's
stamp rides in its first hop (chunks=1: a fixed-size all-gather beside the collective) and is
compared before received data is used; on plain gloo, which kills the process when a message
outgrows its receive, only a call of the last call's sizes does so (else the stamps go first).
The protocol in full: docs/design/tp.md.

Shape legend (per rank; ``world`` ranks in ``group``, ``r`` = this rank):
    m = rows of one rank's shard, M = world * m, K = reduction dim, N = output columns,
    s = chunks // world = pieces per shard (>= 1; at most m).
"""

from __future__ import annotations

import ctypes
import functools
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from overlap.defaults import kept
from overlap.dist.device import plain_gloo
from overlap.dist.stamp import STAMP_WORDS, Agreement, Disagreement
from overlap.profile import nvtx
from overlap.profile.timers import comm_wait
from overlap.tp.autochunk import EXCLUDED
from overlap.tp.collectives import (post_all_gather, post_all_reduce, post_reduce_scatter,
                                    wait_limit)

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "split_bounds"]


@functools.lru_cache(maxsize=1024)
def split_bounds(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``parts`` contiguous [lo, hi) ranges covering 0..n, sizes differing by at most one
    (memoised: every call of a shape asks again)."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _ring_rows(rank: int, world: int, m: int, pieces: tuple[tuple[int, int], ...]
               ) -> tuple[tuple[int, int], ...]:
    """all_gather_matmul's rows of ``gathered`` per ring step: step t holds piece t % s of rank
    (rank - t // s)'s shard (our own pieces first)."""
    return tuple((src + lo, src + hi) for src in ((rank - j) % world * m for j in range(world))
                 for lo, hi in pieces)


_STAMP_TAG = 1 << 20  # apart from the pieces' tags (the step numbers)
_STAMP_BYTES = STAMP_WORDS * 8


def _header_elems(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that hold a stamp at the front of a message."""
    return _STAMP_BYTES // dtype.itemsize


def _message(like: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(message, body): a flat buffer of ``like``'s dtype holding a stamp (its first
    ``_STAMP_BYTES``), then ``rows x cols`` elements, and the 2-D view of that body."""
    hdr = _header_elems(like.dtype)
    msg = like.new_empty(hdr + rows * cols)
    return msg, msg.as_strided((rows, cols), (cols, 1), msg.storage_offset() + hdr)


_SCRATCH = "scratch"  # Agreement.transport key of the kept scratch (overlap.defaults.kept)


def _scratch(agree: Agreement | None, key: tuple, make: Callable[[], tuple]) -> tuple:
    """``make()``'s buffers, kept per communicator when small (``defaults.kept``); made anew
    every call without stamps."""
    if agree is None:
        return make()
    store = agree.transport.get(_SCRATCH)
    if store is None:
        store = agree.transport[_SCRATCH] = {}
    return kept(store, key, make)


def _gather_views(like: torch.Tensor, hdr: int, world: int, m: int, k: int, lo: int, hi: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                             torch.Tensor | None]:
    """(flat, gathered, landing, received): ``hdr`` elements of room for a stamp, then
    ``gathered`` [world * m, k]; with a stamp (``hdr`` > 0) also the first hop's landing (the
    piece at rows [lo, hi) behind the stamp) and that piece's rows."""
    flat = like.new_empty(hdr + world * m * k)
    gathered = flat.as_strided((world * m, k), (k, 1), flat.storage_offset() + hdr)
    if not hdr:
        return flat, gathered, None, None
    return flat, gathered, flat[lo * k:hdr + hi * k], gathered[lo:hi]


class _First:
    """The first hop of a call with stamps: the message to the right neighbour carries this
    rank's stamp in front of the piece, the one from the left carries the left neighbour's;
    the other peers' stamps travel in tiny messages of the same batch (none at world 2). A
    size mismatch still delivers the front of a message (NCCL's receives keep the prefix;
    nccl_twin does the same), so the stamps name a disagreement the transport reports only as
    a byte count. On CPU the stamp bytes move with ``ctypes.memmove`` between buffers whose
    size is known (a tensor op per move costs more than the whole stamp); on a GPU they are
    device copies in stream order. ``send``'s front is where this rank's stamp is written."""

    __slots__ = ("agree", "send", "recv", "cpu", "recv_ptr")

    def __init__(self, agree: Agreement, send: torch.Tensor, recv: torch.Tensor):
        self.agree, self.send, self.recv, self.cpu = agree, send, recv, not agree.device_path
        if self.cpu:
            ctypes.memmove(send.data_ptr(), agree.send_address, _STAMP_BYTES)
            self.recv_ptr = recv.data_ptr()
            ctypes.memset(self.recv_ptr, 0, _STAMP_BYTES)  # no stale stamp passes for this one
        else:
            _words(send).copy_(agree.send)
            _words(recv).zero_()

    def matches(self) -> bool:
        """CPU: whether the stamp in front of the received message equals this call's (a
        byte compare where it landed; the caller lands and verifies otherwise)."""
        return (ctypes.string_at(self.recv_ptr, _STAMP_BYTES)
                == ctypes.string_at(self.agree.send_address, _STAMP_BYTES))

    def land(self, left: int) -> None:
        """Copy the left neighbour's stamp to where ``Agreement.verify`` reads it."""
        if self.cpu:
            ctypes.memmove(self.agree.recv_address(left), self.recv_ptr, _STAMP_BYTES)
        else:
            self.agree.recv[left].copy_(_words(self.recv))


def _words(msg: torch.Tensor) -> torch.Tensor:
    return msg[:_header_elems(msg.dtype)].view(torch.int64)


def _exchange(topo: _Topology, send: torch.Tensor | None, recv: torch.Tensor | None,
              tag: int, agree: Agreement | None = None) -> list:
    """Send ``send`` to the right neighbour and receive ``recv`` from the left one as one
    batch; with ``agree`` (the first hop: ``send`` and ``recv`` are a :class:`_First`'s, with
    the neighbours' stamps in front), also this call's stamp to and from every other peer."""
    group = topo.group
    if agree is not None and len(topo.peers) > 1:
        # A row left from an earlier call must not pass for this one (the left neighbour's
        # row is rewritten from the message, whatever arrived).
        agree.clear_received()
    if topo.direct:
        # gloo: torch's batch_isend_irecv only loops over isend/irecv there, each paying
        # c10d's argument handling; the group's own send/recv do the same transfers.
        works = []
        if send is not None:
            works.append(group.send([send], topo.right, tag))
        if recv is not None:
            works.append(group.recv([recv], topo.left, tag))
        if agree is not None:
            for q in topo.peers:
                if q != topo.right:
                    works.append(group.send([agree.send], q, _STAMP_TAG))
                if q != topo.left:
                    works.append(group.recv([agree.recv[q]], q, _STAMP_TAG))
        return works
    # One batch so NCCL posts the send and the receive together: every rank sends first, and
    # unbatched blocking sends would wait on receives queued behind them.
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, topo.right_global, group, tag))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, topo.left_global, group, tag))
    if agree is not None:
        ops += _stamp_ops(group, agree)
    return dist.batch_isend_irecv(ops) if ops else []


def _stamp_ops(group: dist.ProcessGroup, agree: Agreement) -> list:
    """The stamp messages to and from the peers that are not the neighbours the pieces carry
    them to and from, built once per communicator (the same buffers every call)."""
    cached = agree.transport.get("chunked")
    if cached is None:
        topo, cached = _topology(group), []
        for q in topo.peers:
            peer = dist.get_global_rank(group, q)
            if q != topo.right:
                cached.append(dist.P2POp(dist.isend, agree.send, peer, group, _STAMP_TAG))
            if q != topo.left:
                cached.append(dist.P2POp(dist.irecv, agree.recv[q], peer, group, _STAMP_TAG))
        agree.transport["chunked"] = cached
    return cached


# Plain gloo aborts the process when a message is larger than the receive it meets (its
# transport thread throws; nothing reaches Python), so there no rank may send data its peer has
# not sized for. Every rank records the last agreed call's first message (its bytes; for a
# one-piece call its collective and bytes), the same record on every rank. A *steady* call
# (the same record) carries its stamp in front of its first piece, as on NCCL, or posts its
# one-piece collective beside its stamps; any other call first exchanges its stamp alone, on
# the first hop's channel and tag, into a receive as large as a steady first message, and
# posts its data only once the stamps agree. Equal stamps mean equal sizes, so a steady rank
# and a changed one always disagree, and every message fits the receive it meets.
# docs/design/tp.md, "Plain gloo".
_GLOO_FIRST = "gloo first message"  # Agreement.transport key of that record


def _post_stamps(topo: _Topology, agree: Agreement) -> tuple[list, torch.Tensor | None]:
    """Start the exchange of this call's stamp alone (a fixed 128 bytes): on plain gloo as the
    first hop (see above; returns its works and the receive), elsewhere as an all-gather into
    ``agree.recv``, which the one-piece path issues beside its collective."""
    if topo.direct:
        record = agree.transport.get(_GLOO_FIRST)  # a steady neighbour's first message
        size = max(_STAMP_BYTES, record if isinstance(record, int) else 0)
        landing = _scratch(agree, ("stamps landing", size), lambda: (
            torch.empty(size, dtype=torch.uint8),))[0]
        ctypes.memset(landing.data_ptr(), 0, _STAMP_BYTES)  # no stale stamp passes (host memory)
        return _exchange(topo, agree.send, landing, tag=0, agree=agree), landing
    agree.clear_received()
    return [post_all_gather(agree.recv.view(-1), agree.send, topo.group)], None


def _agree(stamps: tuple[list, torch.Tensor | None], agree: Agreement, *, op: str,
           topo: _Topology, timeout: float, first: int | tuple | None) -> None:
    """Wait for :func:`_post_stamps`' works and compare the stamps (raise on mismatch). On
    plain gloo, record ``first``: the size of this call's stamped first message, or for a
    one-piece call its collective and bytes (None: several messages per neighbour)."""
    works, landing = stamps
    _wait(works, op=op, group=topo.group, timeout=timeout,
          what="exchange of the stamps" + topo.with_peers)
    if landing is not None and agree.device_path:
        agree.recv[topo.left].copy_(landing[:_STAMP_BYTES].view(torch.int64))
    elif landing is not None:  # host memory on both sides
        ctypes.memmove(agree.recv_address(topo.left), landing.data_ptr(), _STAMP_BYTES)
    agree.verify(op, topo.peers)
    if landing is not None:
        agree.transport[_GLOO_FIRST] = first


def _settled_first(topo: _Topology, agree: Agreement | None, first_bytes: int | None, *,
                   op: str, timeout: float) -> Agreement | None:
    """The stamps the first data message carries: ``agree``, or on plain gloo, for a call
    whose stamped first message (``first_bytes``; None: not a one-message first hop) is not
    the size of the last agreed call's, none, once the stamps have been exchanged alone and
    compared."""
    if agree is None or not topo.direct or (
            first_bytes is not None and first_bytes == agree.transport.get(_GLOO_FIRST)):
        return agree
    _agree_first(_post_stamps(topo, agree), agree, op=op, topo=topo, timeout=timeout,
                 first=first_bytes)
    return None


def _agree_first(stamps: tuple[list, torch.Tensor | None], agree: Agreement, *, op: str,
                 topo: _Topology, timeout: float, first: int | tuple | None) -> None:
    """:func:`_agree` before a pieces call's data is posted (plain gloo, a changed call). One
    piece per shard (``first`` not None) does not pay this exchange once steady (its stamps
    ride in the first piece), so a ``chunks="auto"`` race leaves its time out of the call's
    timing; more pieces per shard pay it on every call."""
    t0 = time.perf_counter()
    _agree(stamps, agree, op=op, topo=topo, timeout=timeout, first=first)
    if first is not None:
        agree.transport[EXCLUDED] = (agree.transport.get(EXCLUDED, 0.0)
                                     + time.perf_counter() - t0)


def _wait_first(works: list, first: _First | None, *, op: str, topo: _Topology,
                timeout: float, what: str) -> None:
    """Wait for a call's first hop, then compare the stamps it carried. A transport error
    (ranks whose sizes differ) is reported as the disagreement when the stamps show one."""
    try:
        _wait(works, op=op, group=topo.group, timeout=timeout, what=what)
    except RuntimeError as exc:
        if first is not None:
            first.land(topo.left)
            try:
                first.agree.verify(op, topo.peers, arrived_only=True)
            except Disagreement as named:
                raise named from exc
        raise
    if first is not None:
        if first.cpu and len(topo.peers) == 1 and first.matches():
            return  # the one peer's stamp equals ours: nothing to land or name
        first.land(topo.left)
        first.agree.verify(op, topo.peers)


def _wait(works: list, *, op: str, group: dist.ProcessGroup, timeout: float, what: str) -> None:
    """Wait for ``works`` (each exactly once) within ``timeout`` seconds; a timeout or a peer
    that died surfaces naming the op, the group, this rank and the step."""
    try:
        with comm_wait("tp.chunked"):
            limit = wait_limit(timeout)
            for work in works:
                work.wait(limit)
    except RuntimeError as exc:
        ranks = dist.get_process_group_ranks(group)
        text = str(exc)
        timed_out = any(k in text for k in ("imeout", "imed out", "did not complete within"))
        kind = "timed out" if timed_out else "failed (a peer died or closed its connection)"
        raise RuntimeError(f"tp {op} (chunked): {what} {kind} after at most {timeout:g}s on "
                           f"rank {dist.get_rank(group)} of group {ranks}: {text}") from exc


class _Topology(NamedTuple):
    group: dist.ProcessGroup
    rank: int
    world: int
    right: int  # group ranks of the neighbours
    left: int
    right_global: int  # and their global ranks (what P2POp takes)
    left_global: int
    peers: list[int]  # every other group rank
    direct: bool  # plain gloo: post sends and receives on the group itself
    with_peers: str  # " with peer rank(s) ..." for a wait's error message


_topologies: dict[int, _Topology] = {}


def _topology(group: dist.ProcessGroup) -> _Topology:
    """This rank's place in ``group``, looked up once per group: a dozen c10d queries per call
    were a fifth of the op's host time on tiny shapes."""
    topo = _topologies.get(id(group))
    if topo is None or topo.group is not group:  # an id reused by a newer group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        right, left = (rank + 1) % world, (rank - 1) % world
        direct = plain_gloo(group)
        peers = [q for q in range(world) if q != rank]
        with_peers = f" with peer rank{'s' if len(peers) > 1 else ''} " + ", ".join(map(str, peers))
        topo = _topologies[id(group)] = _Topology(
            group, rank, world, right, left, dist.get_global_rank(group, right),
            dist.get_global_rank(group, left), peers, direct, with_peers)
    return topo


# ---------------------------------------------------------------- one piece (chunks=1)

def _whole_data(agree: Agreement | None, post: Callable[[], object], record: tuple, *,
                op: str, topo: _Topology, timeout: float, stamps=None):
    """Post the one-piece call's collective (``post()`` returns its work) and this call's
    stamps (:func:`_post_stamps`, unless ``stamps`` were posted already). The stamps are in
    flight beside the collective and :func:`_whole_wait` compares them before the data is
    waited for; on plain gloo that holds only for a call of the last agreed call's sizes
    (``record``: the collective and its bytes), and any other call compares them before the
    collective is posted. Returns the stamps still to compare (None once compared or without
    stamps) and the collective's work."""
    if agree is not None and stamps is None:
        stamps = _post_stamps(topo, agree)
    if stamps is not None and topo.direct and agree.transport.get(_GLOO_FIRST) != record:
        # Not left out of a race's timing (:func:`_agree_first`): a steady one-piece call
        # exchanges its stamps too, beside its collective.
        _agree(stamps, agree, op=op, topo=topo, timeout=timeout, first=record)
        stamps = None
    return stamps, post()


def _whole_wait(stamps, work, agree: Agreement | None, record: tuple, *, op: str,
                topo: _Topology, timeout: float, what: str) -> None:
    """Compare the stamps (ranks that disagree raise here, before the data collective is
    waited on: its sizes may differ), then wait for the data."""
    if stamps is not None:
        _agree(stamps, agree, op=op, topo=topo, timeout=timeout, first=record)
    _wait([work], op=op, group=topo.group, timeout=timeout, what=what + topo.with_peers)


def _whole_all_gather(x_shard: torch.Tensor, w: torch.Tensor | None, *, topo, return_gathered,
                      timeout, agree, op):
    m, k = x_shard.shape
    gathered = x_shard.new_empty(topo.world * m, k)
    with nvtx.range(f"{op}.chunked.comm[0]"):
        record = ("all-gather", m * k * x_shard.element_size())
        stamps, work = _whole_data(agree, lambda: post_all_gather(gathered, x_shard,
                                                                  topo.group), record,
                                   op=op, topo=topo, timeout=timeout)
    with nvtx.range(f"{op}.chunked.comm[0].wait"):
        _whole_wait(stamps, work, agree, record, op=op, topo=topo, timeout=timeout,
                    what="all-gather of every rank's shard")
    y = None
    if w is not None:
        with nvtx.range(f"{op}.chunked.gemm[0]"):
            y = gathered @ w
    if agree is not None:
        agree.poison(y, gathered)
    return y, (gathered if return_gathered or w is None else None)


def _whole_reduce(x: torch.Tensor, w: torch.Tensor, *, topo, timeout, agree, op,
                  scatter: bool, overlap_with: Callable[[], None] | None = None
                  ) -> torch.Tensor:
    """One GEMM, then one reduce-scatter (or all-reduce) of it; ``overlap_with`` runs while
    the collective is in flight. The stamps' exchange (fixed size: it cannot mis-pair) is
    posted before the GEMM, so its latency hides under it instead of adding to the call."""
    stamps = None if agree is None else _post_stamps(topo, agree)
    with nvtx.range(f"{op}.chunked.gemm[0]"):
        y = x @ w
    if scatter:
        out = y.new_empty(y.shape[0] // topo.world, y.shape[1])
        post = lambda: post_reduce_scatter(out, y, topo.group)  # noqa: E731
    else:
        out = y
        post = lambda: post_all_reduce(out, topo.group)  # noqa: E731
    with nvtx.range(f"{op}.chunked.comm[0]"):
        record = ("reduce-scatter" if scatter else "all-reduce", y.numel() * y.element_size())
        stamps, work = _whole_data(agree, post, record, op=op, topo=topo, timeout=timeout,
                                   stamps=stamps)
    if overlap_with is not None:
        overlap_with()
    with nvtx.range(f"{op}.chunked.comm[0].wait"):
        _whole_wait(stamps, work, agree, record, op=op, topo=topo, timeout=timeout,
                    what="reduce-scatter" if scatter else "all-reduce")
    if agree is not None:
        agree.poison(out)
    return out


def all_gather_matmul(x_shard: torch.Tensor, w: torch.Tensor | None, *,
                      group: dist.ProcessGroup, chunks: int, return_gathered: bool,
                      timeout: float, agree: Agreement | None = None,
                      op: str = "all_gather_matmul",
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """y [M, N] = all_gather(x_shard [m, K], dim 0) @ w [K, N]; also x [M, K] if asked.
    ``w=None`` only gathers (y is None)."""
    topo = _topology(group)
    rank, world = topo.rank, topo.world
    if world == 1:
        with nvtx.range(f"{op}.chunked.gemm[0]"):
            return (None if w is None else x_shard @ w), (x_shard if return_gathered else None)
    x_shard = x_shard.contiguous()
    if chunks == 1:
        return _whole_all_gather(x_shard, w, topo=topo, return_gathered=return_gathered,
                                 timeout=timeout, agree=agree, op=op)
    m, k = x_shard.shape
    pieces = split_bounds(m, chunks // world)
    s = len(pieces)
    steps = world * s
    trace = nvtx.recording()  # ranges only when something records them
    carry = _settled_first(  # the stamps the first piece carries (None: compared already)
        topo, agree, _STAMP_BYTES + m * k * x_shard.element_size() if s == 1 else None,
        op=op, timeout=timeout)
    keep = return_gathered or w is None  # ``gathered`` is an output: new every call
    # Step t multiplies piece t % s of rank (rank - t // s)'s shard, at these rows of
    # ``gathered``: our own pieces first (straight from the input), then each piece that
    # arrived from the left, which is forwarded to the right s steps before its turn.
    rows = _ring_rows(rank, world, m, pieces)
    # With stamps, the first piece from the left lands in place behind its stamp: ``flat``
    # has room for one stamp in front of ``gathered``, and the stamp of the piece at rows
    # [lo, hi) overwrites the elements just before lo, which belong to sources received at
    # later hops (or to our own shard, copied last): nothing there is read or sent before.
    # Our first piece travels behind our stamp in a message of its own. Neither is an output
    # unless ``keep``: small ones are kept per communicator (:func:`_scratch`).
    hdr = 0 if carry is None else _header_elems(x_shard.dtype)
    lo, hi = rows[s]
    make = lambda: _gather_views(x_shard, hdr, world, m, k, lo, hi)  # noqa: E731
    flat, gathered, landing, received = make() if keep else _scratch(
        carry, ("all_gather_matmul", x_shard.dtype, x_shard.device, hdr, world, m, k, s, rank),
        make)
    first = None  # the first hop's messages, with the neighbours' stamps in front
    if carry is not None:
        plo, phi = pieces[0]
        message, body = _scratch(carry, ("all_gather_matmul send", x_shard.dtype,
                                         x_shard.device, phi - plo, k),
                                 lambda: _message(x_shard, phi - plo, k))
        body.copy_(x_shard if s == 1 else x_shard[plo:phi])
        first = _First(carry, message, landing)
    y = None if w is None else x_shard.new_empty(world * m, w.shape[1])
    views = [x_shard] if s == 1 else [x_shard[a:b] for a, b in pieces]
    views += [None] * (steps - s)  # a received piece's view, made when its receive is posted
    # Every work is waited exactly once (a gloo send work waited twice waits for a second send).
    inflight: list = [None] * steps
    left = (rank - 1) % world
    for t in range(steps):
        works = inflight[t]
        if works is not None:
            with nvtx.range(f"{op}.chunked.comm[{t}].wait") if trace else nvtx.NO_RANGE:
                _wait_first(works, first if t == s else None, op=op, topo=topo,
                            timeout=timeout,
                            what=f"receive of piece {t} from the left neighbour (rank {left})")
        if t + s < steps:
            # Forward this piece and receive the one we multiply s steps from now.
            if t == 0 and first is not None:  # our first piece goes behind our stamp
                send, recv = first.send, landing
                views[s] = received
            else:
                lo, hi = rows[t + s]
                send = views[t]
                recv = views[t + s] = gathered[lo:hi]
            with nvtx.range(f"{op}.chunked.comm[{t + s}]") if trace else nvtx.NO_RANGE:
                inflight[t + s] = _exchange(topo, send, recv, tag=t,
                                            agree=carry if t == 0 else None)
        if w is not None:
            lo, hi = rows[t]
            with nvtx.range(f"{op}.chunked.gemm[{t}]") if trace else nvtx.NO_RANGE:
                torch.matmul(views[t], w, out=y[lo:hi])
    if keep:
        gathered[rank * m:(rank + 1) * m].copy_(x_shard)
    if agree is not None:
        agree.poison(y, gathered if keep else None)
    return y, (gathered if keep else None)


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, *, group: dist.ProcessGroup,
                          chunks: int, timeout: float,
                          overlap_with: Callable[[], None] | None = None,
                          agree: Agreement | None = None,
                          op: str = "matmul_reduce_scatter") -> torch.Tensor:
    """y_shard [m, N] = reduce_scatter(x [M, K] @ w [K, N], dim 0), summed over ranks.

    ``overlap_with`` (e.g. the weight-gradient GEMM of a backward) runs once every GEMM of this
    op is done and only the last hop's transfers are in flight, then the op waits for them."""
    topo = _topology(group)
    rank, world = topo.rank, topo.world
    if world == 1:
        with nvtx.range(f"{op}.chunked.gemm[0]"):
            y = x @ w
        if overlap_with is not None:
            overlap_with()
        return y
    if chunks == 1:
        return _whole_reduce(x, w, topo=topo, timeout=timeout, agree=agree, op=op,
                             scatter=True, overlap_with=overlap_with)
    trace = nvtx.recording()  # ranges only when something records them
    m = x.shape[0] // world
    pieces = split_bounds(m, chunks // world)
    s = len(pieces)
    n = w.shape[1]
    out = None if s == 1 else x.new_empty(m, n)  # one piece: its sum is the output
    carry = _settled_first(  # the stamps the first partial sum carries (None: compared)
        topo, agree, _STAMP_BYTES + m * n * x.element_size() if s == 1 else None,
        op=op, timeout=timeout)
    # piece -> (works of the hop that delivers it, its receive buffer, the tensor that hop
    # sent, kept alive until the works are waited; each work is waited exactly once)
    inflight: dict[int, tuple[list, torch.Tensor, torch.Tensor]] = {}

    first = None  # the first hop's messages, with this call's stamps in front

    def gemm(t: int, out: torch.Tensor | None = None) -> torch.Tensor:
        j, p = divmod(t, s)
        d = (rank - 1 - j) % world
        lo, hi = d * m + pieces[p][0], d * m + pieces[p][1]
        with nvtx.range(f"{op}.chunked.gemm[{t}]") if trace else nvtx.NO_RANGE:
            return torch.matmul(x[lo:hi], w, out=out)

    def add_received(t: int, part: torch.Tensor) -> None:
        works, buf, _sent = inflight.pop(t)
        with nvtx.range(f"{op}.chunked.comm[{t}].wait") if trace else nvtx.NO_RANGE:
            _wait_first(works, first if t == s else None, op=op, topo=topo,
                        timeout=timeout, what=f"receive of partial sum {t} from the left "
                                              f"neighbour (rank {(rank - 1) % world})")
        part += buf

    for t in range((world - 1) * s):
        lo, hi = pieces[t % s]  # piece t + s has the same rows within its block
        if t == 0 and carry is not None:  # the partial sum is computed behind the stamp
            msg_out, part, msg_in, buf = _scratch(carry, (op, "first", x.dtype, x.device,
                                                          hi - lo, n), lambda: (
                *_message(x, hi - lo, n), *_message(x, hi - lo, n)))
            gemm(t, out=part)
            first = _First(carry, msg_out, msg_in)
            send, recv = msg_out, msg_in
        else:
            part = send = gemm(t)
            if t >= s:
                add_received(t, part)
            buf = recv = _scratch(carry, (op, t, x.dtype, x.device, hi - lo, n),
                                  lambda: (x.new_empty(hi - lo, n),))[0]
        with nvtx.range(f"{op}.chunked.comm[{t + s}]") if trace else nvtx.NO_RANGE:
            works = _exchange(topo, send, recv, tag=t, agree=carry if t == 0 else None)
        inflight[t + s] = (works, buf, send)
    # Last step: our own block. Its GEMMs need no data from peers, so they and the caller's
    # extra work run while the final hop's partial sums are still travelling.
    last = [(t, gemm(t)) for t in range((world - 1) * s, world * s)]
    if overlap_with is not None:
        overlap_with()
    for t, part in last:
        add_received(t, part)
        if out is None:
            out = part
        else:
            lo, hi = pieces[t % s]
            out[lo:hi] = part
    if agree is not None:
        agree.poison(out)
    return out


def matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, *, group: dist.ProcessGroup,
                      chunks: int, timeout: float, agree: Agreement | None = None
                      ) -> torch.Tensor:
    """y [M, N] = all_reduce(x [M, K] @ w [K, N]) as a reduce-scatter ring (the GEMMs under
    it) and a ring all-gather of the reduced shards; every rank ends with the same bytes. Two
    ranks exchange their partial products instead (the same bytes in one hop, not two)."""
    op = "matmul_all_reduce"
    topo = _topology(group)
    world = topo.world
    if world == 1:
        with nvtx.range(f"{op}.chunked.gemm[0]"):
            return x @ w
    if chunks == 1:
        return _whole_reduce(x, w, topo=topo, timeout=timeout, agree=agree, op=op,
                             scatter=False)
    if world == 2:
        return _exchange_all_reduce(x, w, topo=topo, blocks=max(1, chunks // 2),
                                    timeout=timeout, agree=agree, op=op)
    rows = x.shape[0]
    m = -(-rows // world)
    if rows % world:  # zero rows make M divisible; they reduce to zeros and are dropped
        x = torch.cat([x, x.new_zeros(m * world - rows, x.shape[1])])
    s = max(1, chunks // world)
    y_shard = matmul_reduce_scatter(x, w, group=group, chunks=s * world, timeout=timeout,
                                    agree=agree, op=op)
    _, y = all_gather_matmul(y_shard, None, group=group, chunks=world, return_gathered=True,
                             timeout=timeout, op=op)
    return y[:rows]


def _exchange_all_reduce(x: torch.Tensor, w: torch.Tensor, *, topo: _Topology, blocks: int,
                         timeout: float, agree: Agreement | None, op: str) -> torch.Tensor:
    """Two ranks: each row block's partial product goes to the peer as soon as its GEMM is done
    (the next block's GEMM runs while it travels), and each rank adds the peer's blocks to its
    own. The bytes per rank equal the reduce-scatter + all-gather ring's (M x N), in one hop
    instead of two: a block carries the rows of one ring piece of each rank (``blocks`` = s),
    and nothing but the last block's transfer is exposed. Both ranks compute a + b with the
    same two operands (IEEE addition commutes), so they hold the same bytes. The first block
    carries the stamps, as a ring's first hop does."""
    peer = topo.peers[0]
    rows, n = x.shape[0], w.shape[1]
    trace = nvtx.recording()  # ranges only when something records them
    bounds = split_bounds(rows, blocks)
    whole = len(bounds) == 1  # one block: no row views, and the sum allocates y
    y = None if whole else x.new_empty(rows, n)
    carry = _settled_first(  # the stamps the first block carries (None: compared already)
        topo, agree, _STAMP_BYTES + rows * n * x.element_size() if whole else None,
        op=op, timeout=timeout)
    first = None
    inflight = []  # (works, received block, own partial, rows, the tensor sent: kept alive)
    for i, (lo, hi) in enumerate(bounds):
        xi, yi = (x, None) if whole else (x[lo:hi], y[lo:hi])
        with nvtx.range(f"{op}.chunked.gemm[{i}]") if trace else nvtx.NO_RANGE:
            if i == 0 and carry is not None:  # the first partial is computed behind the stamp
                send, part, recv, buf = _scratch(carry, (op, "first", x.dtype, x.device,
                                                         hi - lo, n), lambda: (
                    *_message(x, hi - lo, n), *_message(x, hi - lo, n)))
                torch.matmul(xi, w, out=part)
                first = _First(carry, send, recv)
            else:
                part = send = torch.matmul(xi, w, out=yi)
                buf = recv = _scratch(carry, (op, i, x.dtype, x.device, hi - lo, n),
                                      lambda: (x.new_empty(hi - lo, n),))[0]
        with nvtx.range(f"{op}.chunked.comm[{i}]") if trace else nvtx.NO_RANGE:
            works = _exchange(topo, send, recv, tag=i, agree=carry if i == 0 else None)
        inflight.append((works, buf, part, yi, send))
    for i, (works, buf, part, yi, _sent) in enumerate(inflight):
        with nvtx.range(f"{op}.chunked.comm[{i}].wait") if trace else nvtx.NO_RANGE:
            _wait_first(works, first if i == 0 else None, op=op, topo=topo, timeout=timeout,
                        what=f"exchange of partial product block {i} with rank {peer}")
        total = torch.add(part, buf, out=yi)
    if whole:
        y = total
    if agree is not None:
        agree.poison(y)
    return y
