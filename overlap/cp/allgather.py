"""All-gather attention over a CP group: ``allgather_attention(q, k, v, *, comm, causal)``.

Legend and contract as ``ring_attention`` (q (b, h, s_local, d), k/v (b, h_kv, s_local, d),
zig-zag pieces, this rank's rows back). Pieces: p = 0 every rank's first zig-zag chunk, p = 1
every rank's second (c = s_local / 2 rows each), ``kv_p = all_gather(kv_shard[p])``.
Forward ``o = merge(attend(q, kv_shard), attend(q, kv_0 minus own), attend(q, kv_1 minus own))``
by log-sum-exp (fp32): the own block (the diagonal) is attended under both gathers, piece 0
under the gather of piece 1. Backward: kv is gathered again; ``dq = sum_blocks ds k * scale``;
``dkv_shard = reduce_scatter(dkv_p)`` in fp32, piece 0's while piece 1 is computed. Errors:
as the ring's; the stamp rides in the head of the first gather (plain gloo: compared alone
first, ``CPComm.stamps_alone``). Tolerances: docs/cp.md.
"""

from __future__ import annotations

import torch

from overlap.cp.blocks import backward_kernel, block_backward, block_forward, merge, pick_kernel
from overlap.cp.comm import CPComm, Packet, call_layer, call_scale
from overlap.cp.ring import _validate, attention_function, forward_outputs

__all__ = ["allgather_attention"]


def _pieces(s: int) -> list[slice]:
    """The local rows of each gathered piece: the two zig-zag chunks (one piece if s is 1)."""
    c = s // 2
    return [slice(0, c), slice(c, s)] if c else [slice(0, s)]


def _plan(piece: int, rank: int, cp: int, s: int, causal: bool) -> list[tuple[slice, slice]]:
    """(query rows, key rows of the gathered piece in CP-rank order) to attend, unmasked, once
    piece ``piece`` lands; the own rank's rows are in the diagonal block already. Causal: piece
    0 holds the sequence's first half in order, so every query row sees the ranks below and
    only the second query chunk sees the ranks above; piece 1 (the second half, reversed) is
    seen by the second query chunk from the ranks above only. Every rank attends 2c x c per
    peer in all, like every ring step."""
    n = _pieces(s)[piece].stop - _pieces(s)[piece].start
    below, above = slice(0, rank * n), slice((rank + 1) * n, cp * n)
    if not causal:
        plan = [(slice(None), below), (slice(None), above)]
    elif piece == 0:
        plan = [(slice(None), below), (slice(s // 2, s), above)]
    else:
        plan = [(slice(s // 2, s), above)]
    return [(rows, keys) for rows, keys in plan if keys.stop > keys.start]


def _post_gathers(comm: CPComm, kv: torch.Tensor, op: str) -> list:
    """Post the all-gather of every piece of ``kv`` (2, b, hk, s, d); the first message
    carries this call's stamp. Returns [(work, gathered buffer, packet)] in piece order."""
    comm.stamps_alone(op)
    posted, pieces = [], _pieces(kv.shape[3])
    for p, rows in enumerate(pieces):
        part = kv[:, :, :, rows]
        packet = Packet([(tuple(part.shape), kv.dtype)], stamp=p == 0)
        mine, every = packet.empty(1, kv.device), packet.empty(comm.world, kv.device)
        packet.views(mine)[0][0].copy_(part)
        if p == 0:
            packet.stamps(mine)[0].copy_(comm.agree.send)
        what = f"the kv all-gather (piece {p + 1} of {len(pieces)})"
        posted.append((comm.collective("all_gather", every, mine, op=op, what=what), every,
                       packet, what))
    return posted


def _landed(comm: CPComm, posted: list, p: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    """Wait for gathered piece ``p``; returns it as (2, b, hk, cp * rows, d) in CP-rank order
    (in ``dtype``), after checking every rank's stamp on the first piece."""
    work, every, packet, what = posted[p]
    comm.wait_collective(work, op=op, what=what)
    if p == 0:
        comm.verify_rows(op, packet.stamps(every))
    kv = packet.views(every)[0]  # (cp, 2, b, hk, n, d)
    cp, two, b, hk, n, d = kv.shape
    out = torch.empty(two, b, hk, cp, n, d, dtype=dtype, device=kv.device)
    out.copy_(kv.permute(1, 2, 3, 0, 4, 5))  # one copy: the layout and the dtype
    return out.view(two, b, hk, cp * n, d)


# ---------------------------------------------------------------- implementations

def _ag_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: CPComm, causal: bool,
                scale: float, block: str, layer: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (b, h, s, d) in q's dtype, out in fp32 or empty when q is fp32, lse (b, hk, g, s))."""
    op = "allgather_attention"
    comm.check_usable(op)
    with comm.guard(op):
        _validate(q, k, v, comm, causal, scale, block, op)
        comm.stamp(op, q, k, causal, scale, layer)
        (b, h, s, d), hk = q.shape, k.shape[1]
        kernel = pick_kernel(block, q)
        kv = torch.stack([k, v])
        posted = _post_gathers(comm, kv, op) if comm.world > 1 else []
        q5 = q.reshape(b, hk, h // hk, s, d)
        q5 = q5.float() if kernel == "math" else q5
        # The own block runs while the gathers are in flight: the overlap.
        o, lse = block_forward(q5, kv[0].unsqueeze(2), kv[1].unsqueeze(2), scale, causal,
                               kernel)
        for p in range(len(posted)):
            kv_p = _landed(comm, posted, p, op, q5.dtype)
            for rows, keys in _plan(p, comm.rank, comm.world, s, causal):
                o_blk, lse_blk = block_forward(q5[..., rows, :], kv_p[0, :, :, keys].unsqueeze(2),
                                               kv_p[1, :, :, keys].unsqueeze(2), scale, False,
                                               kernel)
                merge(o[..., rows, :], lse[..., rows], o_blk, lse_blk)
        return forward_outputs(o.reshape(b, h, s, d), lse, q, comm)


def _ag_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o32: torch.Tensor, lse: torch.Tensor, comm: CPComm, causal: bool,
                 scale: float, block: str, layer: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's dtype; ``o32`` is the forward's fp32 output (b, h, s, d)."""
    op = "allgather_attention_backward"
    comm.check_usable(op)
    with comm.guard(op):
        comm.stamp(op, q, k, causal, scale, layer)
        (b, h, s, d), hk = q.shape, k.shape[1]
        g, cp = h // hk, comm.world
        kv = torch.stack([k, v])
        posted = _post_gathers(comm, kv, op) if cp > 1 else []
        q5 = q.reshape(b, hk, g, s, d).float()
        do5 = dout.reshape(b, hk, g, s, d).float()
        o5 = o32.reshape(b, hk, g, s, d)
        delta = (do5 * o5).sum(-1)
        kernel = backward_kernel(pick_kernel(block, q), q)
        kv32 = kv.float()
        # The own block's backward runs while the gathers are in flight.
        dq5, dk, dv = block_backward(q5, kv32[0].unsqueeze(2), kv32[1].unsqueeze(2), do5, lse,
                                     delta, scale, causal, kernel, o5)
        dkv_own = torch.stack([dk, dv])
        scattered = []
        for p, piece in enumerate(_pieces(s)[:len(posted)]):
            kv_p = _landed(comm, posted, p, op, torch.float32)
            dkv_p = torch.zeros_like(kv_p)
            for rows, keys in _plan(p, comm.rank, cp, s, causal):
                dq_blk, dk_blk, dv_blk = block_backward(
                    q5[..., rows, :], kv_p[0, :, :, keys].unsqueeze(2),
                    kv_p[1, :, :, keys].unsqueeze(2), do5[..., rows, :], lse[..., rows],
                    delta[..., rows], scale, False, kernel, o5[..., rows, :])
                dq5[..., rows, :] += dq_blk
                dkv_p[0, :, :, keys] += dk_blk
                dkv_p[1, :, :, keys] += dv_blk
            n = piece.stop - piece.start
            send = dkv_p.view(2, b, hk, cp, n, d).permute(3, 0, 1, 2, 4, 5).contiguous()
            send[comm.rank] += dkv_own[:, :, :, piece]  # the own block's part of this piece
            mine = send.new_empty(send.shape[1:])
            what = f"the dk/dv reduce-scatter (piece {p + 1} of {len(posted)})"
            # Posted now, waited after the next piece's compute: it hides behind that.
            scattered.append((comm.collective("reduce_scatter", mine, send.flatten(0, 1),
                                              op=op, what=what),
                              mine, send, what))
        for work, _mine, _send, what in scattered:
            comm.wait_collective(work, op=op, what=what)
        if scattered:
            dkv_own = torch.cat([mine for _w, mine, _s, _what in scattered], dim=3)
        dq = dq5.reshape(b, h, s, d).to(q.dtype)
        # Two tensors, not views of one: a custom op's outputs may not alias each other.
        dk, dv = (dkv_own[i].to(q.dtype, copy=True) for i in (0, 1))
        comm.agree.poison(dq, dk, dv)
        return dq, dk, dv


_AllGatherAttention = attention_function("allgather_attention", _ag_forward, _ag_backward)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: CPComm,
                        causal: bool, scale: float | None = None, block: str = "auto",
                        layer: int = -1) -> torch.Tensor:
    """Attention of this rank's zig-zag rows ``q`` over the whole sequence, the kv gathered
    from every rank (module docstring). ``scale``, ``block`` and ``layer`` as
    ``ring_attention``'s."""
    scale = call_scale("allgather_attention", q, comm, causal, scale)
    layer = call_layer("allgather_attention", layer, comm)
    return _AllGatherAttention.apply(q, k, v, comm, causal, scale, block, layer)
