"""``cp_attention(q, k, v, *, comm, causal, scale=None, method="ring")``: one entry point for
the context-parallel attention methods, with the same contract as ``ring_attention``.

``method``: "ring", "allgather", "ulysses" (heads must split over cp) or "auto". "auto"
measures: on the first call with a shape (``choice_key``) every eligible method runs forward
and backward a few times, interleaved; an all-reduce MAX over the CP group gives each method's
slowest rank, and every rank picks the fastest by those numbers, so all ranks pick the same.
The choice is cached on the communicator (``comm.cp_choices``; the timings in
``comm.cp_timings``); later calls with that shape cost a dict look-up (no sync). One rank (cp
= 1) moves nothing: "ring", unmeasured. The reasoning: docs/design/cp.md.
"""

from __future__ import annotations

import statistics
import time

import torch

from overlap.cp.allgather import allgather_attention
from overlap.cp.comm import CPComm, call_layer, call_scale
from overlap.cp.ring import _validate, ring_attention
from overlap.cp.ulysses import ulysses_attention, ulysses_fits

__all__ = ["cp_attention", "choice_key", "METHODS"]

METHODS = ("ring", "allgather", "ulysses", "auto")
_ATTEND = {"ring": ring_attention, "allgather": allgather_attention,
           "ulysses": ulysses_attention}
_ROUNDS = 3  # timed rounds per method, after one untimed round (allocator, first builds)


def choice_key(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple:
    """The key of "auto"'s choice: (b, h, h_kv, s_local, d, dtype name, causal)."""
    b, h, s, d = q.shape
    return b, h, k.shape[1], s, d, str(q.dtype).replace("torch.", ""), causal


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _measure(q, k, v, comm: CPComm, causal: bool, scale: float, layer: int) -> str:
    """Time every eligible method (forward and backward, interleaved rounds) and agree."""
    eligible = [m for m in _ATTEND if m != "ulysses" or ulysses_fits(q.shape[1], k.shape[1],
                                                                     comm.world)]
    times: dict[str, list[float]] = {m: [] for m in eligible}
    dout = torch.ones_like(q)
    for rnd in range(1 + _ROUNDS):
        for m in eligible:
            qm, km, vm = (t.detach().requires_grad_() for t in (q, k, v))
            t0 = time.perf_counter()
            # Own saved-tensor hooks: inside activation checkpointing the measuring graphs
            # must not be recorded by the checkpoint's hooks (its recomputation, which finds
            # the choice cached, would save fewer tensors and fail).
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                _ATTEND[m](qm, km, vm, comm=comm, causal=causal, scale=scale,
                           layer=layer).backward(dout)
            if q.is_cuda:
                torch.cuda.synchronize()  # the first call of a shape only
            if rnd:
                times[m].append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times[m]) for m in eligible],
                           dtype=torch.float64, device=comm.device)
    op = "cp_attention (auto)"
    with comm.guard(op):
        comm.wait_collective(comm.collective("all_reduce_max", slowest, slowest, op=op,
                                             what="the timings' all-reduce"),
                             op=op, what="the timings' all-reduce")
    agreed = slowest.tolist()  # the first call of a shape only
    comm.cp_timings[choice_key(q, k, causal)] = dict(zip(eligible, agreed))
    return eligible[agreed.index(min(agreed))]


def _choose(q, k, v, comm: CPComm, causal: bool, scale: float, layer: int) -> str:
    key = choice_key(q, k, causal)
    method = comm.cp_choices.get(key)
    if method is None:
        if torch.compiler.is_compiling():
            raise ValueError(f"cp_attention: method=\"auto\" measures on the first call of a "
                             f"shape, which must run eagerly; under torch.compile pass the "
                             f"method comm.cp_choices reports{comm.where}")
        method = "ring" if comm.world == 1 else _measure(q, k, v, comm, causal, scale, layer)
        comm.cp_choices[key] = method
    return method


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: CPComm,
                 causal: bool, scale: float | None = None, method: str = "ring",
                 layer: int = -1) -> torch.Tensor:
    """Attention of this rank's zig-zag rows ``q`` over the whole sequence by ``method``
    (module docstring); q (b, h, s_local, d), k/v (b, h_kv, s_local, d). Differentiable.
    ``layer``: the caller's id of this attention layer (-1: unknown), in every call's stamp."""
    scale = call_scale("cp_attention", q, comm, causal, scale)
    layer = call_layer("cp_attention", layer, comm)
    if method not in METHODS:
        raise ValueError(f"cp_attention: method must be one of {METHODS}, got "
                         f"{method!r}{comm.where}")
    if method == "auto":
        comm.check_usable("cp_attention")
        with comm.guard("cp_attention"):  # bad input fails before anything is measured
            _validate(q, k, v, comm, causal, scale, "auto", "cp_attention")
        method = _choose(q, k, v, comm, causal, scale, layer)
    return _ATTEND[method](q, k, v, comm=comm, causal=causal, scale=scale, layer=layer)
