"""Attention of one query block against one key/value block, returning the log-sum-exp, its
backward recomputed from that log-sum-exp, and the log-sum-exp merge of partial results.

Legend: b batch, hk key/value heads, g = h / hk query heads per kv head, sq / sk query / key
rows. ``q5`` (b, hk, g, sq, d), ``k5``/``v5`` (b, hk, 1, sk, d); results fp32. Forward
``o = softmax(q k^T * scale + mask) v``, ``lse = logsumexp(q k^T * scale + mask)``; backward
``p = exp(q k^T * scale - lse)``, ``dv = p^T do``, ``ds = p * (do v^T - D)`` with
``D = rowsum(do * o)``, ``dq = ds k * scale``, ``dk = ds^T q * scale`` (dk, dv summed over g).
``causal``: the blocks are the same rows of the sequence (square, top-left aligned). Kernels:
"math" (fp32 matmuls) or "flash" (torch's fused flash kernel, which returns the lse; its
backward, given the final o and lse, runs in fp32 on CPU). The narrative: docs/design/cp.md.
"""

from __future__ import annotations

import torch

__all__ = ["block_forward", "block_backward", "merge", "KERNELS", "pick_kernel",
           "backward_kernel"]

KERNELS = ("auto", "math", "flash")


def pick_kernel(kernel: str, q: torch.Tensor) -> str:
    """"auto": flash where torch's fused kernel takes these inputs at no cost in precision
    (CUDA fp16/bf16; CPU fp32, where it equals math within 1e-5 and runs ~3x faster), else
    math."""
    if kernel != "auto":
        return kernel
    if q.is_cuda:
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) else "math"
    return "flash" if q.dtype == torch.float32 else "math"


def backward_kernel(kernel: str, q: torch.Tensor) -> str:
    """The backward's block kernel for forward kernel ``kernel`` (picked): "flash" (the fused
    flash backward in fp32) on CPU after a flash forward; "math" otherwise (CUDA's flash
    backward has no fp32)."""
    return "flash" if kernel == "flash" and not q.is_cuda else "math"


def _scores(q5: torch.Tensor, k5: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q5, k5.transpose(-1, -2)).mul_(scale)
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        above = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu_(1)
        s.masked_fill_(above, float("-inf"))
    return s


def block_forward(q5: torch.Tensor, k5: torch.Tensor, v5: torch.Tensor, scale: float,
                  causal: bool, kernel: str = "math") -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of one block pair: o (b, hk, g, sq, d), lse (b, hk, g, sq), fp32. Every query
    row must see at least one key (true of every block pair the ring computes)."""
    if kernel == "flash":
        return _flash_forward(q5, k5, v5, scale, causal)
    q5, k5, v5 = q5.float(), k5.float(), v5.float()
    s = _scores(q5, k5, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(p, v5), lse


def _flash_forward(q5, k5, v5, scale, causal):
    """torch's flash kernel in the inputs' dtype (CUDA; on CPU its CPU twin), kv heads
    repeated for the query heads they serve; the block's output is rounded to that dtype."""
    b, hk, g, sq, d = q5.shape
    sk = k5.shape[-2]
    q4 = q5.reshape(b, hk * g, sq, d)
    k4, v4 = (t.expand(b, hk, g, sk, d).reshape(b, hk * g, sk, d) for t in (k5, v5))
    if q4.is_cuda:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, causal,
                                                                 False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, causal,
                                                                         scale=scale)
    o, lse = res[0], res[1]
    # Contiguous fp32 (the kernel's own layout is (b, s, h)): what the merge and a custom op's
    # fake outputs expect.
    return (o.float().contiguous().view(b, hk, g, sq, d),
            lse.float().contiguous().view(b, hk, g, sq))


def block_backward(q5: torch.Tensor, k5: torch.Tensor, v5: torch.Tensor, do5: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, scale: float, causal: bool,
                   kernel: str = "math", o5: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (b, hk, g, sq, d), dk (b, hk, sk, d), dv (b, hk, sk, d)) of one block pair, from
    the final ``lse`` and ``delta = rowsum(do * o)`` of the query rows, fp32 (inputs fp32).
    ``kernel="flash"`` (CPU): torch's fused flash backward, given the final output ``o5``."""
    if kernel == "flash":
        return _flash_backward(q5, k5, v5, do5, o5, lse, scale, causal)
    p = _scores(q5, k5, scale, causal).sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)
    ds = torch.matmul(do5, v5.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    dq = torch.matmul(ds, k5).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2).mul_(scale)
    return dq, dk, dv


def _flash_backward(q5, k5, v5, do5, o5, lse, scale, causal):
    """The fused CPU flash backward of one block in fp32: with the final (o, lse) of the query
    rows it yields this block's share of dq and its dk, dv (ring-flash-attention's use of it);
    kv heads repeated for the query heads they serve, dk/dv summed back over them."""
    b, hk, g, sq, d = q5.shape
    sk = k5.shape[-2]
    q4, do4, o4 = (t.reshape(b, hk * g, sq, d) for t in (q5, do5, o5))
    k4, v4 = (t.expand(b, hk, g, sk, d).reshape(b, hk * g, sk, d) for t in (k5, v5))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do4, q4, k4, v4, o4, lse.reshape(b, hk * g, sq), 0.0, causal, scale=scale)
    return (dq.view(b, hk, g, sq, d), dk.view(b, hk, g, sk, d).sum(2),
            dv.view(b, hk, g, sk, d).sum(2))


def merge(o: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor
          ) -> None:
    """Fold a block's (o_blk, lse_blk) into the running (o, lse), in place (fp32 views):
    ``lse' = log(e^lse + e^lse_blk)``, ``o' = o e^(lse - lse') + o_blk e^(lse_blk - lse')``."""
    new = torch.logaddexp(lse, lse_blk)
    o.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(
        o_blk.mul_(torch.exp(lse_blk - new).unsqueeze(-1)))
    lse.copy_(new)
