"""The fused TP ops' per-call shortcuts keep their contracts: local checks are remembered per
call signature, yet every new signature is checked (bad input after good calls is still refused
on every rank, naming op, argument and rank); a call autograd does not record skips the
autograd Function and gives the same bytes; a workspace hands out each view once and refuses
them after close."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

BACKENDS = ("chunked", "symmetric", "unfused")


def _bad_after_good(backend):
    from overlap.tp import TPComm, TPCommFailed, all_gather_matmul, matmul_reduce_scatter

    g, world = dist.group.WORLD, dist.get_world_size()
    x, w = torch.randn(4 * world, 16), torch.randn(16, 8)
    cases = {
        "k": (ValueError, lambda c: all_gather_matmul(x, torch.randn(15, 8), comm=c)),
        "dtype": (TypeError, lambda c: matmul_reduce_scatter(x, w.double(), comm=c)),
        "3d_k": (ValueError, lambda c: all_gather_matmul(x.view(world, 4, 16), torch.randn(8, 8),
                                                         comm=c)),
    }
    if world > 1:  # M not divisible by the group
        cases["rows"] = (ValueError, lambda c: matmul_reduce_scatter(
            torch.randn(4 * world + 1, 16), w, comm=c))
    out = {}
    for name, (exc, bad) in cases.items():
        comm = TPComm(g, backend=backend, timeout=30)
        for _ in range(3):  # the good signatures are remembered
            all_gather_matmul(x, w, comm=comm)
            matmul_reduce_scatter(x, w, comm=comm)
        remembered = len(comm.validated)
        with pytest.raises(exc) as info:
            bad(comm)
        with pytest.raises(TPCommFailed):
            all_gather_matmul(x, w, comm=comm)
        out[name] = (str(info.value), remembered)
        comm.close()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", (1, 2, 4))
def test_a_new_signature_is_checked_after_good_calls(world, backend):
    res = run_ranks(_bad_after_good, world, backend, timeout=120)
    for rank, out in enumerate(res):
        assert all(n == 2 for _, n in out.values()), out  # two signatures, each checked once
        k, dtype, k3 = (out[c][0] for c in ("k", "dtype", "3d_k"))
        assert "all_gather_matmul" in k and "K mismatch" in k and f"rank {rank}" in k
        if world > 1:
            rows = out["rows"][0]
            assert "matmul_reduce_scatter" in rows and "divisible" in rows, rows
        assert "matmul_reduce_scatter" in dtype and "same dtype" in dtype, dtype
        assert "all_gather_matmul" in k3 and "K mismatch" in k3, k3


def _no_grad_same_bytes(backend):
    from overlap.tp import TPComm, all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

    g, world = dist.group.WORLD, dist.get_world_size()
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(4 * world, 16, generator=gen)
    w = torch.randn(16, 8, generator=gen)
    out = []
    with TPComm(g, backend=backend, chunks=world) as comm:
        for fn in (all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce):
            plain = fn(x, w, comm=comm)  # no input requires grad: no Function
            with torch.no_grad():
                nograd = fn(x, w.requires_grad_(), comm=comm)
            recorded = fn(x, w, comm=comm)  # w requires grad: through the Function
            w.requires_grad_(False)
            out.append((torch.equal(plain, recorded), torch.equal(nograd, recorded),
                        plain.grad_fn is None and nograd.grad_fn is None,
                        recorded.grad_fn is not None))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", (1, 2, 4))
def test_a_call_autograd_does_not_record_gives_the_same_bytes(world, backend):
    for rank, out in enumerate(run_ranks(_no_grad_same_bytes, world, backend, timeout=120)):
        assert all(all(flags) for flags in out), (rank, out)


def _views_once_then_refused():
    from overlap.symm.workspace import create_workspace

    g = dist.group.WORLD
    ws = create_workspace(g, 4096, num_signals=2, device=torch.device("cpu"), timeout=10)
    peer = (ws.rank + 1) % ws.world
    a = ws.view(peer, torch.float32, (4, 8), 256)
    same = ws.view(peer, torch.float32, (4, 8), 256) is a
    other = ws.view(peer, torch.float32, (8, 4), 256) is not a
    ws.view(ws.rank, torch.float32, (4, 8), 256).fill_(float(ws.rank + 1))
    dist.barrier()
    seen = a.sum().item()
    dist.barrier()
    ws.close()
    try:
        ws.view(peer, torch.float32, (4, 8), 256)
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    return same, other, seen, peer, refused


@pytest.mark.parametrize("world", (1, 2, 4))
def test_workspace_views_are_made_once_and_refused_after_close(world):
    for rank, (same, other, seen, peer, refused) in enumerate(
            run_ranks(_views_once_then_refused, world, timeout=60)):
        assert same and other
        assert seen == 32 * (peer + 1)  # the cached view still reads the peer's memory
        assert refused is not None and "closed" in refused, refused
