"""Per-call agreement of GradReducer(shard=True) and ShardedOptimizer on 2 and 4 ranks (nccl_twin).
Each case moves buckets of the same size (no size check sees it), which used to mix one
parameter's numbers into another's silently; every rank must now raise Disagreement within
LIMIT_S naming the op, the bucket and both ranks' values, and stay failed.

- "rs-order": step 1 agrees (reduced shards = the exact average); before step 2 the last rank
  swaps the buckets of two same-shape weights (the private ``_switch_layout``, as in
  tests/test_dp_agreement.py): the reduce-scatter. "ar-order": the same before step 1, the
  all-reduce of the pre-final first iteration (``rebuild_buckets=True``).
- "ag-extra": after an agreeing SGD step (parameters = the reference), the last rank calls
  ``step()`` again while the others publish their masters. "ag-order": the last rank gathers
  two same-size buckets in swapped order. Both: the parameter all-gather.

TOL: fp32 sums of <= 4 terms in another order than the reference's differ by a few units of
2^-24 of the largest gradient (shards, relative) or of the weights (< 1; parameters, absolute).
"""
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks
from tests.test_dp_agreement import _loss, _model  # the same model and data

LIMIT_S = 2.0
TOL = 1e-6
LR = 0.1




def _mean_grads(world, step):
    grads = []
    for r in range(world):
        m = _model()
        _loss(m, r, step).backward()
        grads.append([p.grad for p in m.parameters()])
    return [sum(g[i] for g in grads) / world for i in range(len(grads[0]))]


def _shard_error(red, want):
    """Largest error of this rank's reduced shards against the exact average, relative."""
    scale = max(w.abs().max().item() for w in want)
    err = 0.0
    for bk in red.buckets:
        full = torch.zeros(bk.padded)
        full[:bk.numel] = torch.cat([want[i].reshape(-1) for i in bk.params])
        m = bk.padded // red.dp_size
        exact = full[red.dp_rank * m:(red.dp_rank + 1) * m]
        err = max(err, (red.grad_shard(bk) - exact).abs().max().item() / scale)
    return err


def _error(call):
    """What ``call()`` raised ("Type: message"), or None."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return None


def _swap_weights(red):
    """The last rank's fault: the two 8x8 weights in swapped buckets (same sizes)."""
    order = list(red._layout.order)
    first = [i for i in order if red.params[i].shape == (8, 8)]
    a, b = order.index(first[0]), order.index(first[1])
    order[a], order[b] = order[b], order[a]
    red._switch_layout(red._make_layout(order, sizes=[1] * len(order)))


def _job(case):
    from overlap.dp import GradReducer, ShardedOptimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    last = rank == world - 1
    model = _model()
    red = GradReducer(model, dp_group=dist.group.WORLD, bucket_cap_mb=0, first_bucket_cap_mb=0,
                      rebuild_buckets=case == "ar-order", shard=True, timeout=30)
    opt = (ShardedOptimizer(red, torch.optim.SGD, lr=LR) if case.startswith("ag") else None)
    out = {}

    def step(k):
        _loss(model, rank, k).backward()
        red.finish()
        if opt is not None:
            opt.step()
            opt.wait_params()

    if case == "ar-order":  # the first step all-reduces; the last rank's buckets are swapped
        if last:
            _swap_weights(red)
        t0 = time.monotonic()
        out["raised"] = _error(lambda: step(1))
    else:
        before = [p.detach().clone() for p in model.parameters()]
        step(1)
        want = _mean_grads(world, 1)
        out["step1_err"] = _shard_error(red, want)
        if opt is not None:  # the gathered parameters are the reference SGD step
            out["params_err"] = max((p - (b - LR * w)).abs().max().item()
                                    for p, b, w in zip(model.parameters(), before, want))
        model.zero_grad(set_to_none=True)
        if case == "rs-order":
            if last:
                _swap_weights(red)
            fault = lambda: step(2)  # noqa: E731
        elif case == "ag-extra":
            fault = ((lambda: (opt.step(), opt.wait_params())) if last
                     else opt.publish_masters)
        else:  # "ag-order": the last rank gathers the two weights' buckets swapped
            if last:
                weights = [b.index for b in red.buckets if b.numel == 64]
                at = [opt._gather_order.index(b) for b in weights]
                opt._gather_order[at[0]], opt._gather_order[at[1]] = weights[1], weights[0]
            fault = lambda: step(2)  # noqa: E731
        t0 = time.monotonic()
        out["raised"] = _error(fault)
    out["seconds"] = time.monotonic() - t0
    model.zero_grad(set_to_none=True)
    out["again"] = _error(lambda: step(3))  # a failure stays a failure
    if opt is not None:
        opt.close()
    red.close()
    return out


WORDS = {"rs-order": ("GradReducer bucket reduce_scatter", "params"),
         "ar-order": ("GradReducer bucket all_reduce", "params"),
         "ag-extra": ("ShardedOptimizer parameter all_gather", "disagree on step"),
         "ag-order": ("ShardedOptimizer parameter all_gather", "disagree on bucket")}
CASES = [(w, c) for w in (2, 4) for c in WORDS]


@pytest.mark.parametrize("world,case", CASES, ids=[f"w{w}-{c}" for w, c in CASES])
def test_same_size_disagreement_raises_on_every_rank(world, case):
    results = run_ranks(_job, world, case, timeout=90)
    op, field = WORDS[case]
    for rank, res in enumerate(results):
        assert res.get("step1_err", 0.0) <= TOL, (rank, res)
        assert res.get("params_err", 0.0) <= TOL, (rank, res)
        msg = res["raised"]
        assert msg is not None, f"rank {rank} did not raise on the disagreeing call: {res}"
        assert msg.startswith("Disagreement: "), msg
        assert op in msg and field in msg and "bucket" in msg, msg
        assert f"rank {rank}=" in msg, msg  # this rank's value and a peer's
        assert res["seconds"] < LIMIT_S, (rank, res)
        assert res["again"] is not None and "failed" in res["again"], (rank, res)


def _device(stamps):
    """Stamps whose comparison takes the device path (what a GPU runs) on CPU tensors; the
    stamp is written the CPU way (staging it through pinned memory needs a GPU)."""
    stamps._gpu = True  # keeps a device copy of each in-flight stamp, as on a GPU
    stamps.agree._init_device_record()
    return stamps


def test_device_path_poisons_a_disagreeing_shard_and_gather():
    """On a GPU the comparison cannot raise before the data is read (that would be a host
    sync): the reduced shard / gathered parameters must be NaN on the device meanwhile, and the
    record raises from the host mirror. Agreeing stamps leave the data alone."""
    from overlap.dist.stamp import Disagreement
    from overlap.dp.buckets import Bucket
    from overlap.dp.stamps import GATHER_BYTES, BucketStamps, GatherStamps, tail_elements

    T = tail_elements(torch.float32, 2)
    bucket = Bucket(index=0, dtype=torch.float32, params=[0], offset=0, numel=4, padded=4,
                    tail=T)
    params = [torch.zeros(4)]
    for agree in (True, False):
        st = _device(BucketStamps(rank=0, world=2, device=torch.device("cpu"), where=""))
        rows = torch.zeros(2, 2 + T)
        st.write_scatter(bucket, rows[:, 2:], params, "avg")
        tail = rows[0, 2:].clone()  # what rank 0 receives: its own stamp in row 0 ...
        if agree:  # ... and the peer's identical stamp in row 1 (the SUM of agreeing ranks)
            tail.view(2, -1)[1].copy_(tail.view(2, -1)[0])
        shard = torch.ones(2)
        st.agree._gpu = True  # compare, record and poison on the device
        if agree:
            st.verify(bucket, tail, shard)
            assert torch.equal(shard, torch.ones(2))
        else:
            with pytest.raises(Disagreement, match="GradReducer bucket reduce_scatter"):
                st.verify(bucket, tail, shard)
            assert torch.isnan(shard).all()

        gs = _device(GatherStamps(rank=0, world=2, device=torch.device("cpu"), where=""))
        slots = torch.zeros(2, GATHER_BYTES, dtype=torch.uint8)
        gs.write(bucket, torch.float32, params, 1, slots[0])
        if agree:
            slots[1].copy_(slots[0])
        out = torch.ones(4)
        gs.agree._gpu = True
        if agree:
            gs.verify(bucket, slots, out)
            gs.poison(out)
            assert torch.equal(out, torch.ones(4))
        else:
            with pytest.raises(Disagreement, match="ShardedOptimizer parameter all_gather"):
                gs.verify(bucket, slots, out)
            gs.poison(out)
            assert torch.isnan(out).all()
