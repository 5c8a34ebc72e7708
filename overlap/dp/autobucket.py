"""Bucket sizes planned from the measured backward and a measured link: ``bucket_cap_mb="auto"``.

Legend: ``ready[j]`` the time parameter j's gradient is ready (in ready order), ``bytes(i..j-1)``
a bucket's size, ``alpha + beta * b`` seconds per collective of ``b`` bytes. The best split into
contiguous buckets is the exact dynamic program::

    end[0] = 0
    end[j] = min over i < j of  max(ready[j-1], end[i]) + alpha + beta * bytes(i..j-1)

A bucket never spans two dtypes. Planned on DP rank 0 and broadcast, so every rank buckets
identically.

The narrative: docs/design/dp.md.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["plan_bucket_sizes", "measure_link", "BucketTuner"]


def plan_bucket_sizes(ready: Sequence[float], nbytes: Sequence[int], dtypes: Sequence,
                      alpha: float, beta: float) -> list[int]:
    """Parameters per bucket, in ready order, minimising the end of the last collective (see
    the module docstring). ``ready``: seconds since the backward started, in the order the
    parameters are laid out; ``nbytes``: each one's gradient bytes."""
    n = len(ready)
    if n == 0:
        return []
    if not (len(nbytes) == len(dtypes) == n):
        raise ValueError("plan_bucket_sizes: ready, nbytes and dtypes must have one entry per "
                         "parameter")
    if alpha < 0 or beta < 0:
        raise ValueError(f"plan_bucket_sizes: alpha and beta must be >= 0, got {alpha}, {beta}")
    r = []
    last = float("-inf")
    for t in ready:  # a bucket is ready when all of its parameters are: use the running max
        last = max(last, float(t))
        r.append(last)
    prefix = [0]
    for b in nbytes:
        prefix.append(prefix[-1] + int(b))
    inf = float("inf")
    end = [0.0] + [inf] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        best, arg = inf, j - 1
        for i in range(j - 1, -1, -1):
            if dtypes[i] != dtypes[j - 1]:
                break  # i..j-1 would span two dtypes
            e = max(r[j - 1], end[i]) + alpha + beta * (prefix[j] - prefix[i])
            if e < best:
                best, arg = e, i
        end[j], cut[j] = best, arg
    sizes = []
    j = n
    while j > 0:
        sizes.append(j - cut[j])
        j = cut[j]
    return sizes[::-1]


@torch.no_grad()
def measure_link(group: dist.ProcessGroup, device: torch.device, nbytes: int, *,
                 reps: int = 3) -> tuple[float, float]:
    """(alpha seconds, beta seconds per byte) of an fp32 all-reduce on ``group``: the medians of
    ``reps`` timed collectives of 1 KiB and of ``nbytes``, fitted to ``alpha + beta * b``.
    Collective over the group (every rank must call it at the same point)."""
    small = torch.zeros(256, dtype=torch.float32, device=device)
    big = torch.zeros(max(nbytes // 4, 512), dtype=torch.float32, device=device)

    def timed(t: torch.Tensor) -> float:
        samples = []
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - t0)
        return sorted(samples)[len(samples) // 2]

    timed(small)  # warm the connection
    t_small, t_big = timed(small), timed(big)
    beta = max(0.0, (t_big - t_small) / (big.numel() * 4 - small.numel() * 4))
    alpha = max(0.0, t_small - beta * small.numel() * 4)
    return alpha, beta


class BucketTuner:
    """The measured half of ``bucket_cap_mb="auto"``: time each candidate bucket layout over a
    few synchronising iterations and keep the fastest, measured, not modelled.

    The link model above is exact for its two parameters, but what a collective costs while
    the backward runs is not what it costs on an idle link: on a GPU the communication kernels
    share SMs and memory bandwidth with the GEMMs, on CPU the reduction threads share the
    cores, and a latency measured idle can be several times too small. So the model's plan is
    only the first candidate; fixed caps that split the gradients into 1, 2, 4, 8 and 16
    buckets (and torch DDP's 25 MiB) follow, duplicates removed.

    The candidates take turns, one iteration each, for ``1 + trials`` rounds: a drift in the
    machine's load then lands on every candidate alike instead of on whichever ran last. The
    first round settles each layout (its first use) and is not timed; the next ``trials`` are
    timed from the backward's first gradient hook to the end of ``finish()``'s wait (device
    events on CUDA, so the comm kernels count; the host clock on CPU). Bucketing changes only
    that window: the forward and the optimizer step do not depend on it.

    The choice is collective: each rank's per-candidate medians are max-reduced over the DP
    group (the slowest rank sets the step time) and every rank takes the same argmin, the
    earlier candidate on a tie. That one all-reduce, and resolving the device timings, are the
    only host syncs, once, at the end of tuning; the steady state after it has none.

    ``start()``/``stop()`` bracket one iteration of candidate ``current``; ``stop()`` returns
    the index of the candidate to install for the next iteration, or ``num_candidates`` once
    every round is done; then ``decide(group)`` returns the winner's index.
    """

    def __init__(self, num_candidates: int, *, trials: int, device: torch.device,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if num_candidates < 1 or trials < 1:
            raise ValueError(f"BucketTuner: num_candidates and trials must be >= 1, got "
                             f"num_candidates={num_candidates}, trials={trials}")
        self.num_candidates = num_candidates
        self.trials = trials
        self.device = device
        self.clock = clock  # the host clock timing CPU iterations (tests pass a fake one)
        self.current = 0
        self.round = 0  # 0 settles each candidate; rounds 1..trials are timed
        self._start = None
        self._samples: list[list] = [[] for _ in range(num_candidates)]
        self.seconds: list[float] | None = None  # per candidate, after decide()

    @property
    def done(self) -> bool:
        return self.round > self.trials

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = self.clock()

    def stop(self) -> int:
        """End one synchronising iteration of candidate ``current``; the index of the
        candidate to install next (``num_candidates`` when every round is done)."""
        if self.done:
            raise RuntimeError("BucketTuner.stop: tuning is over")
        if self.round > 0 and self._start is not None:
            if self.device.type == "cuda":
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._samples[self.current].append((self._start, end))
            else:
                self._samples[self.current].append(self.clock() - self._start)
        self._start = None
        self.current += 1
        if self.current == self.num_candidates:
            self.current = 0
            self.round += 1
        return self.num_candidates if self.done else self.current

    def decide(self, group: dist.ProcessGroup) -> int:
        """Collective over ``group``: the index of the candidate with the smallest
        slowest-rank median window."""
        if not self.done:
            raise RuntimeError("BucketTuner.decide: candidates are still being measured")
        medians = []
        for samples in self._samples:
            if self.device.type == "cuda":
                seconds = []
                for a, b in samples:
                    b.synchronize()
                    seconds.append(a.elapsed_time(b) / 1e3)
            else:
                seconds = samples
            medians.append(statistics.median(seconds) if seconds else float("inf"))
        t = torch.tensor(medians, dtype=torch.float64, device=self.device)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        self.seconds = t.tolist()
        return min(range(self.num_candidates), key=lambda k: (self.seconds[k], k))
