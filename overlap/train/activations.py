"""Activation memory per transformer layer: measured, and Korthikanti et al.'s formulas.

``saved_bytes(fn, *args)`` counts the bytes autograd keeps for the backward (each storage once,
parameters excluded), in every recomputation mode; ``korthikanti_bytes`` gives the paper's
formula, ``expected_bytes`` the same count for *our* block term by term; ``as_on_gpu`` makes
the CPU twin save what the GPU kernels save (measure in bf16).

Legend (bytes per layer, 16-bit activations, 1-byte dropout masks): ``s`` sequence, ``b``
micro-batch, ``h`` hidden, ``a`` heads, ``t`` TP degree. Mode none: ``sbh(10 + 24/t +
5as/(ht))`` without sequence parallelism, ``sbh(34 + 5as/h)/t`` with it (t=1: both); selective:
the same without the ``5as/h`` term; full: ``2sbh`` (``/t`` with sequence parallelism).

The narrative: docs/design/training.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["saved_bytes", "as_on_gpu", "korthikanti_bytes", "expected_bytes",
           "sp_gather_extra", "LayerShape", "measure_layer"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LayerShape:
    s: int   # sequence length
    b: int   # micro-batch size
    h: int   # hidden size
    a: int   # attention heads
    t: int = 1              # TP degree
    sp: bool = False        # sequence parallelism
    mlp_ratio: int = 4

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h


def saved_bytes(fn: Callable[..., Any], *args: Any,
                exclude: list[torch.Tensor] = ()) -> tuple[int, Any]:
    """Bytes of the distinct storages autograd saves while ``fn(*args)`` runs (storages of
    ``exclude``, e.g. the parameters, not counted) and ``fn``'s result."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(seen.values()), out


def as_on_gpu(model: nn.Module) -> int:
    """Make ``model`` save for its backward what the GPU kernels save: the attention core of
    every ``CausalSelfAttention`` written out (``_explicit_core``) and every ``nn.Dropout``
    through the fused ``native_dropout`` (a 1-byte mask; the CPU's ``nn.Dropout`` saves its
    mask in the activation dtype). Same functions, same numbers in distribution; returns how
    many modules changed. Call it before ``apply_recompute`` (which wraps whatever ``core``
    and ``forward`` are)."""
    from overlap.models.gpt import CausalSelfAttention

    n = 0
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.core = _explicit_core(module)
            n += 1
        elif type(module) is nn.Dropout:
            module.forward = _fused_dropout(module)
            n += 1
    return n


def _fused_dropout(module: nn.Dropout) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not module.training or module.p == 0:
            return x
        return torch.native_dropout(x, module.p, True)[0]
    return forward


def _explicit_core(module) -> Callable:
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, _ = q.shape
        heads = module.num_heads
        hd = q.shape[-1] // heads
        q, k, v = (z.view(b, s, heads, hd).transpose(1, 2) for z in (q, k, v))
        # an additive mask: masked_fill would save an s x s boolean for its backward
        causal = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)) + causal
        probs = torch.softmax(scores, dim=-1)
        p = module.dropout if module.training else 0.0
        if p > 0:
            probs = torch.native_dropout(probs, p, True)[0]
        y = probs @ v
        return y.transpose(1, 2).reshape(b, s, heads * hd)
    return core


def korthikanti_bytes(shape: LayerShape, mode: str) -> float:
    """Activation bytes per layer from Korthikanti et al. (16-bit activations, with dropout)."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"korthikanti_bytes: mode must be none, selective or full, got {mode!r}")
    s, h, a, t = shape.s, shape.h, shape.a, shape.t
    if mode == "full":
        return 2 * shape.sbh / (t if shape.sp else 1)
    linear = 34 / t if (shape.sp or t == 1) else 10 + 24 / t
    scores = 5 * a * s / (h * t) if mode == "none" else 0.0
    return shape.sbh * (linear + scores)


def sp_gather_extra(shape: LayerShape, itemsize: int = 2) -> float:
    """Bytes our sequence-parallel block saves beyond Megatron-SP: the QKV and fc1 GEMMs
    (``all_gather_matmul``) keep their gathered input for the weight gradient, where
    Megatron-SP keeps the shard and gathers it again in the backward."""
    if not shape.sp:
        return 0.0
    return 2 * itemsize * shape.sbh * (1 - 1 / shape.t)


def expected_bytes(shape: LayerShape, mode: str, *, itemsize: int = 2,
                   dropout: bool = True) -> dict[str, float]:
    """What our ``Block`` (after ``as_on_gpu``) keeps for its backward, term by term (bytes).
    The paper's terms, plus:

    - each LayerNorm also saves its per-token mean and rstd (activation dtype here);
    - with sequence parallelism the QKV and fc1 inputs are the gathered ones (``sp_gather_
      extra``);
    - with TP the q/k/v projections run as one column GEMM over the concatenated weights
      (``column_parallel_shared``), which keeps that (3h/t x h) copy for the input gradient:
      h^2-sized, not an activation, but memory held from forward to backward;
    - without dropout there are no masks and the softmax output is what the weighted sum
      saves (3as^2b/t instead of 5).

    ``itemsize``: bytes per activation element (2: bf16)."""
    s, b, h, a, t = shape.s, shape.b, shape.h, shape.a, shape.t
    e, sbh, r = itemsize, shape.sbh, shape.mlp_ratio
    seq = t if shape.sp else 1      # residual-stream tensors are sequence shards with SP
    if mode == "full":
        return {"block input": e * sbh / seq}
    if mode not in ("none", "selective"):
        raise ValueError(f"expected_bytes: mode must be none, selective or full, got {mode!r}")
    terms = {
        "LayerNorm inputs (2)": 2 * e * sbh / seq,
        "LayerNorm mean, rstd (2)": 2 * 2 * e * s * b / seq,
        "QKV input (LN1 output)": e * sbh,   # full length: replicated, or gathered with SP
        "q, k, v": 3 * e * sbh / t,
        "o_proj input": e * sbh / t,
        "fc1 input (LN2 output)": e * sbh,
        "GELU input": r * e * sbh / t,
        "fc2 input": r * e * sbh / t,
    }
    if dropout:
        terms["residual dropout masks (2)"] = 2 * sbh / seq
    if t > 1:
        terms["QKV weight, concatenated"] = e * 3 * h * h / t
    if mode == "none":
        probs = e * a * s * s * b / t
        terms["softmax output"] = probs
        if dropout:
            terms["attention dropout mask"] = a * s * s * b / t
            terms["attention dropout output"] = probs
    return terms


def measure_layer(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes ``block`` keeps from its forward on ``x`` to its backward (its parameters not
    counted); runs the backward too, so a recomputing block is checked to work."""
    nbytes, y = saved_bytes(block, x, exclude=list(block.parameters()))
    y.float().sum().backward()
    return nbytes
