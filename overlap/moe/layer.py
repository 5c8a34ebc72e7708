"""MoE: a mixture-of-experts layer whose experts are sharded over an expert-parallel group.

Legend: ``T`` tokens of this rank, ``d`` hidden size, ``E`` experts, ``El = E / ep`` local
experts (rank r owns experts ``[r*El, (r+1)*El)``), ``k`` experts per token, ``C`` capacity.
``MoE(x [..., d]) -> y [..., d]``; after each forward ``layer.aux`` holds this batch's
load-balancing loss, z-loss and dropped-assignment count (tensors, no host sync).
Capacity mode (``capacity_factor``): ``C = ceil(cf * T * k / E)`` slots per (source rank,
expert); assignments are served slot-major (every token's first choice before any second
choice), then in token order, and those past ``C`` are dropped: static all-to-all splits and
0 host syncs. Dropless mode: exact counts; EP > 1 reads the split sizes on the host once per
forward (the backward reuses them). Every rank of the group must pass the same settings
(checked once, at construction).
The narrative: docs/moe.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from overlap.defaults import align, positive_int
from overlap.moe.comm import BACKENDS, DISPATCH, EPComm
from overlap.moe.exchange import counted_pieces, exchange, static_pieces, wire_row_bytes
from overlap.moe.experts import SwiGLU, SwiGLUExperts, swiglu_grouped
from overlap.moe.router import TopKRouter, load_balancing_loss, z_loss
from overlap.moe.stamps import WORDS, Signature
from overlap.moe.symmetric import Layout, Route, exchange_symmetric

__all__ = ["MoE", "MoEAux", "capacity"]


def _nonfinite_error(per_rank: list[int], rank: int) -> None:
    bad = {r: n for r, n in enumerate(per_rank) if n}
    if bad:
        raise ValueError(f"MoE: NaN or inf router logits (tokens by EP rank: {bad}); the "
                         f"layer's input or router weight is not finite (rank {rank})")


class MoEAux(NamedTuple):
    load_balancing: torch.Tensor  # scalar fp32
    z: torch.Tensor               # scalar fp32
    dropped: torch.Tensor         # scalar int64: assignments past capacity (0 if dropless)
    nonfinite: torch.Tensor | None = None  # scalar int64: tokens with a NaN/inf router logit


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per (source rank, expert) in capacity mode."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


class MoE(nn.Module):
    """Router, SwiGLU experts (sharded over ``comm``'s group) and optional shared experts.

    ``comm``: an EPComm (None: one process holds every expert). ``capacity_factor``: None for
    dropless, else a positive number. ``shared_d_ff``: the FFN size of a dense shared expert
    added to every token's output (None: none)."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *,
                 comm: EPComm | None = None, score: str = "softmax", normalize: bool = True,
                 capacity_factor: float | None = None, shared_d_ff: int | None = None,
                 check_finite: bool = False, device=None, dtype=None):
        super().__init__()
        if comm is not None and not isinstance(comm, EPComm):
            raise TypeError(f"MoE: comm must be an EPComm (or None), got {type(comm).__name__}")
        ep, rank = (comm.world, comm.rank) if comm is not None else (1, 0)
        positive_int(num_experts, "MoE: num_experts")
        if num_experts % ep:
            raise ValueError(f"MoE: num_experts={num_experts} is not divisible by the EP size "
                             f"{ep} (rank {rank})")
        if capacity_factor is not None and not (
                isinstance(capacity_factor, (int, float)) and not isinstance(capacity_factor, bool)
                and capacity_factor > 0 and math.isfinite(capacity_factor)):
            raise ValueError(f"MoE: capacity_factor must be None (dropless) or a positive "
                             f"number, got {capacity_factor!r}")
        if comm is not None and comm.dispatch == "int8" and d_model % comm.quant_block:
            raise ValueError(f"MoE: d_model={d_model} is not a multiple of the EPComm's "
                             f"quant_block={comm.quant_block} (INT8 dispatch scales whole "
                             f"blocks of a row) (rank {rank})")
        self.comm, self.ep, self.ep_rank = comm, ep, rank
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.router = TopKRouter(d_model, num_experts, top_k, score=score, normalize=normalize,
                                 device=device, dtype=dtype)
        # Every expert drawn from the same RNG stream on every rank, then this rank's slice:
        # the same seed gives the shards of the same full layer at any EP size.
        full = SwiGLUExperts.create(num_experts, d_model, d_ff, device=device, dtype=dtype)
        local = slice(rank * (num_experts // ep), (rank + 1) * (num_experts // ep))
        self.experts = SwiGLUExperts(full.w_gate_up.data[local].clone(),
                                     full.w_down.data[local].clone())
        self.experts.first, self.experts.num_total = local.start, num_experts
        self.shared = None if shared_d_ff is None else SwiGLU(d_model, shared_d_ff,
                                                              device=device, dtype=dtype)
        if comm is not None:
            comm.check_same("MoE", d_model=d_model, d_ff=d_ff, num_experts=num_experts,
                            top_k=top_k, capacity=-1.0 if capacity_factor is None
                            else float(capacity_factor), chunks=comm.chunks,
                            dispatch=DISPATCH.index(comm.dispatch),
                            quant_block=comm.quant_block,
                            backend=BACKENDS.index(comm.backend),
                            max_tokens=comm.max_tokens or 0)
        # Its identity in the exchanges' stamps (every rank builds its layers in one order).
        self.layer_id = comm.new_layer() if comm is not None else -1
        self.check_finite = bool(check_finite)
        self.aux: MoEAux | None = None
        self._static_pieces: dict = {}
        self._layout = None
        if comm is not None and comm.backend == "symmetric" and ep > 1:
            self._layout = self._symmetric_layout(self.experts.w_gate_up.dtype)
            comm.reserve(self._layout.nbytes(ep), self.experts.w_gate_up.device)

    def _symmetric_layout(self, dtype: torch.dtype) -> Layout:
        """The worst case of ``max_tokens`` tokens per rank: dropless, every token's k choices
        can go to one owner (at most min(k, El) of them); capacity mode, El * C slots."""
        el, t = self.num_local, self.comm.max_tokens
        if self.capacity_factor is None:
            rows = t * min(self.top_k, el)
        else:
            rows = el * capacity(t, self.top_k, self.num_experts, self.capacity_factor)
        act = self.d_model * dtype.itemsize
        wire = wire_row_bytes(self.comm, self.d_model, dtype)
        return Layout(rows, el, align(max(act, wire), 16), align(act, 16))

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"MoE: input last dim must be {self.d_model}, got shape "
                             f"{tuple(x.shape)} (rank {self.ep_rank})")
        x2 = x.reshape(-1, self.d_model)
        t, k, e = x2.shape[0], self.top_k, self.num_experts
        if self._layout is not None and t > self.comm.max_tokens:
            reason = (f"{t} tokens on rank {self.ep_rank} exceed the EPComm's max_tokens="
                      f"{self.comm.max_tokens}")
            self.comm.fail(ValueError(reason))  # the peers' waits end now, with this reason
            raise ValueError(f"MoE: {reason} (the symmetric buffers hold that many tokens per "
                             f"rank per call; the communicator is now failed on every rank)")
        routing = self.router(x2)
        # The expert weights come out of the experts' forward, so wrappers that intercept a
        # module's forward (parallelize's TP gradient sums) see their use.
        w = self.experts()
        nonfinite = (~torch.isfinite(routing.logits)).any(1).sum()
        # Dropless over the chunked backend reads the counts on the host anyway: the flag
        # rides along (no extra sync). Elsewhere only on request (one host read).
        carried = self.capacity_factor is None and self.ep > 1 and self._layout is None
        if self.check_finite and not carried:
            self._raise_if_nonfinite(nonfinite)
        # Assignments in priority order: slot-major (all first choices, then all second...),
        # then token order. ``tok[i]`` is the token of assignment i.
        flat_e = routing.experts.t().reshape(-1)
        flat_w = routing.weights.t().reshape(-1)
        tok = torch.arange(t, device=x2.device).repeat(k)
        if self.capacity_factor is not None:
            gathered, dropped, shared = self._capacity(x2, flat_e, tok, t, w)
        else:
            (gathered, shared), dropped = (self._dropless(x2, flat_e, tok, nonfinite, w),
                                           flat_e.new_zeros(()))
        weighted = (gathered.float() * flat_w.unsqueeze(1)).to(x2.dtype)
        out = x2.new_zeros(t, self.d_model).index_add(0, tok, weighted)
        if self.shared is not None:  # computed under the dispatch at EP > 1
            out = out + (shared if shared is not None else self.shared(x2))
        self.aux = MoEAux(load_balancing_loss(routing, e), z_loss(routing), dropped, nonfinite)
        return out.reshape(x.shape)

    # -- capacity mode: static shapes, no host sync
    def _capacity(self, x2, flat_e, tok, t, w):
        e, d = self.num_experts, self.d_model
        c = capacity(t, self.top_k, e, self.capacity_factor)
        # scatter_, not F.one_hot: one_hot checks its input's range on the host (a sync on CUDA)
        onehot = torch.zeros(flat_e.shape[0], e, dtype=torch.int64,
                             device=flat_e.device).scatter_(1, flat_e.unsqueeze(1), 1)
        pos = (onehot.cumsum(0) * onehot).sum(1) - 1  # place of each assignment in its expert
        keep = pos < c
        dest = torch.where(keep, flat_e * c + pos, torch.full_like(pos, e * c))  # e*c: dropped
        if self._layout is not None:  # the send gathers each slot's token itself
            slot_token = torch.full((e * c + 1,), -1, dtype=torch.int64,
                                    device=x2.device).scatter_(0, dest, tok)[:e * c]
            y, shared = self._symmetric_static(x2, slot_token, c, w)
        else:
            slots = x2.new_zeros(e * c + 1, d).index_add(0, dest, x2[tok])[:e * c]
            y, shared = self._experts_static(slots, c, x2, w)
        y = torch.cat([y, y.new_zeros(1, d)])
        return y[dest], (~keep).sum(), shared

    def _symmetric_static(self, x2, slot_token, c, w):
        el, ep = self.num_local, self.ep
        key = ("symmetric", c, x2.device)
        static = self._static_pieces.get(key)
        if static is None:  # owner, place and counts of every slot: built once per capacity
            at = torch.arange(self.num_experts * c, device=x2.device)
            static = self._static_pieces[key] = (
                at // (el * c), at % (el * c),
                torch.full((ep, el), c, dtype=torch.int64, device=x2.device))
        return exchange_symmetric(x2, *w, Route(slot_token, *static, self._layout), self.comm,
                                  swiglu_grouped, local=self.shared, local_x=x2,
                                  layer=self.layer_id, dropless=False)

    def _experts_static(self, slots, c, x2, w):
        el, ep = self.num_local, self.ep
        if ep == 1:
            offsets = torch.arange(1, el + 1, device=slots.device, dtype=torch.int32) * c
            return swiglu_grouped(slots, *w, offsets), None
        key = (ep, el, c, self.comm.chunks, slots.device)
        pieces = self._static_pieces.get(key)
        if pieces is None:  # static shapes: built once per (tokens, capacity)
            pieces = self._static_pieces[key] = static_pieces(ep, el, c, self.comm.chunks,
                                                              slots.device)
        return exchange(slots, *w, pieces, self.comm,
                        swiglu_grouped, local=self.shared, local_x=x2, layer=self.layer_id)

    # -- dropless mode: exact counts
    def _raise_if_nonfinite(self, nonfinite: torch.Tensor) -> None:
        """One host read (and at EP > 1 one small all-gather): the same ValueError on every
        rank of the group if any rank's router saw a NaN or inf logit."""
        if self.comm is None or self.ep == 1:
            every = [int(nonfinite)]
        else:
            every = self.comm.all_gather_ints(nonfinite, op="MoE router check")
        _nonfinite_error(every, self.ep_rank)

    def _dropless(self, x2, flat_e, tok, nonfinite, w):
        n = flat_e.shape[0]
        key = flat_e * n + torch.arange(n, device=flat_e.device)
        order = torch.argsort(key)                   # by expert, priority order inside
        # index_add_, not bincount: CUDA's bincount reads the input's max on the host
        counts = torch.zeros(self.num_experts, dtype=torch.int64,
                             device=flat_e.device).index_add_(0, flat_e, torch.ones_like(flat_e))
        y_sorted, shared = self._experts_dropless(tok[order], counts, x2, flat_e[order],
                                                  nonfinite, w)
        return y_sorted[torch.argsort(order)], shared

    def _experts_dropless(self, token, counts, x2, experts_sorted, nonfinite, w):
        """``token``: the token of each assignment, in expert order."""
        el, ep = self.num_local, self.ep
        if self._layout is not None and ep > 1:  # every index on the device: no host sync
            per_owner = counts.view(ep, el)
            totals = per_owner.sum(1)
            owner = experts_sorted // el
            place = torch.arange(token.shape[0], device=x2.device) - (
                totals.cumsum(0) - totals)[owner]
            return exchange_symmetric(x2, *w,
                                      Route(token, owner, place, per_owner, self._layout),
                                      self.comm, swiglu_grouped, local=self.shared, local_x=x2,
                                      layer=self.layer_id, dropless=True)
        rows = x2[token]
        if ep == 1:
            return swiglu_grouped(rows, *w, counts.cumsum(0).to(torch.int32)), None
        # Counts per (source, local expert), then on the host: the one declared host sync of
        # the dropless EP forward (NCCL's uneven all_to_all takes host split sizes).
        # The next column carries this rank's non-finite token count to every peer, the last
        # WORDS this call's stamp (compared on the host, where the counts are read anyway).
        tick = self.comm.stamps.begin("moe counts",
                                      Signature(self.layer_id, self.num_experts, True, 0),
                                      self.d_model, x2.dtype, 0, x2.device)
        send = torch.cat([counts.view(ep, el), nonfinite.view(1, 1).expand(ep, 1),
                          tick.send[:WORDS].view(1, WORDS).expand(ep, WORDS)], 1)
        recv = self.comm.all_to_all(send.reshape(-1), None, None, op="moe counts")
        both = torch.stack([send, recv.view(ep, el + 1 + WORDS)]).tolist()
        self.comm.stamps.check_host(tick, {q: row[el + 1:] for q, row in enumerate(both[1])
                                           if q != self.ep_rank})
        _nonfinite_error([row[el] for row in both[1]], self.ep_rank)
        send_n, recv_n = [[row[:el] for row in side] for side in both]
        pieces = counted_pieces(send_n, recv_n, self.comm.chunks, rows.device)
        return exchange(rows, *w, pieces, self.comm,
                        swiglu_grouped, local=self.shared, local_x=x2, layer=self.layer_id)
