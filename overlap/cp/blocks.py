"""Attention of one query block against one key/value block, returning the log-sum-exp, its
backward recomputed from that log-sum-exp, and the log-sum-exp merge of partial results.

Legend: b batch, hk key/value heads, g = h / hk query heads per kv head, sq / sk query / key
rows. ``q5`` (b, hk, g, sq, d), ``k5``/``v5`` (b, hk, 1, sk, d); results fp32. Forward
``o = softmax(q k^T * scale + mask) v``, ``lse = logsumexp(q k^T * scale + mask)``; backward
``p = exp(q k^T * scale - lse)``, ``dv = p^T do``, ``ds = p * (do v^T - D)`` with
``D = rowsum(do * o)``, ``dq = ds k * scale``, ``dk = ds^T q * scale`` (dk, dv summed over g).
``causal``: the blocks are the same rows of the sequence (square, top-left aligned). Forward
kernels: "math" (fp32 matmuls) or "flash" (torch's flash kernel, which returns the lse).
The narrative: docs/design/cp.md.
"""

from __future__ import annotations

import torch

__all__ = ["block_forward", "block_backward", "merge", "KERNELS", "pick_kernel"]

KERNELS = ("auto", "math", "flash")


def pick_kernel(kernel: str, q: torch.Tensor) -> str:
    """"auto": flash where a flash kernel takes these inputs (CUDA, fp16/bf16), else math."""
    if kernel != "auto":
        return kernel
    return "flash" if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else "math"


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
    return o.float().view(b, hk, g, sq, d), lse.float().view(b, hk, g, sq)


def block_backward(q5: torch.Tensor, k5: torch.Tensor, v5: torch.Tensor, do5: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, scale: float, causal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (b, hk, g, sq, d), dk (b, hk, sk, d), dv (b, hk, sk, d)) of one block pair, from
    the final ``lse`` and ``delta = rowsum(do * o)`` of the query rows, fp32."""
    p = _scores(q5, k5, scale, causal).sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)
    ds = torch.matmul(do5, v5.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    dq = torch.matmul(ds, k5).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2).mul_(scale)
    return dq, dk, dv


def merge(o: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor
          ) -> None:
    """Fold a block's (o_blk, lse_blk) into the running (o, lse), in place (fp32 views):
    ``lse' = log(e^lse + e^lse_blk)``, ``o' = o e^(lse - lse') + o_blk e^(lse_blk - lse')``."""
    new = torch.logaddexp(lse, lse_blk)
    o.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(
        o_blk.mul_(torch.exp(lse_blk - new).unsqueeze(-1)))
    lse.copy_(new)
