"""Per-call agreement of GradReducer buckets (issue 23 item 2), on 2 and 4 ranks under nccl_twin.

The first synchronising step agrees (its gradients equal the reference average); before the
second, the last rank's reducer is switched to another bucket layout (a fault injected through
the private ``_switch_layout``: what a rank-local layout change, a tuner that decided alone or a
model built differently would do). Every rank must raise within 2 s of the second backward,
naming the reducer's bucket op and both ranks' values, for

- "size": bucket 0 holds a different number of elements on the last rank;
- "same-size": bucket 0 holds the same number of elements but other parameters (two weights of
  the same shape swapped), which no size check can see: without a stamp the ranks would sum
  one parameter's gradient into the other's.

comm_dtype "fp32" carries the stamp in a tail of each bucket's flat buffer (summed with it);
"int8" the quantized collective's own stamp, whose ``tag`` holds the bucket's index and
parameter signature."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import run_ranks

LIMIT_S = 2.0


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False),
                         nn.Tanh(), nn.Linear(8, 4))


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g)
    return model(x).square().mean()


def _step_error(model, red, rank, step):
    """What a backward + finish of ``step`` raised ("Type: message"), or None."""
    try:
        _loss(model, rank, step).backward()
        red.finish()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return None


def _job(case, comm_dtype):
    from overlap.dp import GradReducer

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    red = GradReducer(model, dp_group=dist.group.WORLD, bucket_cap_mb=0, first_bucket_cap_mb=0,
                      rebuild_buckets=False, comm_dtype=comm_dtype, timeout=30)
    out = {}
    try:
        _loss(model, rank, 1).backward()
        # step 1 agrees: the gradients are the average over ranks
        refs = []
        for r in range(world):
            m = _model()
            _loss(m, r, 1).backward()
            refs.append([p.grad for p in m.parameters()])
        want = [sum(g[i] for g in refs) / world for i in range(len(refs[0]))]
        scale = max(w.abs().max().item() for w in want)
        out["step1_err"] = max((p.grad - w).abs().max().item() / scale
                               for p, w in zip(model.parameters(), want))
        # step 2: the last rank lays its buckets out differently
        if rank == world - 1:
            order = list(red._layout.order)
            if case == "size":  # params 0 and 1 (two weights) share bucket 0
                layout = red._make_layout(order, sizes=[2] + [1] * (len(order) - 2))
            else:  # bucket 0 and 1 hold the two 8x8 weights, swapped
                first = [i for i in order if red.params[i].shape == (8, 8)]
                a, b = order.index(first[0]), order.index(first[1])
                order[a], order[b] = order[b], order[a]
                layout = red._make_layout(order, sizes=[1] * len(order))
            red._switch_layout(layout)
        model.zero_grad(set_to_none=True)
        t0 = time.monotonic()
        out["raised"] = _step_error(model, red, rank, 2)
        out["seconds"] = time.monotonic() - t0
        # the reducer stays failed: the next step raises again, at once
        out["again"] = _step_error(model, red, rank, 3)
    finally:
        red.close()
    return out


CASES = [(w, c, d) for w in (2, 4) for c in ("size", "same-size") for d in ("fp32", "int8")]


@pytest.mark.parametrize("world,case,comm_dtype", CASES,
                         ids=[f"w{w}-{c}-{d}" for w, c, d in CASES])
def test_bucket_disagreement_after_first_step_raises_everywhere(world, case, comm_dtype):
    results = run_ranks(_job, world, case, comm_dtype, timeout=90)
    for rank, res in enumerate(results):
        tol = 1e-6 if comm_dtype == "fp32" else 2e-2  # int8: S/127 of the block's scale
        assert res["step1_err"] <= tol, (rank, res)
        msg = res["raised"]
        assert msg is not None, f"rank {rank} did not raise on the disagreeing step: {res}"
        assert res["seconds"] < LIMIT_S, (rank, res)
        assert "bucket" in msg and "GradReducer" in msg, msg
        assert "rank" in msg and "disagree" in msg, msg
        assert res["again"] is not None, res


def _device_stamps(rank, world):
    """BucketStamps whose comparison takes the device path (what a GPU runs) on CPU tensors;
    the stamp is written the CPU way (staging it through pinned memory needs a GPU)."""
    from overlap.dp.stamps import BucketStamps

    st = BucketStamps(rank=rank, world=world, device=torch.device("cpu"), where="")
    st._gpu = True  # keeps a device copy of each in-flight stamp, as on a GPU
    st.agree._init_device_record()
    return st


def test_device_path_poisons_a_disagreeing_bucket_and_raises():
    """On a GPU the comparison cannot raise before the optimizer reads the gradients (that would
    be a host sync): the reduced bucket must be NaN on the device meanwhile, and the record
    raises from the host mirror. A bucket whose stamps agree is left alone."""
    from overlap.dist.stamp import Disagreement
    from overlap.dp.buckets import Bucket
    from overlap.dp.stamps import tail_elements

    bucket = Bucket(index=0, dtype=torch.float32, params=[0], offset=0, numel=4, padded=4,
                    tail=tail_elements(torch.float32, 2))
    params = [torch.zeros(4)]
    for agree in (True, False):
        st = _device_stamps(0, 2)
        tail = torch.zeros(bucket.tail)
        st.write(bucket, tail, params, "avg")
        rows = tail.view(2, -1)
        if agree:  # the peer's row: the same stamp (what the SUM delivers when ranks agree)
            rows[1].copy_(rows[0])
        grads = torch.ones(4)
        st.agree._gpu = True  # compare, record and poison on the device
        if agree:
            st.verify(bucket, tail, grads)
            assert torch.equal(grads, torch.ones(4))
        else:  # the peer wrote nothing this rank recognises
            with pytest.raises(Disagreement, match="GradReducer bucket all_reduce"):
                st.verify(bucket, tail, grads)
            assert torch.isnan(grads).all()


def _launch_after_failure_job():
    from overlap.comm import quant
    from overlap.dp import GradReducer

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    red = GradReducer(model, dp_group=dist.group.WORLD, bucket_cap_mb=0, first_bucket_cap_mb=0,
                      rebuild_buckets=False, comm_dtype="int8", timeout=30)
    out = {}
    try:
        _loss(model, rank, 1).backward()
        red.finish()
        # the group's quantized exchange fails outside the reducer: ranks pass different sizes
        try:
            quant.all_reduce(torch.ones(4 + 4 * (rank == world - 1)), group=dist.group.WORLD,
                             comm_dtype="int8", timeout=30)
            out["direct"] = None
        except Exception as exc:  # noqa: BLE001
            out["direct"] = f"{type(exc).__name__}: {exc}"
        # the next bucket launch raises at once, naming the reducer and its bucket
        model.zero_grad(set_to_none=True)
        out["raised"] = _step_error(model, red, rank, 2)
    finally:
        red.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_launch_on_a_failed_group_names_the_bucket(world):
    """A bucket launched after the group's quantized exchange failed (an earlier bucket found
    the ranks disagreeing while the backward was still launching: a race the full test above
    hits now and then) raises with the reducer and bucket in front of the first error."""
    for rank, res in enumerate(run_ranks(_launch_after_failure_job, world, timeout=90)):
        assert res["direct"] is not None and "disagree" in res["direct"], (rank, res)
        msg = res["raised"]
        assert msg is not None, (rank, res)
        assert msg.startswith("QuantCommFailed: GradReducer: rank"), msg
        assert "bucket" in msg and "disagree on numel" in msg, msg


def _no_sync_skew(shard):
    """Step 0 agrees. Step 1: the last rank accumulates one micro-batch more inside no_sync()
    than its peers, so its first synchronising backward pairs with theirs call for call: the
    call numbers agree, the backward passes summed do not (1 vs 2)."""
    from overlap.dp import GradReducer

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    red = GradReducer(model, dp_group=dist.group.WORLD, bucket_cap_mb=0, first_bucket_cap_mb=0,
                      rebuild_buckets=False, shard=shard, timeout=30)
    try:
        first = _step_error(model, red, rank, 0)
        grads = [p.grad.detach().clone() for p in model.parameters()] if not shard else None
        if rank == world - 1:
            with red.no_sync():
                _loss(model, rank, 10).backward()
        t0 = time.monotonic()
        second = _step_error(model, red, rank, 1)
        return first, second, time.monotonic() - t0, grads
    finally:
        red.close()


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_leaves_no_sync_at_another_step_raises_everywhere(world, shard):
    res = run_ranks(_no_sync_skew, world, shard, timeout=60)
    for rank, (first, second, seconds, grads) in enumerate(res):
        assert first is None, (rank, first)
        assert second is not None and "Disagreement" in second, (rank, second)
        assert "backward passes" in second and seconds < LIMIT_S, (rank, second, seconds)
    if not shard:  # the agreeing step: the average of every rank's gradient
        model = _model()
        for r in range(world):
            (_loss(model, r, 0) / world).backward()
        for rank, (*_, grads) in enumerate(res):
            for got, want in zip(grads, (p.grad for p in model.parameters())):
                # fp32 sums of `world` terms in another order: a few ulps of the largest term
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), rank
