"""The two NCCL rules the first GPU run showed the twin was missing (issue 47), each shown to
be the thing that fails (switched off, the same code passes):

- NCCL refuses CPU tensors: a tensor overlap's code made on the host (``torch.tensor(data)``,
  ``device="cpu"``, ``.cpu()``), or computed only from such tensors, is refused by every
  ``nccl_twin`` collective and P2P with NCCL's error; plain gloo accepts it. The call sites the
  GPU found (the ``chunks="auto"`` decision, the MoE layer's settings check) run clean.
- NCCL creates a communicator lazily, when every rank of it has issued its first op on it, and
  blocks the issuing thread meanwhile: two ranks whose first ops on two communicators come in
  crossed order are reported within the timeout (NCCL waits forever). The ring attention at
  CP 2, which touches its two channels crossed, runs.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import WORLD_SIZES, run_ranks

HOST_ERROR = "No backend type associated with device type cpu"


def _attempt(call) -> str:
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return "ok"


# ------------------------------------------------------------------ NCCL refuses CPU tensors

def _host_tensors_in_every_op(strict: bool):
    from overlap.dist import host_tensors

    host_tensors.STRICT = strict
    world, rank = dist.get_world_size(), dist.get_rank()
    host = host_tensors.as_host(torch.ones(4))
    derived = (host * 2).to(torch.float64)           # computed from host tensors only
    on_device = host.to(torch.device("cpu"))         # the copy to the rank's device
    mixed = torch.ones(4) + host                     # a device tensor took part: device
    peer = (rank + 1) % world
    out = {
        "marks": [host_tensors.is_host(t) for t in (host, derived, on_device, mixed)],
        "all_reduce": _attempt(lambda: dist.all_reduce(host.clone())),
        "derived": _attempt(lambda: dist.all_reduce(derived)),
        "all_gather": _attempt(lambda: dist.all_gather_into_tensor(
            torch.empty(4 * world), host)),
        "broadcast": _attempt(lambda: dist.broadcast(host.clone(), src=0)),
    }
    if world > 1:
        out["batch"] = _attempt(lambda: [w.wait() for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, host.clone(), peer),
             dist.P2POp(dist.irecv, torch.empty(4), (rank - 1) % world)])])
        out["send"] = _attempt(lambda: (dist.isend(host.clone(), peer) if rank % 2 == 0
                                        else dist.irecv(host.clone(), (rank - 1) % world)))
    dist.barrier()
    # A device tensor is accepted, and so is the host tensor once copied to the device.
    dist.all_reduce(on_device)
    out["device_sum"] = on_device.tolist()
    out["mixed_ok"] = _attempt(lambda: dist.all_reduce(mixed))
    return out


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_host_tensors_are_refused_in_every_collective_and_p2p(world):
    for rank, out in enumerate(run_ranks(_host_tensors_in_every_op, world, True)):
        assert out.pop("marks") == [True, True, False, False], rank
        assert out.pop("device_sum") == [float(world)] * 4, rank
        assert out.pop("mixed_ok") == "ok", rank
        for op, message in out.items():
            assert message.startswith(HOST_ERROR) and "host tensor" in message, (rank, op,
                                                                                 message)


def test_switched_off_the_host_rule_lets_them_through():
    """The same calls succeed with the rule off: the rule, not an accident, refused them."""
    for out in run_ranks(_host_tensors_in_every_op, 2, False):
        for op in ("all_reduce", "derived", "all_gather", "broadcast", "batch"):
            assert out[op] == "ok", (op, out[op])


def _plain_gloo_accepts_host_tensors():
    from overlap.dist import host_tensors

    t = host_tensors.as_host(torch.ones(3))
    dist.all_reduce(t)
    return t.tolist()


def test_plain_gloo_accepts_host_tensors():
    assert run_ranks(_plain_gloo_accepts_host_tensors, 2, backend="gloo") == [[2.0] * 3] * 2


def _what_overlap_code_marks():
    """Which tensors overlap's own code gets as host tensors (a module of the package stands
    for it: the marking looks at the caller's module)."""
    import types

    code = types.ModuleType("overlap._twin_probe")
    exec(  # noqa: S102 - a stand-in for a module of the package
        "import torch\n"
        "def made():\n"
        "    d = torch.device('cpu')\n"
        "    return {'tensor': torch.tensor([1.0, 2.0]), 'tensor_dev': torch.tensor([1.0], device=d),\n"
        "            'as_tensor_of_tensor': torch.as_tensor(torch.ones(2)),\n"
        "            'zeros': torch.zeros(2), 'zeros_cpu': torch.zeros(2, device='cpu'),\n"
        "            'zeros_dev': torch.zeros(2, device=d), 'cpu': torch.ones(2).cpu(),\n"
        "            'from_numpy': torch.from_numpy(torch.ones(2).numpy()),\n"
        "            'param': torch.nn.Parameter(torch.tensor([1.0]))}\n",
        code.__dict__)
    from overlap.dist import host_tensors

    made = code.made()
    user = {"user_tensor": torch.tensor([1.0]), "user_cpu": torch.ones(1).cpu()}
    out = {k: host_tensors.is_host(v) for k, v in {**made, **user}.items()}
    out["site"] = (host_tensors.made_at(made["tensor"]) or "").endswith(":4")
    saved = __import__("pickle").loads(__import__("pickle").dumps(made["tensor"]))
    out["pickled"] = type(saved) is torch.Tensor and saved.tolist() == [1.0, 2.0]
    return out


def test_what_counts_as_a_host_tensor():
    (out,) = run_ranks(_what_overlap_code_marks, 1)
    assert out == {"tensor": True, "tensor_dev": False, "as_tensor_of_tensor": False,
                   "zeros": False, "zeros_cpu": True, "zeros_dev": False, "cpu": True,
                   "from_numpy": True, "param": True, "user_tensor": False, "user_cpu": False,
                   "site": True, "pickled": True}, out


# the call sites the GPU run found

def _auto_chunks_decide():
    from overlap import tp

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tp.TPComm(dist.group.WORLD, backend="chunked", timeout=30, chunks="auto")
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 8, generator=g) for _ in range(world)]
    w = torch.randn(8, 6, generator=g)
    calls = worst = 0
    while comm.auto.kind is None and calls < 500:
        y = tp.all_gather_matmul(xs[rank], w, comm=comm)
        worst = max(worst, (y - torch.cat(xs) @ w).abs().max().item())
        calls += 1
    kind = comm.auto.kind
    comm.close()
    return kind, worst


@pytest.mark.parametrize("world", (2, 4))
def test_auto_chunks_decision_runs_on_the_strict_twin(world):
    for kind, worst in run_ranks(_auto_chunks_decide, world, timeout=120):
        assert kind in ("whole", "pieces") and worst <= 1e-5, (kind, worst)


def _moe_on_ep():
    from overlap.moe import EPComm, MoE

    comm = EPComm(dist.group.WORLD, chunks=2, timeout=30)
    torch.manual_seed(0)
    layer = MoE(8, 8, 2 * dist.get_world_size(), 2, comm=comm)
    y = layer(torch.randn(6, 8))
    comm.close()
    return tuple(y.shape), bool(torch.isfinite(y).all())


@pytest.mark.parametrize("world", (2, 4))
def test_moe_settings_check_runs_on_the_strict_twin(world):
    assert run_ranks(_moe_on_ep, world) == [((6, 8), True)] * world


# ------------------------------------------------------------------ lazy communicator creation

def _channels(timeout: float):
    """Two two-rank communicators built as the pipeline's and the ring's channels are."""
    from overlap.dist import nccl_twin

    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    return [nccl_twin.NcclTwinGroup(dist.PrefixStore(f"twin_rules/{name}", store), rank, 2,
                                    timedelta(seconds=timeout), name, [0, 1])
            for name in ("a", "b")]


def _first_touch(crossed: bool, lazy: bool):
    import time

    from overlap.dist import nccl_twin

    nccl_twin.LAZY_CREATION = lazy
    rank = dist.get_rank()
    a, b = _channels(2.0)
    first, second = (a, b) if rank == 0 or not crossed else (b, a)
    t0 = time.monotonic()
    try:
        posted = []
        for chan in (first, second):  # rank 0 sends, rank 1 receives, on each channel
            t = torch.full((3,), 5.0) if rank == 0 else torch.empty(3)
            posted.append((t, (chan.send if rank == 0 else chan.recv)([t], 1 - rank, 0)))
        for t, work in posted:
            work.wait()
            assert t.tolist() == [5.0] * 3
        result = "ok"
    except RuntimeError as exc:
        result = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    for chan in (a, b):
        chan.shutdown()
    return result, took


def test_crossed_first_touch_of_two_communicators_is_reported():
    for rank, (result, took) in enumerate(run_ranks(_first_touch, 2, True, True)):
        assert result.startswith("NcclOrderTimeout") and "creating" in result, (rank, result)
        assert "never issued their first op" in result and f"[{1 - rank}]" in result, result
        assert 1.5 < took < 10, took


def test_first_touch_in_one_order_creates_both():
    assert [r for r, _ in run_ranks(_first_touch, 2, False, True)] == ["ok", "ok"]


def test_switched_off_lazy_creation_lets_the_crossed_order_through():
    """The twin before the rule: the crossed first touch passed, as it did before the GPU."""
    assert [r for r, _ in run_ranks(_first_touch, 2, True, False)] == ["ok", "ok"]


def _ring_attention_at():
    from overlap.cp import CPComm, ring_attention

    rank = dist.get_rank()
    comm = CPComm(dist.group.WORLD, timeout=10)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    out = ring_attention(q, k, v, comm=comm, causal=False)
    comm.close()
    return rank, tuple(out.shape), bool(torch.isfinite(out).all())


@pytest.mark.parametrize("world", (2, 4))
def test_ring_attention_channels_are_created_in_one_order(world):
    got = run_ranks(_ring_attention_at, world, timeout=60)
    assert got == [(r, (1, 2, 4, 8), True) for r in range(world)]
