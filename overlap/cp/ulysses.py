"""Ulysses attention over a CP group: ``ulysses_attention(q, k, v, *, comm, causal)``.

Legend and contract as ``ring_attention``, plus heads that split: h % cp == 0, and h_kv % cp
== 0 or cp % h_kv == 0 (kv heads are then repeated to cp heads and their dK/dV summed back).
S = cp * s_local. Forward: ``q_h, kv_h = all_to_all(q_shard, kv_shard)`` swaps heads for
sequence (each rank: h / cp heads of the whole sequence, put back in natural order); the
attention of those heads runs in tiles of zig-zag chunks (causal: tile t sees the tiles
before it whole, itself under the mask); ``out_shard = all_to_all(o_h)``. Backward: ``do_h =
all_to_all(dout_shard)``, the tiles' gradients, ``dq, dkv = all_to_all(dq_h, dkv_h)``. The
stamp rides in the head of the first all-to-all (plain gloo: compared alone first). Nothing
hides the all-to-alls (their bytes are small); docs/design/cp.md. Tolerances: docs/cp.md.
"""

from __future__ import annotations

import torch

from overlap.cp.blocks import backward_kernel, block_backward, block_forward, merge, pick_kernel
from overlap.cp.comm import CPComm, Packet, call_layer, call_scale
from overlap.cp.ring import _validate
from overlap.tp.ops import call_op, define_op

__all__ = ["ulysses_attention", "ulysses_fits"]


def ulysses_fits(h: int, h_kv: int, cp: int) -> bool:
    """Whether Ulysses can split these heads over ``cp`` ranks."""
    return h % cp == 0 and (h_kv % cp == 0 or cp % h_kv == 0)


def _check_heads(q: torch.Tensor, k: torch.Tensor, comm: CPComm, op: str) -> int:
    """The kv heads' repeat factor (1 unless h_kv < cp); ValueError if the heads do not split."""
    h, hk, cp = q.shape[1], k.shape[1], comm.world
    if h % cp:
        raise ValueError(f"{op}: q's heads h={h} must be divisible by cp={cp} (each rank "
                         f"attends h / cp heads of the whole sequence); use method=\"ring\" or "
                         f"\"allgather\"{comm.where}")
    if hk % cp and cp % hk:
        raise ValueError(f"{op}: k/v's heads h_kv={hk} must be divisible by cp={cp} or "
                         f"divide it (then they are repeated to cp heads); use method=\"ring\" "
                         f"or \"allgather\"{comm.where}")
    return max(1, cp // hk)


def _to_sequence(x: torch.Tensor, causal: bool) -> torch.Tensor:
    """Every rank's piece (cp, *mid, s, d) -> the sequence (*mid, cp * s, d): in natural order
    under ``causal`` (piece i holds chunks i and 2cp-1-i), else in rank order (full attention
    does not care)."""
    cp, s = x.shape[0], x.shape[-2]
    if not causal:  # a fresh tensor (never a view of the message buffer)
        out = x.new_empty(*x.shape[1:-2], cp, s, x.shape[-1])
        out.copy_(x.movedim(0, -3))
        return out.flatten(-3, -2)
    c = s // 2
    out = x.new_empty(*x.shape[1:-2], 2 * cp, c, x.shape[-1])
    for i in range(cp):
        out[..., i, :, :] = x[i, ..., :c, :]
        out[..., 2 * cp - 1 - i, :, :] = x[i, ..., c:, :]
    return out.flatten(-3, -2)


def _to_pieces(y: torch.Tensor, out: torch.Tensor, causal: bool) -> None:
    """The inverse of :func:`_to_sequence`: write the sequence ``y`` (*mid, S, d) into every
    rank's piece ``out`` (cp, *mid, s, d), converting to ``out``'s dtype."""
    cp, s = out.shape[0], out.shape[-2]
    if not causal:
        out.copy_(y.unflatten(-2, (cp, s)).movedim(-3, 0))
        return
    c = s // 2
    chunks = y.unflatten(-2, (2 * cp, c))
    for i in range(cp):
        out[i, ..., :c, :] = chunks[..., i, :, :]
        out[i, ..., c:, :] = chunks[..., 2 * cp - 1 - i, :, :]


def _tiles(cp: int, s: int, causal: bool) -> list[tuple[slice, slice, bool, bool]]:
    """(query rows, key rows, causal within, first for these rows) over the sequence: causal
    tiles of one zig-zag chunk (c rows) see their own tile under the mask, then every earlier
    row whole; full attention: tiles of s rows against every key."""
    if not causal:
        return [(slice(t * s, (t + 1) * s), slice(None), False, True) for t in range(cp)]
    c, plan = s // 2, []
    for t in range(2 * cp):
        rows = slice(t * c, (t + 1) * c)
        plan.append((rows, rows, True, True))
        if t:
            plan.append((rows, slice(0, t * c), False, False))
    return plan


def _swap(comm: CPComm, packet: Packet, send: torch.Tensor, op: str, what: str
          ) -> torch.Tensor:
    """One all-to-all of ``send`` (cp, nbytes), waited; a stamped packet is checked."""
    if comm.world == 1:
        return send
    if packet.stamped:
        comm.stamps_alone(op)
    recv = torch.empty_like(send)
    comm.wait_collective(comm.collective("all_to_all", recv, send, op=op, what=what), op=op,
                         what=what)
    if packet.stamped:
        comm.verify_rows(op, packet.stamps(recv))
    return recv


def _stamped(comm: CPComm, packet: Packet) -> torch.Tensor:
    send = packet.empty(comm.world, comm.agree.send.device)
    packet.stamps(send).copy_(comm.agree.send.expand(comm.world, -1))
    return send


# ---------------------------------------------------------------- implementations

def _ul_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: CPComm, causal: bool,
                scale: float, block: str, layer: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (b, h, s, d) in q's dtype, then what the backward needs: q_h (b, h/cp, S, d),
    kv_h (2, b, hk', S, d) with hk' = max(h_kv, cp) / cp, o_h fp32 like q_h, lse)."""
    op = "ulysses_attention"
    comm.check_usable(op)
    with comm.guard(op):
        _validate(q, k, v, comm, causal, scale, block, op)
        rep = _check_heads(q, k, comm, op)
        comm.stamp(op, q, k, causal, scale, layer)
        (b, h, s, d), cp = q.shape, comm.world
        hq, hkc = h // cp, k.shape[1] * rep // cp
        kv = torch.stack([k, v])
        kv = kv.repeat_interleave(rep, dim=2) if rep > 1 else kv
        packet = Packet([((b, hq, s, d), q.dtype), ((2, b, hkc, s, d), q.dtype)], stamp=True)
        send = _stamped(comm, packet)
        q_to, kv_to = packet.views(send)  # row j: the heads CP rank j attends
        q_to.copy_(q.view(b, cp, hq, s, d).transpose(0, 1))
        kv_to.copy_(kv.view(2, b, cp, hkc, s, d).permute(2, 0, 1, 3, 4, 5))
        q_from, kv_from = packet.views(_swap(comm, packet, send, op, "the q/k/v all-to-all"))
        q_h, kv_h = _to_sequence(q_from, causal), _to_sequence(kv_from, causal)
        kernel = pick_kernel(block, q)
        q5 = q_h.view(b, hkc, hq // hkc, cp * s, d)
        kv5 = kv_h.float() if kernel == "math" else kv_h  # upcast once, not per tile
        q5 = q5.float() if kernel == "math" else q5
        o = q5.new_empty(q5.shape, dtype=torch.float32)
        lse = q5.new_empty(q5.shape[:-1], dtype=torch.float32)
        for rows, keys, diag, first in _tiles(cp, s, causal):
            o_blk, lse_blk = block_forward(q5[..., rows, :], kv5[0, :, :, keys].unsqueeze(2),
                                           kv5[1, :, :, keys].unsqueeze(2), scale, diag,
                                           kernel)
            if first:
                o[..., rows, :], lse[..., rows] = o_blk, lse_blk
            else:
                merge(o[..., rows, :], lse[..., rows], o_blk, lse_blk)
        o_h = o.view(b, hq, cp * s, d)
        back = Packet([((b, hq, s, d), q.dtype)], stamp=False)
        send = back.empty(cp, q.device)
        _to_pieces(o_h, back.views(send)[0], causal)
        (out,) = back.views(_swap(comm, back, send, op, "the output all-to-all"))
        out = out.transpose(0, 1).reshape(b, h, s, d)
        comm.agree.poison(out)
        return out, q_h, kv_h, o_h, lse


def _ul_backward(dout: torch.Tensor, q_h: torch.Tensor, kv_h: torch.Tensor, o_h: torch.Tensor,
                 lse: torch.Tensor, comm: CPComm, causal: bool, scale: float, h_kv: int,
                 block: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (b, h, s, d), dk, dv (b, h_kv, s, d)) in dout's dtype."""
    op = "ulysses_attention_backward"
    comm.check_usable(op)
    with comm.guard(op):
        (b, h, s, d), cp = dout.shape, comm.world
        comm.stamp(op, dout, torch.empty(b, h_kv, s, d, device="meta"), causal, scale, layer)
        (_, hq, n, _), hkc = q_h.shape, kv_h.shape[2]
        packet = Packet([((b, hq, s, d), dout.dtype)], stamp=True)
        send = _stamped(comm, packet)
        packet.views(send)[0].copy_(dout.view(b, cp, hq, s, d).transpose(0, 1))
        (do_from,) = packet.views(_swap(comm, packet, send, op, "the dO all-to-all"))
        do5 = _to_sequence(do_from, causal).view(b, hkc, hq // hkc, n, d).float()
        q5 = q_h.view(b, hkc, hq // hkc, n, d).float()
        k5, v5 = (t.unsqueeze(2) for t in kv_h.float())
        o5 = o_h.view(do5.shape)
        delta = (do5 * o5).sum(-1)
        kernel = backward_kernel(pick_kernel(block, dout), dout)
        dq5, dkv = torch.zeros_like(q5), torch.zeros_like(kv_h, dtype=torch.float32)
        for rows, keys, diag, _first in _tiles(cp, s, causal):
            dq_blk, dk_blk, dv_blk = block_backward(
                q5[..., rows, :], k5[..., keys, :], v5[..., keys, :], do5[..., rows, :],
                lse[..., rows], delta[..., rows], scale, diag, kernel, o5[..., rows, :])
            dq5[..., rows, :] += dq_blk
            dkv[0, :, :, keys] += dk_blk
            dkv[1, :, :, keys] += dv_blk
        rep = hkc * cp // h_kv
        # Repeated kv heads are summed after the trip: send their parts in fp32.
        back = Packet([((b, hq, s, d), dout.dtype),
                       ((2, b, hkc, s, d), torch.float32 if rep > 1 else dout.dtype)],
                      stamp=False)
        send = back.empty(cp, dout.device)
        dq_to, dkv_to = back.views(send)
        _to_pieces(dq5.view(b, hq, n, d), dq_to, causal)
        _to_pieces(dkv, dkv_to, causal)
        dq_from, dkv_from = back.views(_swap(comm, back, send, op, "the dq/dk/dv all-to-all"))
        dq = dq_from.transpose(0, 1).reshape(b, h, s, d)
        dkv = dkv_from.permute(1, 2, 0, 3, 4, 5).reshape(2, b, hkc * cp, s, d)
        if rep > 1:
            dkv = dkv.view(2, b, h_kv, rep, s, d).sum(3)
        # Two tensors, not views of one: a custom op's outputs may not alias each other.
        dk, dv = (dkv[i].to(dout.dtype, copy=True) for i in (0, 1))
        comm.agree.poison(dq, dk, dv)
        return dq, dk, dv


define_op("ulysses_attention", _ul_forward, lambda q, k, v, comm, causal, scale, block, layer: (
    q.new_empty(q.shape),
    q.new_empty(q.shape[0], q.shape[1] // comm.world, q.shape[2] * comm.world, q.shape[3]),
    q.new_empty(2, q.shape[0], max(k.shape[1], comm.world) // comm.world,
                q.shape[2] * comm.world, q.shape[3]),
    q.new_empty(q.shape[0], q.shape[1] // comm.world, q.shape[2] * comm.world, q.shape[3],
                dtype=torch.float32),
    q.new_empty(q.shape[0], max(k.shape[1], comm.world) // comm.world,
                q.shape[1] // max(k.shape[1], comm.world), q.shape[2] * comm.world,
                dtype=torch.float32)))
define_op("ulysses_attention_backward", _ul_backward,
          lambda dout, q_h, kv_h, o_h, lse, comm, causal, scale, h_kv, block, layer: (
              dout.new_empty(dout.shape),
              dout.new_empty(dout.shape[0], h_kv, dout.shape[2], dout.shape[3]),
              dout.new_empty(dout.shape[0], h_kv, dout.shape[2], dout.shape[3])))


# ---------------------------------------------------------------- autograd: one backward

class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, causal, scale, block, layer):
        out, q_h, kv_h, o_h, lse = call_op("ulysses_attention", _ul_forward, q, k, v, comm,
                                           causal, scale, block, layer)
        ctx.comm, ctx.causal, ctx.scale, ctx.block = comm, causal, scale, block
        ctx.layer = layer
        ctx.h_kv = k.shape[1]
        ctx.save_for_backward(q_h, kv_h, o_h, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q_h, kv_h, o_h, lse = ctx.saved_tensors
        dq, dk, dv = call_op("ulysses_attention_backward", _ul_backward, dout.contiguous(),
                             q_h, kv_h, o_h, lse, ctx.comm, ctx.causal, ctx.scale, ctx.h_kv,
                             ctx.block, ctx.layer)
        return dq, dk, dv, None, None, None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: CPComm,
                      causal: bool, scale: float | None = None, block: str = "auto",
                      layer: int = -1) -> torch.Tensor:
    """Attention of this rank's zig-zag rows ``q`` over the whole sequence, heads swapped for
    sequence by all-to-all (module docstring). ``scale``, ``block`` and ``layer`` as
    ``ring_attention``'s. ValueError on every rank before any transfer if the heads do not
    split over cp."""
    scale = call_scale("ulysses_attention", q, comm, causal, scale)
    layer = call_layer("ulysses_attention", layer, comm)
    return _UlyssesAttention.apply(q, k, v, comm, causal, scale, block, layer)
