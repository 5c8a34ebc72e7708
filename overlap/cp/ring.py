"""Ring attention over a CP group: ``ring_attention(q, k, v, *, comm, causal, scale=None)``.

Legend: q (b, h, s_local, d), k and v (b, h_kv, s_local, d) with h % h_kv == 0, each rank's
zig-zag piece of the sequence (``overlap.cp.zigzag``); cp = comm.world. Returns this rank's
rows of ``softmax(q K^T * scale + mask) V`` over the full sequence K, V. Forward: the packed
kv block rotates to the next rank while the current one is attended; partial outputs merge by
log-sum-exp (fp32). Backward: kv rotates again; each rank's fp32 dk/dv accumulator travels the
ring behind it and returns to its owner after cp hops. Errors: ValueError/TypeError naming
the argument and the rank before any transfer; a per-call stamp rides the first message;
a dead or stalled peer is a RuntimeError within comm.timeout. Tolerances: docs/cp.md.
"""

from __future__ import annotations

import math

import torch

from overlap.cp.blocks import (KERNELS, backward_kernel, block_backward, block_forward, merge,
                               pick_kernel)
from overlap.cp.comm import CPComm, call_layer, call_scale
from overlap.tp.ops import call_op, define_op

__all__ = ["ring_attention", "attention_function", "forward_outputs"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------- validation (local, once)

def _validate(q, k, v, comm: CPComm, causal: bool, scale: float, block: str, op: str) -> None:
    at = comm.where
    if block not in KERNELS:
        raise ValueError(f"{op}: block must be one of {KERNELS}, got {block!r}{at}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}{at}")
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-d (b, heads, s_local, d), got shape "
                             f"{tuple(t.shape)}{at}")
        if t.dtype not in _DTYPES or t.dtype != q.dtype:
            raise TypeError(f"{op}: {name} must have q's dtype, one of {_DTYPES}, got "
                            f"{t.dtype} (q: {q.dtype}){at}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}{at}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}{at}")
    (b, h, s, d), (bk, hk, sk, dk) = q.shape, k.shape
    if (bk, sk, dk) != (b, s, d):
        raise ValueError(f"{op}: k must be (b={b}, h_kv, s_local={s}, d={d}) like q, got "
                         f"{tuple(k.shape)}{at}")
    if hk == 0 or h % hk:
        raise ValueError(f"{op}: q's heads h={h} must be a multiple of k/v's heads "
                         f"h_kv={hk} (grouped-query attention){at}")
    if s == 0 or (causal and s % 2):
        raise ValueError(f"{op}: s_local={s} must be a positive even length (two zig-zag "
                         f"chunks of the 2 * cp = {2 * comm.world} chunks){at}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{op}: scale must be a positive finite number, got {scale!r}{at}")


# ---------------------------------------------------------------- the ring's transfers

def _post_hop(comm: CPComm, send_t: torch.Tensor, recv_t: torch.Tensor, op: str,
              step: int) -> list:
    """Post one hop: ``send_t`` to the next rank, ``recv_t`` from the previous; the first hop
    of a call carries the stamp in front (same channel, so it lands first). On plain gloo,
    which aborts the process when a block outgrows its receive, the stamps are waited for and
    compared before the first block is posted."""
    hop, what = [], f"a kv block (hop {step + 1} of {comm.world - 1})"
    if step == 0:
        hop += [(comm.post_stamp(send=False, op=op), "the stamp", False),
                (comm.post_stamp(send=True, op=op), "the stamp", True)]
        if comm.stamps_first:
            _wait_hop(comm, hop, op, step)
            hop = []
    return hop + [(comm.post(recv_t, send=False, op=op, what=what), what, False),
                  (comm.post(send_t, send=True, op=op, what=what), what, True)]


def _wait_hop(comm: CPComm, hop: list, op: str, step: int) -> None:
    first = step == 0
    try:
        for work, what, send in hop:
            comm.wait(work, op=op, what=what, send=send)
    except RuntimeError:
        if first:  # a size error between ranks whose stamps differ: report the disagreement
            comm.verify_stamp(op, arrived_only=True)
        raise
    if first:
        comm.verify_stamp(op)


def _block_rows(step: int, src: int, rank: int, s: int, causal: bool):
    """(query rows, kv rows, causal-within) of step ``step`` under zig-zag sharding: step 0 is
    the diagonal; a block from an earlier rank is seen whole by the first kv chunk only, one
    from a later rank by the second query chunk only. Every step costs 2c x 2c / 2."""
    c = s // 2
    if not causal:
        return slice(None), slice(None), False
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


# ---------------------------------------------------------------- implementations

def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: CPComm,
                  causal: bool, scale: float, block: str, layer: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (b, h, s, d) in q's dtype, out in fp32 or empty when q is fp32, lse (b, hk, g, s))."""
    op = "ring_attention"
    comm.check_usable(op)
    with comm.guard(op):
        _validate(q, k, v, comm, causal, scale, block, op)
        comm.stamp(op, q, k, causal, scale, layer)
        (b, h, s, d), hk = q.shape, k.shape[1]
        cp, rank = comm.world, comm.rank
        kernel = pick_kernel(block, q)
        q5 = q.reshape(b, hk, h // hk, s, d)
        q5 = q5.float() if kernel == "math" else q5  # upcast once, not per block
        kv = torch.stack([k, v])  # one message per hop
        o = lse = None
        for step in range(cp):
            if step + 1 < cp:  # post block step+1 before attending block step: the overlap
                nxt = torch.empty_like(kv)
                hop = _post_hop(comm, kv, nxt, op, step)
            rows, kv_rows, diag = _block_rows(step, (rank - step) % cp, rank, s, causal)
            k5, v5 = (kv[i, :, :, kv_rows].unsqueeze(2) for i in (0, 1))
            o_blk, lse_blk = block_forward(q5[..., rows, :], k5, v5, scale, diag, kernel)
            if o is None:
                o, lse = o_blk, lse_blk
            else:
                merge(o[..., rows, :], lse[..., rows], o_blk, lse_blk)
            if step + 1 < cp:
                _wait_hop(comm, hop, op, step)
                kv = nxt
        return forward_outputs(o.reshape(b, h, s, d), lse, q, comm)


def forward_outputs(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, comm: CPComm
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward's results from its fp32 output ``o`` (b, h, s, d): (out in q's dtype, ``o``
    for the backward or empty when q is fp32 (out is then ``o``), lse), poisoned on a GPU
    whose stamps disagreed."""
    o32 = o.new_empty(0) if q.dtype == torch.float32 else o
    out = o.to(q.dtype) if q.dtype != torch.float32 else o
    comm.agree.poison(out)
    return out, o32, lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o32: torch.Tensor, lse: torch.Tensor, comm: CPComm, causal: bool,
                   scale: float, block: str, layer: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's dtype; ``o32`` is the forward's fp32 output (b, h, s, d)."""
    op = "ring_attention_backward"
    comm.check_usable(op)
    with comm.guard(op):
        comm.stamp(op, q, k, causal, scale, layer)
        (b, h, s, d), hk = q.shape, k.shape[1]
        g, cp, rank = h // hk, comm.world, comm.rank
        q5 = q.reshape(b, hk, g, s, d).float()
        do5 = dout.reshape(b, hk, g, s, d).float()
        o5 = o32.reshape(b, hk, g, s, d)
        delta = (do5 * o5).sum(-1)
        kernel = backward_kernel(pick_kernel(block, q), q)
        dq5 = torch.zeros_like(q5)
        kv = torch.stack([k, v])
        dkv = dkv_hop = None  # this step's accumulator; the hop carrying the previous one
        for step in range(cp):
            if step + 1 < cp:  # the next kv block moves while this one is attended
                nxt = torch.empty_like(kv)
                hop = _post_hop(comm, kv, nxt, op, step)
            rows, kv_rows, diag = _block_rows(step, (rank - step) % cp, rank, s, causal)
            k5, v5 = (kv[i, :, :, kv_rows].unsqueeze(2).float() for i in (0, 1))
            dq_blk, dk_blk, dv_blk = block_backward(
                q5[..., rows, :], k5, v5, do5[..., rows, :], lse[..., rows], delta[..., rows],
                scale, diag, kernel, o5[..., rows, :])
            dq5[..., rows, :] += dq_blk
            if step == 0:  # every row of the own block is touched at step 0
                dkv = torch.stack([dk_blk, dv_blk])
            else:  # the accumulator of this block's owner, from the previous rank
                dkv, _sent, back_hop = dkv_hop
                for work, what, send in back_hop:
                    comm.wait(work, op=op, what=what, send=send)
                dkv[0][:, :, kv_rows] += dk_blk
                dkv[1][:, :, kv_rows] += dv_blk
            if cp > 1:  # pass it on; it is waited for after the next step's compute
                incoming, what = torch.empty_like(dkv), f"dk/dv (hop {step + 1} of {cp})"
                dkv_hop = (incoming, dkv, [
                    (comm.post(incoming, send=False, op=op, what=what), what, False),
                    (comm.post(dkv, send=True, op=op, what=what), what, True)])
            if step + 1 < cp:
                _wait_hop(comm, hop, op, step)
                kv = nxt
        if cp > 1:  # the last hop brings this rank's own dk/dv home
            dkv, _sent, back_hop = dkv_hop
            for work, what, send in back_hop:
                comm.wait(work, op=op, what=what, send=send)
        dq = dq5.reshape(b, h, s, d).to(q.dtype)
        # Two tensors, not views of one: a custom op's outputs may not alias each other.
        dk, dv = (dkv[i].to(q.dtype, copy=True) for i in (0, 1))
        comm.agree.poison(dq, dk, dv)
        return dq, dk, dv


# ---------------------------------------------------------------- autograd: one backward

def attention_function(name: str, forward, backward) -> type:
    """Define the custom ops ``name`` and ``name_backward`` and return the autograd Function
    of a CP attention method with the ring's signature: ``forward(q, k, v, comm, causal,
    scale, block, layer) -> (out, out in fp32 or empty when q is fp32, lse (b, h_kv, g, s))``
    and ``backward(dout, q, k, v, o32, lse, comm, causal, scale, block, layer) -> (dq, dk,
    dv)``."""
    define_op(name, forward, lambda q, k, v, comm, causal, scale, block, layer: (
        q.new_empty(q.shape), q.new_empty(0 if q.dtype == torch.float32 else q.shape,
                                          dtype=torch.float32),
        q.new_empty(q.shape[0], k.shape[1], q.shape[1] // k.shape[1], q.shape[2],
                    dtype=torch.float32)))
    define_op(f"{name}_backward", backward,
              lambda dout, q, k, v, o32, lse, comm, causal, scale, block, layer: (
                  q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)))

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, comm, causal, scale, block, layer):
            out, o32, lse = call_op(name, forward, q, k, v, comm, causal, scale, block, layer)
            ctx.comm, ctx.causal, ctx.scale, ctx.block = comm, causal, scale, block
            ctx.layer = layer
            ctx.save_for_backward(q, k, v, out if o32.numel() == 0 else o32, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, o32, lse = ctx.saved_tensors
            dq, dk, dv = call_op(f"{name}_backward", backward, dout.contiguous(), q, k, v, o32,
                                 lse, ctx.comm, ctx.causal, ctx.scale, ctx.block, ctx.layer)
            return dq, dk, dv, None, None, None, None, None

    Attention.__name__ = Attention.__qualname__ = f"_{name}"
    return Attention


_RingAttention = attention_function("ring_attention", _ring_forward, _ring_backward)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: CPComm,
                   causal: bool, scale: float | None = None, block: str = "auto",
                   layer: int = -1) -> torch.Tensor:
    """Attention of this rank's zig-zag rows ``q`` over the whole sequence (module docstring).
    ``scale`` defaults to 1/sqrt(d). ``block``: the per-block kernel, "math" (fp32), "flash"
    (torch's fused flash kernel, in the inputs' dtype) or "auto" (flash on CUDA for fp16/bf16
    and on CPU for fp32, else math); the backward recomputes in fp32 (on CPU after a flash
    forward with the fused flash backward, else math). ``layer``: the caller's id of this
    attention layer (-1: unknown), stamped with the call so ranks calling two layers alike in
    everything else in other orders raise a Disagreement naming it."""
    scale = call_scale("ring_attention", q, comm, causal, scale)
    layer = call_layer("ring_attention", layer, comm)
    return _RingAttention.apply(q, k, v, comm, causal, scale, block, layer)
