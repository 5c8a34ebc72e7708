"""Bucket sizes planned from the measured backward and a measured link: ``bucket_cap_mb="auto"``.

A fixed byte cap is a guess that trades two costs: small buckets start communication early in
the backward but pay the per-collective latency many times; large ones pay it once but start
late, so their communication is exposed after the backward. With the gradient-ready timeline
of one real backward and a two-parameter link model (a collective of ``b`` bytes takes
``alpha + beta * b`` seconds, issued in order, one at a time) the best split of the ready-order
parameter sequence into contiguous buckets is an exact dynamic program:

    end[0] = 0
    end[j] = min over i < j of  max(ready[j-1], end[i]) + alpha + beta * bytes(i..j-1)

``end[i]`` is the earliest time the first ``i`` parameters' communication can be complete when
the last bucket is ``i..j-1``: a bucket launches when its last gradient is ready and the
previous collective is done. ``end[n]`` is when the reduction ends; the exposed part is
``end[n] - ready[n-1]``. A bucket never spans two dtypes (it is one slice of one flat buffer).
O(n^2) in the number of parameters, run once on DP rank 0 and broadcast so every rank buckets
identically.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["plan_bucket_sizes", "measure_link"]


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
