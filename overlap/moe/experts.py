"""SwiGLU experts as one grouped GEMM: ``y_e = (silu(x_e @ Wg_e) * (x_e @ Wu_e)) @ Wd_e`` for the
rows ``x_e`` of each local expert, with the row offsets on the device (no host sync).

Legend: ``R`` rows (tokens sorted by expert), ``d`` hidden size, ``f`` expert FFN size, ``El``
local experts. ``w_gate_up [El, d, 2f]`` (gate then up), ``w_down [El, f, d]``;
``offsets [El]`` int32: the end row of each expert's block (empty blocks allowed).
``torch._grouped_mm`` needs 16-byte aligned rows, so ``d`` and ``f`` must be multiples of
16 / itemsize (a ValueError says so). ``SwiGLU`` is the dense one (shared experts).
The narrative: docs/moe.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from overlap.defaults import positive_int

__all__ = ["SwiGLUExperts", "SwiGLU", "grouped_mm", "expert_init", "swiglu_grouped",
           "split_expert_parameters"]


def split_expert_parameters(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) parameters of ``module`` that require grad, in ``parameters()`` order:
    the experts' weights (every ``SwiGLUExperts``) reduce over the expert-data-parallel group,
    the rest (routers, shared experts, attention, ...) over DP."""
    expert = {id(p) for m in module.modules() if isinstance(m, SwiGLUExperts)
              for p in m.parameters()}
    params = [p for p in module.parameters() if p.requires_grad]
    return ([p for p in params if id(p) not in expert], [p for p in params if id(p) in expert])


def expert_init(num_experts: int, fan_in: int, fan_out: int, *, device=None,
                dtype=None) -> torch.Tensor:
    """[E, fan_in, fan_out] drawn like ``nn.Linear(fan_in, fan_out)``'s weight, expert by
    expert (so the same seed gives the same experts however they are later sharded)."""
    bound = 1.0 / math.sqrt(fan_in)
    w = torch.empty(num_experts, fan_out, fan_in, device=device, dtype=dtype)
    nn.init.uniform_(w, -bound, bound)
    return w.transpose(1, 2).contiguous()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands a contiguous gradient on (``_grouped_mm``'s CPU backward
    rejects expanded ones)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [R, K]`` rows grouped by ``offsets`` times ``w [G, K, N]`` -> ``[R, N]``."""
    return _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), w, offs=offsets))


def _check_aligned(op: str, dtype: torch.dtype, **dims: int) -> None:
    per = 16 // torch.empty((), dtype=dtype).element_size()
    bad = {k: v for k, v in dims.items() if v % per}
    if bad:
        raise ValueError(f"{op}: {', '.join(f'{k}={v}' for k, v in bad.items())} must be a "
                         f"multiple of {per} for {dtype} (torch._grouped_mm needs 16-byte "
                         "aligned rows)")


class SwiGLUExperts(nn.Module):
    """``num_local`` SwiGLU experts: ``forward(x [R, d], offsets [El]) -> [R, d]``."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        super().__init__()
        _check_aligned("SwiGLUExperts", w_gate_up.dtype, d_model=w_gate_up.shape[1],
                       d_ff=w_down.shape[1])
        self.w_gate_up = nn.Parameter(w_gate_up)
        self.w_down = nn.Parameter(w_down)
        # Where these experts sit among all of the layer's (set by an EP-sharded MoE layer):
        # checkpoints save them at [first, first + num_local) of num_total.
        self.first, self.num_total = 0, w_gate_up.shape[0]

    @classmethod
    def create(cls, num_experts: int, d_model: int, d_ff: int, *, device=None,
               dtype=None) -> "SwiGLUExperts":
        positive_int(num_experts, "SwiGLUExperts: num_experts")
        positive_int(d_model, "SwiGLUExperts: d_model")
        positive_int(d_ff, "SwiGLUExperts: d_ff")
        gate = expert_init(num_experts, d_model, d_ff, device=device, dtype=dtype)
        up = expert_init(num_experts, d_model, d_ff, device=device, dtype=dtype)
        down = expert_init(num_experts, d_ff, d_model, device=device, dtype=dtype)
        return cls(torch.cat([gate, up], dim=2), down)

    @property
    def num_local(self) -> int:
        return self.w_gate_up.shape[0]

    def forward(self, x: torch.Tensor | None = None,
                offsets: torch.Tensor | None = None):
        """``(x, offsets) -> y``; with no arguments, the weights ``(w_gate_up, w_down)`` as the
        forward returns them (what the MoE layer's exchange runs on), so wrappers that act
        on a module's forward (TP gradient sums over sequence-parallel ranks) see every use."""
        if x is None:
            return self.w_gate_up, self.w_down
        return swiglu_grouped(x, self.w_gate_up, self.w_down, offsets)


def swiglu_grouped(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   offsets: torch.Tensor) -> torch.Tensor:
    """The experts' math on explicit weights (what the EP exchange runs on each piece)."""
    h = grouped_mm(x, w_gate_up, offsets)
    gate, up = h.chunk(2, dim=-1)
    return grouped_mm(F.silu(gate) * up, w_down, offsets)


class SwiGLU(nn.Module):
    """One dense SwiGLU MLP (a shared expert): ``(silu(x @ Wg) * (x @ Wu)) @ Wd``."""

    def __init__(self, d_model: int, d_ff: int, *, device=None, dtype=None):
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
