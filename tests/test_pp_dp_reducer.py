"""Pipeline x data parallelism with the real DP reducer: pp=2 x dp=2 on 4 processes.

Each stage gets its own GradReducer over its DP group, synchronising only during the stage's
last gradient-accumulating action of the step (``PipelineStage.last_backward``), which is how
``overlap.train`` wires them. After each step every owned gradient must equal the unsplit model
on one process over the whole global batch (fp32, rtol 1e-5, atol 1e-6), including the second
step, which runs with the buckets rebuilt in gradient-ready order.
"""

import torch
import torch.distributed as dist

from harness import run_ranks
from overlap.dp.grad_reducer import GradReducer
from overlap.pp import Pipeline, build_schedule, pipeline_stages
from test_pp_executor import ATOL, RTOL, SEQ, _batch, _model, _owned, _reference
from overlap.models import gpt_loss


def _pp_dp_with_reducer(cases):
    rank = dist.get_rank()
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, dp = pp_groups[rank // 2], dp_groups[rank % 2]
    model = _model(2)
    worst = {}
    for name, m, v in cases:
        stages = pipeline_stages(model, pp_group=pp, num_virtual=v)
        reducers = []
        for stage in stages:
            red = GradReducer(stage.module, dp_group=dp, bucket_cap_mb=0.001,
                              first_bucket_cap_mb=0.001)
            red.sync_if(lambda s=stage: s.last_backward)
            reducers.append(red)
        pipe = Pipeline(stages, build_schedule(name, pp_size=2, num_microbatches=m,
                                               num_virtual=v),
                        loss_fn=gpt_loss, pp_group=pp, timeout=60)
        owned = _owned(model, stages)
        err = 0.0
        for step in range(2):
            idx, tgt = _batch(2 * m, SEQ, seed=10 * m + step)
            _, ref_grads = _reference(model, idx, tgt, 2 * m)
            for red in reducers:
                red.zero_grad()
            half = (rank // 2) * (idx.shape[0] // 2)
            local = slice(half, half + idx.shape[0] // 2)
            pipe.step(idx[local], tgt[local])
            for n, q in model.named_parameters():
                if n in owned:
                    torch.testing.assert_close(q.grad, ref_grads[n], rtol=RTOL, atol=ATOL)
                    err = max(err, float((q.grad - ref_grads[n]).abs().max()))
        worst[name] = err
        for red in reducers:
            red.close()
        model.zero_grad(set_to_none=True)
    return worst


def test_pp2_dp2_with_grad_reducer_matches_single_process():
    cases = [("1f1b", 2, 1), ("zb_h1", 3, 1), ("interleaved_1f1b", 2, 2), ("gpipe", 2, 1)]
    results = run_ranks(_pp_dp_with_reducer, 4, cases, timeout=180)
    for r in results:
        assert set(r) == {c[0] for c in cases}
        assert all(e <= 1e-5 for e in r.values()), r


def _pp_dp_sharded(cases):
    """Each stage's ShardedOptimizer (SGD, lr 1) over a sharded reducer; after each step every
    owned parameter must equal SGD on the unsplit model over the whole global batch."""
    from overlap.dp.sharded_optimizer import ShardedOptimizer

    rank = dist.get_rank()
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, dp = pp_groups[rank // 2], dp_groups[rank % 2]
    worst = {}
    for name, m in cases:
        model, ref = _model(2), _model(2)
        stages = pipeline_stages(model, pp_group=pp)
        opts = []
        for stage in stages:
            red = GradReducer(stage.module, dp_group=dp, bucket_cap_mb=0.001,
                              first_bucket_cap_mb=0.001, shard=True)
            red.sync_if(lambda s=stage: s.last_backward)
            opts.append(ShardedOptimizer(red, torch.optim.SGD, lr=1.0))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
        pipe = Pipeline(stages, build_schedule(name, pp_size=2, num_microbatches=m),
                        loss_fn=gpt_loss, pp_group=pp, timeout=60)
        owned = _owned(model, stages)
        want = dict(ref.named_parameters())
        err = 0.0
        # Step 0 all-reduces then rebuilds the buckets; later steps reduce-scatter.
        for step in range(3):
            idx, tgt = _batch(2 * m, SEQ, seed=10 * m + step)
            _, ref_grads = _reference(ref, idx, tgt, 2 * m)
            for n, q in ref.named_parameters():
                q.grad = ref_grads[n]
            ref_opt.step()
            half = (rank // 2) * (idx.shape[0] // 2)
            local = slice(half, half + idx.shape[0] // 2)
            pipe.step(idx[local], tgt[local])
            for opt in opts:
                opt.step()
                opt.zero_grad()
            for opt in opts:
                opt.wait_params()
            with torch.no_grad():
                for n, q in model.named_parameters():
                    if n in owned:
                        torch.testing.assert_close(q, want[n], rtol=RTOL, atol=1e-5)
                        err = max(err, float((q - want[n]).abs().max()))
        worst[name] = err
        for opt in opts:
            opt.close()
            opt.reducer.close()
    return worst


def test_pp2_dp2_with_sharded_optimizer_matches_single_process():
    # ZB-H1's W runs several autograd backward calls; the reducer must sync only in the last.
    cases = [("1f1b", 2), ("zb_h1", 3)]
    results = run_ranks(_pp_dp_sharded, 4, cases, timeout=120)
    for r in results:
        assert set(r) == {c[0] for c in cases}
        assert all(e <= 1e-5 for e in r.values()), r
