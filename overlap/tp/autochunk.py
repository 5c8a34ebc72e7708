"""``chunks="auto"``: a communicator picks how its ops run by measurement.

Two kinds of call exist: **whole** (``chunks=1``: the whole collective, then the whole GEMM) and
**pieces** (``chunks = world x s``, s = 1, 2, 4: the collective chunk by chunk under the GEMM).
During the communicator's first calls (its race) each (op, shape, count) is timed; then one
all-reduce of each candidate's lower-quartile call (little disturbed by other work, and not a
lucky call or two; the slowest rank's) picks the communicator's kind and each (op, shape)'s
piece count.

Contract: the kind of a call is a function of its call number and of tables every rank holds
alike, so ranks that disagree on a call still post the same kind of transfer and the call's
stamps name the disagreement. The race's all-reduce is its only host sync (tuning only). The
choice changes summation order, not results beyond rounding: pass an int ``chunks`` for
bit-reproducible runs.
The narrative: docs/design/tp.md.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from overlap.tp.collectives import wait

__all__ = ["AUTO", "ChunkRace", "candidates", "TRIALS", "MAX_RACE", "MARGIN", "PIECES_MARGIN"]

AUTO = "auto"
TRIALS = 9  # timed calls per (shape, piece count), after one settling call
MAX_RACE = 256  # calls of one op after which it decides with what it has
MARGIN = 0.05  # pieces beat whole only when this much faster
# A larger piece count beats a smaller one only when this much faster: each piece adds a
# message and a GEMM launch of host work that the race's timing does not see once the host
# runs ahead, and on a shared CPU a count won by 15-18% on noise alone in 3 of 30 choices.
PIECES_MARGIN = 0.15
# Agreement.transport key: seconds of a call spent exchanging its stamps alone before its data
# (plain gloo, a call whose sizes changed: docs/design/tp.md, "Plain gloo"). A race alternates
# kinds, so every race call there pays it, which steady calls of one piece per shard do not
# (their stamps ride in the first piece): the race leaves it out of those. A one-piece call
# exchanges its stamps beside its collective even when steady, so its time keeps them.
EXCLUDED = "race: excluded s"


def candidates(op: str, rows: int, world: int) -> list[int]:
    """Piece counts of a pieces call for an input of ``rows`` rows (the shard's m for
    all_gather_matmul, the full M otherwise): world x s, s = 1, 2, 4, while a piece keeps a
    row."""
    per_rank = rows if op == "all_gather_matmul" else -(-rows // world)
    return [world * s for s in (1, 2, 4) if s <= max(per_rank, 1)]


def _whole_turn(n: int) -> bool:
    """Whether the op's n-th race call runs whole: a fixed pseudo-random bit of n (so shapes
    that alternate do not always land on the same kind), the same on every rank."""
    return ((n * 0x9E3779B1) >> 11) & 1 == 1


def _score(times: list[float]) -> float:
    """A candidate's time: its lower quartile (of TRIALS = 9 calls the third-fastest). Noise on
    a shared machine only adds time, so the fast end is the op's own cost; but a transfer
    pattern that is fast only now and then (a lucky call or two) must not win, so the
    fastest calls are not trusted alone."""
    return sorted(times)[len(times) // 4]


def _fewest(times: dict, key: tuple, cands: list[int]) -> tuple[float, int]:
    """(time, count) of the piece count to use: a larger count (more messages, more host work
    per call) replaces a smaller one only when at least PIECES_MARGIN faster; ``cands``
    ascending."""
    best_t, best_c = times[(key, cands[0])], cands[0]
    for c in cands[1:]:
        t = times[(key, c)]
        if t < (1.0 - PIECES_MARGIN) * best_t:
            best_t, best_c = t, c
    return best_t, best_c


class _Timer:
    __slots__ = ("t0", "start", "end")

    def __init__(self, device: torch.device):
        self.start = self.end = None
        if device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.perf_counter()

    def stop(self):
        if self.start is None:
            return time.perf_counter() - self.t0
        self.end.record()
        return self  # read at the decision (an event sync, tuning only)

    @staticmethod
    def seconds(t) -> float:
        if isinstance(t, float):
            return t
        t.end.synchronize()
        return t.start.elapsed_time(t.end) / 1e3


class ChunkRace:
    """One communicator's race and choice (``comm.auto``): ``begin`` before a call,
    ``finish`` after it; ``report`` holds the decision, its timings and choices."""

    def __init__(self, comm):
        self.comm = comm
        self.calls = 0
        self.entries: dict[tuple, dict] = {}  # (op, shape) -> {"calls", "cands", "turn", "times"}
        self.kind: str | None = None  # "whole" or "pieces" once decided
        self.best: dict[tuple, int] = {}  # (op, shape) -> piece count (pieces kind)
        self.report: dict = {}

    @staticmethod
    def _key(op: str, x: torch.Tensor, w: torch.Tensor) -> tuple:
        return op, tuple(x.shape), tuple(w.shape), x.dtype

    def choice(self, op: str, x: torch.Tensor, w: torch.Tensor) -> int | None:
        """The chunks a call of ``op`` on these shapes uses once decided (None while racing)."""
        if self.kind is None:
            return None
        if self.kind == "whole":
            return 1
        return self.best.get(self._key(op, x, w), self.comm.world)

    def begin(self, op: str, x: torch.Tensor, w: torch.Tensor):
        """(chunks for this call, a token for ``finish`` or None, a timer or None)."""
        done = self.choice(op, x, w)
        if done is not None:
            return done, None, None
        key = self._key(op, x, w)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = {
                "calls": 0, "cands": candidates(op, x.shape[0], self.comm.world), "turn": 0,
                "times": {}}
        if _whole_turn(self.calls):
            chunks = 1
        else:
            chunks = entry["cands"][entry["turn"] % len(entry["cands"])]
            entry["turn"] += 1
        times = entry["times"].get(chunks)
        if times is None:  # the first call of a (op, shape, count) settles, untimed
            entry["times"][chunks] = []
        self._excluded()
        return chunks, key, (None if times is None else _Timer(x.device))

    def _excluded(self) -> float:
        """The seconds the call since the last ``begin`` left out of its timing (EXCLUDED)."""
        agree = self.comm.agree
        return 0.0 if agree is None else agree.transport.pop(EXCLUDED, 0.0)

    def finish(self, key, chunks: int, timer) -> None:
        """After a call that succeeded on every rank (its stamps agreed), so every rank's
        tables are still the same and the decision falls on the same call everywhere."""
        entry = self.entries[key]
        excluded = self._excluded()
        if timer is not None:
            t = timer.stop()
            entry["times"][chunks].append(t - excluded if isinstance(t, float) else t)
        entry["calls"] += 1
        self.calls += 1
        full = all(len(e["times"].get(c, ())) >= TRIALS
                   for e in self.entries.values() for c in [1] + e["cands"])
        if full or self.calls >= MAX_RACE:
            self._decide()

    def _decide(self) -> None:
        # Every rank holds the same entries in the same order (they made the same calls), so
        # the flat vector of scores lines up across ranks; a missing one is +inf.
        rows = [(key, c) for key, e in self.entries.items() for c in [1] + e["cands"]]
        best = torch.tensor(
            [_score([_Timer.seconds(t) for t in self.entries[k]["times"][c]])
             if self.entries[k]["times"].get(c) else float("inf") for k, c in rows],
            dtype=torch.float64, device=self.comm.device)  # NCCL takes device tensors only
        work = dist.all_reduce(best, op=dist.ReduceOp.MAX, group=self.comm.group,
                               async_op=True)  # a race exists only with more than one rank
        wait(work, op="chunks='auto' decision", group=self.comm.group, timeout=self.comm.timeout)
        slowest = dict(zip(rows, best.tolist()))  # the race's one host sync
        inf = float("inf")
        whole = pieces = 0.0
        for key, e in self.entries.items():
            t_whole = slowest[(key, 1)]
            t_pieces, c = _fewest(slowest, key, e["cands"])
            self.best[key] = c if t_pieces != inf else self.comm.world
            if t_whole != inf and t_pieces != inf:
                whole += e["calls"] * t_whole
                pieces += e["calls"] * t_pieces
        # Whole is the unfused order plus a stamp: pieces must win by more than the noise.
        self.kind = "pieces" if pieces < (1.0 - MARGIN) * whole else "whole"
        self.report = {"kind": self.kind, "race_calls": self.calls, "ops": {
            f"{k[0]} x{list(k[1])} w{list(k[2])} {str(k[3]).replace('torch.', '')}": {
                "chunks": 1 if self.kind == "whole" else self.best[k],
                "best_ms": {c: round(slowest[(k, c)] * 1e3, 4)
                            for c in [1] + self.entries[k]["cands"]}}
            for k in self.entries}}
