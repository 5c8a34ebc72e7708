"""Per-call agreement of the EP exchanges (issue 49 item 2), on 2 and 4 ranks under nccl_twin.

Two MoE layers of equal shapes share one EPComm (layer indexes 0 and 1, by creation order), on
the chunked backend (stamps in extra rows of each block) and the symmetric one (stamp slots in
the userbuffers; its Triton send at EP 2 once).
Every rank must raise ``Disagreement`` within 2 s of the call, naming the op and both ranks'
signatures, and every later call on the communicator must fail too, when

- the last rank calls the two layers in the other order (caught at the dispatch; dropless over
  the chunked backend: at the counts exchange, which carries the stamp too);
- every rank runs the same forwards but the last rank runs the two backwards in the other order
  (caught in the combine-gradient rows; the two layers have equal weights and inputs here, so
  that dropless split sizes match too: sizes that differ the transport refuses first);
- one exchange alone disagrees (a fault injected on the last rank through the private
  ``comm.stamps.begin``: what a rank whose dispatch agreed but whose combine carries another
  layer's rows would send), for the dispatch, the combine and the dispatch gradient.

Without stamps each of these runs to completion and mixes the layers' rows. Agreeing calls (two
layers, two steps) still match the single-process reference: fp32, |ours - ref| <= 1e-5 *
max(1, max|ref|), the bound of tests/test_moe.py (summation order only; see its docstring).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

D, FF, E, K = 16, 32, 8, 2
LIMIT_S = 2.0
TOL = 1e-5


def _layers(cf, backend, seeds=(0, 1)):
    from overlap.moe import EPComm, MoE

    extra = {}
    if backend.startswith("symmetric"):  # "symmetric-triton": its send as the Triton kernel
        extra = dict(backend="symmetric", max_tokens=12,
                     kernel="triton" if backend.endswith("triton") else "torch")
    comm = EPComm(dist.group.WORLD, chunks=2, timeout=30, **extra)
    layers = []
    for seed in seeds:
        torch.manual_seed(seed)
        layers.append(MoE(D, FF, E, K, comm=comm, capacity_factor=cf))
    return comm, layers


def _x(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(2, 6, D, generator=torch.Generator().manual_seed(100 * step + rank))


def _outcome(call):
    """(type name, message, op, seconds) of what ``call`` raised, or None."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return type(exc).__name__, str(exc), getattr(exc, "op", None), time.monotonic() - start
    return None


def _swapped_forwards(cf, backend):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm, (a, b) = _layers(cf, backend)
    first, second = (b, a) if rank == world - 1 else (a, b)
    x = _x(rank)
    return _outcome(lambda: second(first(x)).sum().backward()), _outcome(lambda: a(x))


def _swapped_backwards(cf, backend):
    rank, world = dist.get_rank(), dist.get_world_size()
    # Equal weights and inputs: the two layers route alike, so even dropless split sizes match
    # (sizes that differ are refused by the transport, before any stamp is read).
    comm, (a, b) = _layers(cf, backend, seeds=(0, 0))
    ya, yb = a(_x(rank)), b(_x(rank))  # every rank: a, then b

    def backwards():
        for y in ((yb, ya) if rank == world - 1 else (ya, yb)):
            y.sum().backward()

    return _outcome(backwards), _outcome(lambda: a(_x(rank)))


def _one_exchange_disagrees(cf, backend, op):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm, (a, _) = _layers(cf, backend)
    if rank == world - 1:
        begin = comm.stamps.begin

        def shifted(o, sign, *args, **kw):
            return begin(o, sign._replace(layer=sign.layer + 5) if o == op else sign, *args,
                         **kw)

        comm.stamps.begin = shifted
    x = _x(rank)
    return _outcome(lambda: a(x).sum().backward()), _outcome(lambda: a(x))


def _check(res, world, op, layers):
    """Every rank raised Disagreement at ``op`` naming the layer and both ranks' signatures,
    in time, and its next call failed. ``layers``: (last rank's layer, the others')."""
    last = world - 1
    for rank, (first, later) in enumerate(res):
        assert first is not None, f"rank {rank}: the disagreeing calls ran (rows mixed)"
        kind, msg, got_op, seconds = first
        assert (kind, got_op) == ("Disagreement", op), (rank, first)
        peer = 0 if rank == last else last
        mine, theirs = (layers if rank == last else layers[::-1])
        assert f"ranks disagree on layer: rank {rank}={mine}, rank {peer}={theirs}" in msg, msg
        assert f"rank {rank}: {op} call " in msg and f"rank {peer}: {op} call " in msg, msg
        assert f"layer={mine}, experts={E}, hidden={D}, dtype=float32" in msg, msg
        assert seconds < LIMIT_S, (rank, seconds)
        assert later is not None and later[0] == "RuntimeError", (rank, later)
        assert "failed earlier" in later[1] and op in later[1], (rank, later)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cf", [1.0, None])
@pytest.mark.parametrize("backend", ["chunked", "symmetric"])
def test_layers_called_in_other_orders_raise_on_every_rank(world, cf, backend):
    res = run_ranks(_swapped_forwards, world, cf, backend, timeout=60)
    # dropless over the chunked backend: the counts exchange, before any row moves
    _check(res, world, "moe counts" if (cf, backend) == (None, "chunked") else "moe dispatch",
           (1, 0))


@pytest.mark.parametrize("cf", [1.0, None])
def test_layers_in_other_orders_triton_send_raises_on_every_rank(cf):
    """The symmetric send as the Triton kernel (interpreted on the CPU): stamps before it."""
    _check(run_ranks(_swapped_forwards, 2, cf, "symmetric-triton", timeout=120), 2,
           "moe dispatch", (1, 0))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cf", [1.0, None])
@pytest.mark.parametrize("backend", ["chunked", "symmetric"])
def test_backwards_in_other_orders_raise_on_every_rank(world, cf, backend):
    res = run_ranks(_swapped_backwards, world, cf, backend, timeout=60)
    _check(res, world, "moe combine grad", (1, 0))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cf", [1.0, None])
@pytest.mark.parametrize("backend", ["chunked", "symmetric"])
@pytest.mark.parametrize("op", ["moe dispatch", "moe combine", "moe dispatch grad"])
def test_one_disagreeing_exchange_raises_on_every_rank(world, cf, backend, op):
    res = run_ranks(_one_exchange_disagrees, world, cf, backend, op, timeout=60)
    _check(res, world, op, (5, 0))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def _agreeing(cf, backend):
    from overlap.moe import MoE, reference_moe

    rank, world = dist.get_rank(), dist.get_world_size()
    comm, layers = _layers(cf, backend)
    refs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        refs.append(MoE(D, FF, E, K, capacity_factor=cf))
    mine = slice(rank * (E // world), (rank + 1) * (E // world))
    errs: dict[str, float] = {}
    for step in range(2):
        xs = [_x(r, step).requires_grad_() for r in range(world)]
        gs = [torch.randn(2, 6, D, generator=torch.Generator().manual_seed(50 + 100 * step + r))
              for r in range(world)]
        y = layers[1](layers[0](xs[rank]))
        (y * gs[rank]).sum().backward()
        xr = [t.detach().clone().requires_grad_() for t in xs]
        yr = [reference_moe(reference_moe(t, refs[0])[0], refs[1])[0] for t in xr]
        sum((t * g).sum() for t, g in zip(yr, gs)).backward()
        errs["out"] = max(errs.get("out", 0.0), _rel(y.detach(), yr[rank].detach()))
        errs["dx"] = max(errs.get("dx", 0.0), _rel(xs[rank].grad, xr[rank].grad))
        for i, (layer, ref) in enumerate(zip(layers, refs)):
            for name in ("w_gate_up", "w_down"):
                got = getattr(layer.experts, name).grad
                want = getattr(ref.experts, name).grad[mine]
                errs[f"{i}.{name}"] = max(errs.get(f"{i}.{name}", 0.0), _rel(got, want))
            layer.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    calls = {side: agree.calls for side, agree in comm.stamps._agree.items()}
    comm.close()
    return errs, calls


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cf", [1.0, None])
@pytest.mark.parametrize("backend", ["chunked", "symmetric"])
def test_agreeing_calls_match_the_reference(world, cf, backend):
    res = run_ranks(_agreeing, world, cf, backend, timeout=60)
    # stamped calls per layer call and direction: chunked, 2 pieces of dispatch and combine
    # (and the dropless counts exchange); symmetric, the rows' and the answers' directions
    per = {"chunked": (4 + (cf is None), 4), "symmetric": (2, 2)}[backend]
    for rank, (errs, calls) in enumerate(res):
        assert errs and max(errs.values()) <= TOL, (rank, errs)
        assert calls == {False: 4 * per[0], True: 4 * per[1]}, (rank, calls)
