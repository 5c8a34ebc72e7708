"""Hugging Face sparse-MoE blocks with their experts sharded over an EP group.

Legend: ``T`` tokens of this rank, ``d`` hidden size, ``E`` experts, ``El = E / ep`` local
experts (rank r owns ``[r*El, (r+1)*El)``), ``k`` experts per token, ``f`` expert FFN size.
``ExpertParallelBlock(block, family, comm)`` replaces one transformers sparse block: router and
shared experts stay as they were (replicated), ``experts`` becomes ``ExpertShards`` with the
same parameter names, ``[El, ...]`` where transformers has ``[E, ...]``. Forward: the family's
routing (``MoEFamily.route``, fp32 as transformers computes it), dropless dispatch over the
EPComm (counts exchanged and read once on the host), the family's expert math as grouped
GEMMs, combine, weighted sum. ``tokens="local"``: the EP ranks hold different tokens (EP
carved from the data-parallel ranks; router and shared-expert gradients are this rank's share,
reduced over DP). ``tokens="split"``: they hold the same tokens (EP inside the TP group); each
dispatches its 1/ep of them and the expert outputs are all-gathered before the weighting.
The narrative: docs/design/nn.md ("Mixture-of-experts plans").
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from overlap.moe.comm import EPComm
from overlap.moe.exchange import counted_pieces, exchange
from overlap.moe.experts import grouped_mm
from overlap.moe.stamps import WORDS, Signature
from overlap.nn.regions import gather_from_tp, scatter_to_tp
from overlap.nn.sharding import shard_sizes
from overlap.tp.collectives import all_gather_dim

__all__ = ["MoEFamily", "ExpertShards", "ExpertParallelBlock", "mixtral_route", "qwen_route",
           "deepseek_v3_route", "gpt_oss_route", "swiglu_experts", "gpt_oss_experts",
           "qwen2_moe_shared", "deepseek_v3_shared"]


# ---------------------------------------------------------------- routing, per family
# Each returns (weights [T, k], experts [T, k] int64) exactly as the family's router does:
# the same dtypes, the same order of operations. The logits come from the router module's own
# forward (its first output), so transformers' ``output_router_logits`` still records them.

def mixtral_route(block: nn.Module, x: torch.Tensor):
    """Mixtral: softmax over every expert in fp32, top-k, renormalised (fp32 weights)."""
    gate = block.gate
    probs = F.softmax(gate(x)[0].float(), dim=-1)
    weights, experts = torch.topk(probs, gate.top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def qwen_route(block: nn.Module, x: torch.Tensor):
    """Qwen2-MoE / Qwen3-MoE: fp32 softmax, top-k, renormalised if ``norm_topk_prob``, cast
    back to the logits' dtype."""
    gate = block.gate
    logits = gate(x)[0]
    weights, experts = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), gate.top_k, dim=-1)
    if gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def deepseek_v3_route(block: nn.Module, x: torch.Tensor):
    """DeepSeek-V3: fp32 sigmoid scores; the correction bias takes part in the choice only;
    the best ``topk_group`` of ``n_group`` groups (a group scores its two best experts), top-k
    inside them; weights are the plain scores, renormalised if ``norm_topk_prob``, times
    ``routed_scaling_factor``."""
    gate = block.gate
    e, groups = gate.num_experts, gate.num_group
    scores = gate(x)[0].sigmoid()  # fp32 logits
    choice = scores + gate.e_score_correction_bias
    group_scores = choice.view(-1, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
    keep = keep.unsqueeze(-1).expand(-1, groups, e // groups).reshape(-1, e)
    experts = torch.topk(choice.masked_fill(~keep, float("-inf")), k=gate.top_k, dim=-1,
                         sorted=False)[1]
    weights = scores.gather(1, experts)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * gate.routed_scaling_factor, experts


def gpt_oss_route(block: nn.Module, x: torch.Tensor):
    """GPT-OSS: logits with the router's bias, top-k of the logits, softmax over the k chosen
    (in the logits' dtype)."""
    router = block.router
    top, experts = torch.topk(router(x)[0], router.top_k, dim=-1)  # logits with the bias
    return F.softmax(top, dim=1, dtype=top.dtype), experts


# ---------------------------------------------------------------- experts, per family
# ``fn(x [R, d], w1, w2, offsets [El]) -> [R, d]`` on the weights ``ExpertShards.weights()``
# hands the exchange (what it differentiates).

def swiglu_experts(act: Callable) -> Callable:
    """transformers' fused layout: ``gate_up_proj [El, 2f, d]`` (gate rows, then up rows) and
    ``down_proj [El, d, f]``, both applied as ``F.linear``: ``(act(x Wg^T) * (x Wu^T)) Wd^T``."""
    def fn(x, w_gate_up, w_down, offsets):
        gate, up = grouped_mm(x, w_gate_up.transpose(1, 2), offsets).chunk(2, dim=-1)
        return grouped_mm(act(gate) * up, w_down.transpose(1, 2), offsets)
    return fn


def gpt_oss_experts(alpha: float, limit: float) -> Callable:
    """GPT-OSS: ``gate_up_proj [El, d, 2f]`` with gate and up interleaved column by column,
    ``down_proj [El, f, d]``, each with a bias (packed as the weights' last row here); the
    clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``."""
    def fn(x, w1, w2, offsets):
        d, f = w1.shape[1] - 1, w2.shape[1] - 1
        expert = torch.searchsorted(offsets, torch.arange(x.shape[0], device=x.device,
                                                         dtype=offsets.dtype), right=True)
        h = grouped_mm(x, w1[:, :d].contiguous(), offsets) + w1[:, d][expert]
        gate, up = h[..., ::2].clamp(min=None, max=limit), h[..., 1::2].clamp(-limit, limit)
        a = (up + 1) * (gate * torch.sigmoid(gate * alpha))
        return grouped_mm(a, w2[:, :f].contiguous(), offsets) + w2[:, f][expert]
    return fn


# ---------------------------------------------------------------- shared experts, per family

def qwen2_moe_shared(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


def deepseek_v3_shared(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block.shared_experts(x)


@dataclasses.dataclass(kw_only=True, frozen=True)
class MoEFamily:
    """What one family's sparse block computes, as data. ``route(block, x) -> (weights,
    experts)``; ``experts(block) -> fn`` (the expert math for ``ExpertShards.weights()``);
    ``pack``: the experts' parameter names and how they form the exchange's two weights
    ("linear": ``(gate_up_proj, down_proj)``; "biased": each with its bias as a last row);
    ``shared(block, x)``: the shared experts' output added to every token (None: none);
    ``router``: the router's attribute; ``returns_scores``: the block returns
    ``(out, weights)`` (GPT-OSS); ``jitter``: the block multiplies its input by
    ``router_jitter_noise`` noise in training (Mixtral)."""

    name: str
    route: Callable
    experts: Callable[[nn.Module], Callable]
    pack: str = "linear"
    shared: Callable | None = None
    router: str = "gate"
    returns_scores: bool = False
    jitter: bool = False


class ExpertShards(nn.Module):
    """This rank's ``El`` experts of a transformers experts module: its parameters under the
    same names, cut to ``[first, first + El)`` along dim 0; ``full_state_dict`` gathers them
    over the EP group (the unsharded layout)."""

    ep_sharded = True

    def __init__(self, experts: nn.Module, comm: EPComm, pack: str, tokens: str = "local"):
        super().__init__()
        params = dict(experts.named_parameters(recurse=False))
        total = next(iter(params.values())).shape[0]
        self.comm, self.pack, self.num_total = comm, pack, total
        # how many EP ranks send an expert each of their tokens when all hold the same ones
        # (what a probe run on every rank gives): all of them, or one with tokens split
        self.sources = comm.world if tokens == "local" else 1
        self.num_local = total // comm.world
        self.first = comm.rank * self.num_local
        for name, p in params.items():
            self.register_parameter(name, nn.Parameter(
                p.detach()[self.first:self.first + self.num_local].clone(),
                requires_grad=p.requires_grad))
        for name, child in experts.named_children():  # the activation (no parameters)
            self.add_module(name, child)
        for attr in ("alpha", "limit"):
            if hasattr(experts, attr):
                setattr(self, attr, getattr(experts, attr))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two tensors the exchange differentiates (views or packs of the parameters)."""
        if self.pack == "biased":
            return (torch.cat([self.gate_up_proj, self.gate_up_proj_bias.unsqueeze(1)], 1),
                    torch.cat([self.down_proj, self.down_proj_bias.unsqueeze(1)], 1))
        return self.gate_up_proj, self.down_proj

    def forward(self):
        # Through forward, so module hooks (parallelize's probes) see the experts being used.
        return self.weights()

    def full_state_dict(self, prefix: str = "", *, grads: bool = False) -> dict:
        """Unsharded parameters (or gradients, zeros where None), keyed like the source module.
        Collective over the EP group."""
        out = {}
        for name, p in self.named_parameters(recurse=False):
            t = p if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
            out[prefix + name] = all_gather_dim(t.detach(), 0, group=self.comm.group,
                                                op="gather experts", timeout=self.comm.timeout)
        return out


class ExpertParallelBlock(nn.Module):
    """A transformers sparse-MoE block whose experts are sharded over ``comm``'s group.
    Children keep their names (state-dict keys are the block's); ``source`` names the class
    it replaced. ``tokens``: "local" (each EP rank its own tokens) or "split" (the EP ranks
    hold the same tokens, as TP ranks do)."""

    def __init__(self, block: nn.Module, family: MoEFamily, comm: EPComm, *,
                 tokens: str = "local"):
        super().__init__()
        if not isinstance(comm, EPComm):
            raise TypeError(f"ExpertParallelBlock: comm must be an EPComm, got "
                            f"{type(comm).__name__}")
        if tokens not in ("local", "split"):
            raise ValueError(f"ExpertParallelBlock: tokens must be 'local' or 'split', got "
                             f"{tokens!r}")
        w1, w2 = (p for _, p in zip(range(2), block.experts.parameters(recurse=False)))
        if w1.shape[0] % comm.world:
            raise ValueError(f"ExpertParallelBlock: {w1.shape[0]} experts of a "
                             f"{type(block).__name__} are not divisible by the EP size "
                             f"{comm.world} (rank {comm.global_rank})")
        comm.check_same(f"ExpertParallelBlock({type(block).__name__})",
                        num_experts=w1.shape[0], w1_numel=w1.numel(), w2_numel=w2.numel())
        for name, child in block.named_children():
            self.add_module(name, ExpertShards(child, comm, family.pack, tokens)
                            if name == "experts" else child)
        self.family, self.comm, self.source = family, comm, type(block).__name__
        self.split = tokens == "split" and comm.world > 1
        self.layer_id = comm.new_layer()  # its identity in the exchanges' stamps
        self.jitter_noise = getattr(block, "jitter_noise", 0.0) if family.jitter else 0.0
        self._fn = family.experts(block.experts)
        # the shared experts run while the dispatch is in flight (not a registered child: its
        # parameters are the block's own children's)
        self.__dict__["_shared"] = _Shared(self, family.shared) if family.shared else None

    def extra_repr(self) -> str:
        return (f"family={self.family.name}, experts {self.experts.first}.."
                f"{self.experts.first + self.experts.num_local - 1} of {self.experts.num_total}"
                f", ep={self.comm.world}")

    def forward(self, hidden_states: torch.Tensor):
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, as it draws it
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, experts = self.family.route(self, x)
        t, k = experts.shape
        # assignments slot-major (every token's first choice, then its second...), as MoE does
        flat_e = experts.t().reshape(-1)
        token = torch.arange(t, device=x.device).repeat(k)
        source = x
        if self.split:  # this rank dispatches its slice of the (replicated) tokens
            sizes = shard_sizes(t, self.comm.world)
            start = sum(sizes[:self.comm.rank])
            slices = [self._assignments(t, k, sum(sizes[:r]), sizes[r], x.device)
                      for r in range(self.comm.world)]
            mine = slices[self.comm.rank]
            flat_e, token = flat_e[mine], token[mine] - start
            # backward: every rank's slice of the input gradient, gathered (replicated again)
            source = scatter_to_tp(x, 0, group=self.comm.group, sizes=sizes,
                                   timeout=self.comm.timeout)
        n = flat_e.shape[0]
        order = torch.argsort(flat_e * n + torch.arange(n, device=x.device))  # by expert
        counts = torch.zeros(self.experts.num_total, dtype=torch.int64,
                             device=x.device).index_add_(0, flat_e, torch.ones_like(flat_e))
        y_sorted, shared = self._experts(source[token[order]], counts, x)
        y = y_sorted[torch.argsort(order)]
        if self.split:  # every rank's slice, then back to slot-major order over all tokens
            y = gather_from_tp(y, 0, group=self.comm.group,
                               sizes=[size * k for size in sizes], timeout=self.comm.timeout)
            y = y[torch.argsort(torch.cat(slices))]
            token = torch.arange(t, device=x.device).repeat(k)
        w = weights.t().reshape(-1, 1)
        out = torch.zeros_like(x).index_add_(0, token, (y * w).to(x.dtype))
        if self._shared is not None:
            out = out + shared
        out = out.reshape(shape)
        return (out, weights) if self.family.returns_scores else out

    @staticmethod
    def _assignments(t: int, k: int, start: int, n: int, device) -> torch.Tensor:
        """Slot-major positions of the assignments of tokens [start, start + n)."""
        slots = torch.arange(k, device=device).unsqueeze(1) * t
        return (slots + torch.arange(start, start + n, device=device)).reshape(-1)

    def _experts(self, rows, counts, x):
        w1, w2 = self.experts()
        ep, el = self.comm.world, self.experts.num_local
        if ep == 1:
            shared = self._shared(x) if self._shared is not None else None
            return self._fn(rows, w1, w2, counts.cumsum(0).to(torch.int32)), shared
        # The dropless exchange's one host read: the split sizes (NCCL takes them on the host),
        # each destination's followed by this call's stamp (compared there, on the host).
        sign = Signature(self.layer_id, self.experts.num_total, True, 0)
        tick = self.comm.stamps.begin("moe counts", sign, x.shape[-1], rows.dtype, 0,
                                      rows.device)
        stamp = tick.send[:WORDS].view(1, WORDS).expand(ep, WORDS)
        send = torch.cat([counts.view(ep, el), stamp], 1)
        recv = self.comm.all_to_all(send.reshape(-1), None, None, op="hf moe counts")
        both = torch.stack([send, recv.view(ep, el + WORDS)]).tolist()
        self.comm.stamps.check_host(tick, {q: row[el:] for q, row in enumerate(both[1])
                                           if q != self.comm.rank})
        send_n, recv_n = [[row[:el] for row in side] for side in both]
        pieces = counted_pieces(send_n, recv_n, self.comm.chunks, rows.device)
        return exchange(rows, w1, w2, pieces, self.comm, self._fn, local=self._shared,
                        local_x=x, layer=self.layer_id)


class _Shared(nn.Module):
    """The shared experts as one callable module (what the exchange runs under the dispatch
    and differentiates by ``parameters()``)."""

    def __init__(self, block: ExpertParallelBlock, fn: Callable):
        super().__init__()
        self.__dict__["block"] = block  # not a child: no cycle in modules()
        self.fn = fn

    def parameters(self, recurse: bool = True):
        return (p for name, child in self.block.named_children()
                if name not in ("experts", self.block.family.router) for p in child.parameters())

    def forward(self, x):
        return self.fn(self.block, x)
