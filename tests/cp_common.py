"""What the CP attention tests share: inputs, the single-process SDPA reference, a sharded
forward and backward on this rank, the elementwise comparison against the reference, and a
peer that dies or stalls mid-run.
The bounds and their analysis are in test_cp_ring.py's docstring (test_cp_variants.py adds
its own)."""

from __future__ import annotations

import torch

B, H, D, C = 2, 4, 8, 3  # C: rows per zig-zag chunk (awkward on purpose)
U_BF16 = 2.0 ** -8


def inputs(world: int, hk: int, dtype: torch.dtype, seed: int = 0, h: int = H):
    """Full-sequence q, k, v and dO (sequence 2 * world * C)."""
    g = torch.Generator().manual_seed(seed)
    s = 2 * world * C
    q = torch.randn(B, h, s, D, generator=g).to(dtype)
    k = torch.randn(B, hk, s, D, generator=g).to(dtype)
    v = torch.randn(B, hk, s, D, generator=g).to(dtype)
    do = torch.randn(B, h, s, D, generator=g).to(dtype)
    return q, k, v, do


def reference(q, k, v, do, causal):
    """fp32 SDPA on the same values: (out, dq, dk, dv) of the whole sequence."""
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal,
                                                           enable_gqa=True)
    out.backward(do.float())
    return out.detach(), qr.grad, kr.grad, vr.grad


def sharded(attend, full, *, world: int, rank: int, causal: bool, **kw):
    """Run ``attend(q, k, v, causal=, **kw)`` on this rank's zig-zag pieces of ``full`` (q, k,
    v, dO), forward and backward: (out, dq, dk, dv) of this rank."""
    from overlap.cp import zigzag_shard

    mine = [zigzag_shard(t, 2, cp=world, rank=rank) for t in full]
    ql, kl, vl = (t.clone().requires_grad_() for t in mine[:3])
    out = attend(ql, kl, vl, causal=causal, **kw)
    out.backward(mine[3])
    return out.detach(), ql.grad, kl.grad, vl.grad


def compare(got, full, *, world: int, rank: int, causal: bool, bound):
    """(max |err| per tensor, max (|err| - bound) per tensor) of this rank's (out, dq, dk, dv)
    against the reference; ``bound(ref_piece)`` is the elementwise bound."""
    from overlap.cp import zigzag_shard

    want = [zigzag_shard(t, 2, cp=world, rank=rank) for t in reference(*full, causal)]
    errs, excess = [], []
    for a, b in zip(got, want):
        diff = (a.float() - b).abs()
        errs.append(diff.max().item())
        excess.append((diff - bound(b)).max().item())
    return errs, excess


def error_bound(dtype: torch.dtype, block: str = "math"):
    """fp32: 1e-5; bf16 with fp32 compute rounded once: 2^-8 |ref| + 1e-5; bf16 with the flash
    block, which rounds each block's output to bf16 before the merge: 4 * 2^-8 max|ref|."""
    if dtype == torch.float32:
        return lambda ref: 1e-5
    if block == "flash":
        return lambda ref: 4 * U_BF16 * ref.abs().max() + 1e-5
    return lambda ref: U_BF16 * ref.abs() + 1e-5


def peer_fault(kind: str, timeout: float, method: str):
    """One good call of ``<method>_attention`` on every rank; then the last rank dies
    (``kind`` "dead") or stops taking part ("stalled") and every other rank calls it again:
    (seconds until it raised, "Type: message") on the survivors."""
    import torch.distributed as dist

    import overlap.cp as cp
    from harness import last_rank_fails_during

    comm = cp.CPComm(dist.group.WORLD, timeout=timeout)
    attend = getattr(cp, f"{method}_attention")
    q = torch.randn(B, H, 2 * C, D, requires_grad=True)
    k, v = torch.randn(B, 2, 2 * C, D), torch.randn(B, 2, 2 * C, D)
    return last_rank_fails_during(
        kind, timeout, lambda: attend(q, k, v, comm=comm, causal=True).sum().backward())
