"""Per-call agreement where equal shapes used to hide a disagreement: the CP methods (ring,
all-gather, Ulysses) with ranks passing other ``scale``s or running two layers' backwards in
other orders; the TP ``unfused`` backend (and the backward's plain gather, also on chunked)
with same-byte calls of other shapes or layers. Before, each returned numbers mixed from other
calls; now every rank raises a Disagreement naming the op, the call and the field, and the
communicator stays failed. On plain gloo a later size change in the CP all-gather / Ulysses or
the unfused ops aborted a process; now it is a Disagreement on every rank. Agreeing calls
match the reference.

CP bound (fp32): cp_common's 1e-5 (analysis in test_cp_variants.py). TP bound: each result is
an fp32 sum of n products, compared elementwise with the float64 product of the same (fp32)
inputs: |got - ref| <= gamma_n (|A| @ |B|), gamma_n = n u / (1 - n u), u = 2^-24 (Higham,
Accuracy and Stability of Numerical Algorithms, eq. 3.5), whatever the summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_common import B, D, H, compare, error_bound, inputs, sharded
from harness import run_ranks

U32 = 2.0 ** -24
# (the op whose two layers run their backwards in other orders, whether x needs no gradient)
BACKWARD_ORDERS = (("matmul_reduce_scatter", False), ("all_gather_matmul", False),
                   ("matmul_reduce_scatter", True))


def _outcome(fn):
    from overlap.dist.stamp import Disagreement

    try:
        fn()
    except Disagreement as exc:
        return "Disagreement", str(exc)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return type(exc).__name__, str(exc)
    return None, None


# ---------------------------------------------------------------- CP

def _cp_cases(method):
    import overlap.cp as cp

    world, rank = dist.get_world_size(), dist.get_rank()
    attend = getattr(cp, f"{method}_attention")
    odd = rank % 2 == 1  # every rank's ring predecessor has the other parity

    def fresh():
        return cp.CPComm(dist.group.WORLD, timeout=20)

    def qkv(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(B, n, 6, D, generator=g).requires_grad_() for n in (H, 2, 2)]

    out = {}
    comm = fresh()  # an agreeing call (forward and backward) against SDPA
    full = inputs(world, 2, torch.float32, seed=3)
    errs, excess = compare(sharded(attend, full, world=world, rank=rank, causal=True,
                                   comm=comm, scale=D ** -0.5),
                           full, world=world, rank=rank, causal=True,
                           bound=error_bound(torch.float32))
    out["agree"] = max(excess)
    # Forward: one parity passes another scale (same shapes, same bytes).
    out["scale"] = _outcome(lambda: attend(*qkv(1), comm=comm, causal=True,
                                           scale=0.5 if odd else 0.25))
    out["scale later"] = _outcome(lambda: attend(*qkv(1), comm=comm, causal=True))
    comm.close()
    comm = fresh()  # two layers (scales 0.25, 0.5) forward alike, backward in other orders
    q, k, v = qkv(2)
    a = attend(q, k, v, comm=comm, causal=False, scale=0.25)
    b = attend(q, k, v, comm=comm, causal=False, scale=0.5)
    first, second = (b, a) if odd else (a, b)
    out["backward order"] = _outcome(lambda: (first.sum().backward(retain_graph=True),
                                              second.sum().backward()))
    comm.close()
    return out


@pytest.mark.parametrize("method", ["allgather", "ulysses", "ring"])
@pytest.mark.parametrize("world", [2, 4])
def test_cp_disagreement_with_equal_shapes_raises_on_every_rank(world, method):
    for rank, out in enumerate(run_ranks(_cp_cases, world, method, timeout=90)):
        assert out["agree"] <= 0, (rank, out["agree"])
        where = f"(rank {rank}, cp rank {rank} of group"
        kind, msg = out["scale"]
        assert kind == "Disagreement", (rank, kind, msg)
        assert f"{method}_attention: call 3: ranks disagree on scale" in msg and where in msg
        assert "0.25" in msg and "0.5" in msg, msg
        kind, msg = out["scale later"]
        assert kind == "CPCommFailed" and "disagree on scale" in msg, (rank, kind, msg)
        kind, msg = out["backward order"]
        assert kind == "Disagreement", (rank, kind, msg)
        assert f"{method}_attention_backward" in msg and "disagree on scale" in msg, msg


def _cp_sizes_on_plain_gloo(method):
    """A good call, then one whose s_local differs on rank 1: the outcome on this rank."""
    import overlap.cp as cp

    comm = cp.CPComm(dist.group.WORLD, timeout=20)
    attend = getattr(cp, f"{method}_attention")

    def call(s):
        q, k, v = (torch.randn(B, n, s, D, requires_grad=True) for n in (H, 2, 2))
        attend(q, k, v, comm=comm, causal=True).sum().backward()

    call(6)
    return _outcome(lambda: call(8 if dist.get_rank() == 1 else 6))


@pytest.mark.parametrize("method", ["allgather", "ulysses"])
@pytest.mark.parametrize("world", [2, 4])
def test_cp_size_change_on_plain_gloo_is_a_disagreement(world, method):
    # Plain gloo aborts the process when a message outgrows its receive: these methods now
    # compare the call's stamps alone before their data moves there (as the ring does).
    for rank, (kind, msg) in enumerate(run_ranks(_cp_sizes_on_plain_gloo, world, method,
                                                 timeout=60, backend="gloo")):
        assert kind == "Disagreement", (rank, kind, msg)
        assert f"{method}_attention: call 3: ranks disagree on q shape" in msg, msg


def _cp_layers(method):
    """Two layers alike in shapes, causal and scale, told apart by ``layer`` only: an agreeing
    pair (forward and backward, against SDPA), then odd ranks call them in the other order."""
    import functools

    import overlap.cp as cp

    world, rank = dist.get_world_size(), dist.get_rank()
    attend = getattr(cp, f"{method}_attention")
    comm = cp.CPComm(dist.group.WORLD, timeout=20)
    full = inputs(world, 2, torch.float32, seed=5)
    excess = []
    for layer in (0, 1):
        excess += compare(sharded(functools.partial(attend, layer=layer), full, world=world,
                                  rank=rank, causal=True, comm=comm),
                          full, world=world, rank=rank, causal=True,
                          bound=error_bound(torch.float32))[1]
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(B, n, 6, D, generator=g) for n in (H, 2, 2))
    order = (1, 0) if rank % 2 else (0, 1)
    swapped = _outcome(lambda: [attend(q, k, v, comm=comm, causal=True, layer=i)
                                for i in order])
    comm.close()
    return max(excess), swapped


@pytest.mark.parametrize("method", ["allgather", "ulysses", "ring"])
@pytest.mark.parametrize("world", [2, 4])
def test_cp_layers_called_in_other_orders_raise_naming_the_layer(world, method):
    # Same shapes, causal and scale: before, the stamps were equal and each rank attended
    # another layer's keys silently. The layer id now rides in the stamp.
    for rank, (excess, (kind, msg)) in enumerate(run_ranks(_cp_layers, world, method,
                                                           timeout=90)):
        assert excess <= 0, (rank, excess)
        assert kind == "Disagreement", (rank, kind, msg)
        assert f"{method}_attention: call 5: ranks disagree on layer" in msg, (rank, msg)
        assert "=0" in msg and "=1" in msg and f"rank {rank}" in msg, (rank, msg)


def _ring_far_ranks():
    """A good ring call, then rank 1 alone passes another scale: (outcome, seconds) per rank."""
    import time

    import overlap.cp as cp

    comm = cp.CPComm(dist.group.WORLD, timeout=20)
    q, k, v = (torch.randn(B, n, 6, D) for n in (H, 2, 2))
    cp.ring_attention(q, k, v, comm=comm, causal=True)
    t0 = time.monotonic()
    got = _outcome(lambda: cp.ring_attention(q, k, v, comm=comm, causal=True,
                                             scale=0.5 if dist.get_rank() == 1 else 0.25))
    return got, time.monotonic() - t0


@pytest.mark.parametrize("backend", [None, "gloo"])
def test_ring_disagreement_reaches_the_far_ranks_fast(backend):
    # At cp 4 only rank 1's ring neighbours see its stamp; ranks 0 and 3 used to wait on a
    # transfer that never came until the 20 s timeout. The ranks that find the disagreement
    # publish it in the job's store and every waiting rank reads it.
    for rank, ((kind, msg), took) in enumerate(run_ranks(_ring_far_ranks, 4, timeout=90,
                                                         backend=backend)):
        assert kind == "Disagreement", (rank, kind, msg)
        assert "ring_attention: call 2: ranks disagree on scale" in msg, (rank, msg)
        assert "0.5" in msg and "0.25" in msg and f"(rank {rank}, cp rank {rank}" in msg, msg
        assert took < 2.0, (rank, took, msg)


def _post_after_peer_failed():
    """Rank 1 fails on its own (a Disagreement it found, published to the store) and lets go;
    rank 0's next post then breaks at once, as plain gloo's does when the peer's end is gone
    (stood in for by a transfer that raises). The post raises the peer's cause."""
    import overlap.cp as cp
    from overlap.dist.stamp import Disagreement

    comm = cp.CPComm(dist.group.WORLD, timeout=20)
    if dist.get_rank() == 1:
        comm.fail(Disagreement("ring_attention: call 2: ranks disagree on scale: 0.5 (rank 1) "
                               "!= 0.25 (rank 0)", op="ring_attention", call=2, ranks=(1, 0)),
                  "ring_attention")
    dist.barrier()
    if dist.get_rank() == 1:
        return None, None

    def broken(t, send):
        raise RuntimeError("Connection closed by peer")

    comm._from_prev.transfer = broken
    return _outcome(lambda: comm.post(torch.zeros(4), send=False, op="ring_attention",
                                      what="a kv block (hop 1 of 1)"))


def test_a_post_broken_by_a_failed_peer_raises_the_peers_cause():
    # Found as a CI flake: under stream delays rank 3's post met rank 2's released end and
    # raised the broken connection, not the Disagreement rank 2 had published.
    (kind, msg), _ = run_ranks(_post_after_peer_failed, 2, timeout=60)
    assert kind == "Disagreement", (kind, msg)
    assert "cp ring_attention: a kv block (hop 1 of 1) cannot complete: cp rank 1" in msg, msg
    assert "ranks disagree on scale" in msg and "0.5" in msg, msg


# ---------------------------------------------------------------- TP (unfused)

def _excess(got, a, b, rows=slice(None)):
    """max(|got - a @ b| - gamma_n |a| @ |b|) over ``rows`` (a, b float64; n = a's columns)."""
    n = a.shape[1]
    gamma = n * U32 / (1 - n * U32)
    want, scale = (a @ b)[rows], (a.abs() @ b.abs())[rows]
    return ((got.detach().double() - want).abs() - gamma * scale).max().item()


def _tp_agree(comm, opname, world, rank):
    """Forward and backward of one agreeing call: the worst excess over the bound."""
    from overlap import tp

    m, k, n = 3, 8, 5
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g).double()  # noqa: E731 - fp32 values
    rows_in = m if opname == "all_gather_matmul" else world * m
    xs, ws = rnd(world, rows_in, k), rnd(world, k, n)
    dys = rnd(world, world * m if opname != "matmul_reduce_scatter" else m, n)
    if opname == "matmul_all_reduce":
        dys[:] = dys[0]  # the output is replicated: so is its gradient
    x = xs[rank].float().requires_grad_()
    w = ws[rank].float().requires_grad_()
    y = getattr(tp, opname)(x, w, comm=comm)
    y.backward(dys[rank].float())
    mine = slice(rank * m, (rank + 1) * m)
    if opname == "all_gather_matmul":
        big_x = torch.cat(list(xs))
        return max(_excess(y, big_x, ws[rank]),
                   _excess(x.grad, torch.cat(list(dys), 1), torch.cat([w_.t() for w_ in ws]),
                           mine),
                   _excess(w.grad, big_x.t(), dys[rank]))
    if opname == "matmul_reduce_scatter":
        big_dy = torch.cat(list(dys))
        return max(_excess(y, torch.cat(list(xs), 1), torch.cat(list(ws)), mine),
                   _excess(x.grad, big_dy, ws[rank].t()),
                   _excess(w.grad, xs[rank].t(), big_dy))
    return max(_excess(y, torch.cat(list(xs), 1), torch.cat(list(ws))),
               _excess(x.grad, dys[rank], ws[rank].t()),
               _excess(w.grad, xs[rank].t(), dys[rank]))


def _tp_cases(backend):
    from overlap import tp

    world, rank = dist.get_world_size(), dist.get_rank()
    one = rank == 1
    out = {}

    def fresh():
        return tp.TPComm(dist.group.WORLD, backend=backend, timeout=20)

    def rnd(*shape, grad=True):
        return torch.randn(*shape).requires_grad_(grad)

    for opname in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        comm = fresh()
        out[f"{opname} agree"] = _tp_agree(comm, opname, world, rank)
        fn = getattr(tp, opname)
        # Rank 1 passes another K (all-gather: rows and K) with the same bytes exchanged.
        if opname == "all_gather_matmul":
            args = (rnd(4, 4), rnd(4, 6)) if one else (rnd(2, 8), rnd(8, 6))
        else:
            args = (rnd(4 * world, 16), rnd(16, 6)) if one else (rnd(4 * world, 8), rnd(8, 6))
        out[f"{opname} shape"] = _outcome(lambda: fn(*args, comm=comm))
        out[f"{opname} later"] = _outcome(lambda: fn(*args, comm=comm))
        comm.close()
    # Two layers (other K, or other N) forward alike, backward in another order on rank 1:
    # the backward's collectives exchange the same bytes. "plain": x needs no gradient, so
    # the backward's collective is the plain gather of dy, stamped with the layer's w shape.
    for opname, plain in BACKWARD_ORDERS:
        comm = fresh()
        fn = getattr(tp, opname)
        if opname == "matmul_reduce_scatter":
            ya, yb = (fn(rnd(4 * world, kk, grad=not plain), rnd(kk, 6), comm=comm)
                      for kk in (8, 16))
        else:
            x = rnd(4 * world, 8)
            ya, yb = (fn(x, rnd(8, nn), comm=comm) for nn in (6, 12))
        first, second = (yb, ya) if one else (ya, yb)
        out[(opname, plain)] = _outcome(
            lambda: (first.sum().backward(retain_graph=True), second.sum().backward()))
        comm.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tp_unfused_disagreement_with_equal_bytes_raises_on_every_rank(world):
    ops = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
    for rank, out in enumerate(run_ranks(_tp_cases, world, "unfused", timeout=90)):
        for opname in ops:
            assert out[f"{opname} agree"] <= 0, (rank, opname, out[f"{opname} agree"])
            kind, msg = out[f"{opname} shape"]
            assert kind == "Disagreement", (rank, opname, kind, msg)
            call = 2 if opname == "matmul_all_reduce" else 3  # its backward moves nothing
            assert f"{opname} (unfused): call {call}: ranks disagree on x shape" in msg, msg
            assert "rank 1" in msg and f"rank {rank} of group" in msg, msg
            kind, msg = out[f"{opname} later"]
            assert kind == "TPCommFailed" and "disagree on x shape" in msg, (rank, kind, msg)
        _backward_orders(rank, out)


def _backward_orders(rank, out):
    for (opname, plain), (op, field) in zip(BACKWARD_ORDERS, (
            ("all_gather_matmul", "w shape"), ("matmul_reduce_scatter", "x shape"),
            ("all_gather (tp backward)", "w shape"))):
        kind, msg = out[(opname, plain)]
        assert kind == "Disagreement", (rank, opname, plain, kind, msg)
        assert f"{op}" in msg and "call 3" in msg and f"disagree on {field}" in msg, msg


@pytest.mark.parametrize("world", [2, 4])
def test_tp_chunked_backward_gather_and_scatter_are_stamped(world):
    # The chunked backend stamps its fused ops in its first hop; the backward's plain gather
    # and scatter now carry the stamp (and the layer's w shape) in their collective too.
    for rank, out in enumerate(run_ranks(_tp_cases, world, "chunked", timeout=90)):
        _backward_orders(rank, out)


def _tp_sizes_on_plain_gloo():
    """Per op: a good call, then one whose rows differ on rank 1 (other sizes on the wire)."""
    from overlap import tp

    world, out = dist.get_world_size(), {}
    for opname in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        comm = tp.TPComm(dist.group.WORLD, backend="unfused", timeout=20)
        fn = getattr(tp, opname)
        fn(torch.randn(4 * world, 8), torch.randn(8, 6), comm=comm)
        rows = 8 * world if dist.get_rank() == 1 else 4 * world
        out[opname] = _outcome(lambda: fn(torch.randn(rows, 8), torch.randn(8, 6), comm=comm))
        comm.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tp_unfused_size_change_on_plain_gloo_is_a_disagreement(world):
    # Plain gloo aborts the process (or returns garbage) on a collective of other sizes: the
    # unfused collectives compare the call's stamps alone first there.
    for rank, out in enumerate(run_ranks(_tp_sizes_on_plain_gloo, world, timeout=60,
                                         backend="gloo")):
        for opname, (kind, msg) in out.items():
            assert kind == "Disagreement", (rank, opname, kind, msg)
            assert f"{opname} (unfused): call 2: ranks disagree on x shape" in msg, msg
