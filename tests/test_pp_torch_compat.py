"""overlap.pp side by side with torch.distributed.pipelining on gloo: the same split GPT,
the same micro-batches, the same schedule family -> the same loss and gradients.

torch scales gradients by 1/m (scale_grads=True) where overlap.pp scales each micro-batch's
loss by 1/m: mathematically identical, so fp32 tolerance rtol=1e-5, atol=1e-6.
"""

import pytest
import torch
import torch.distributed as dist

from overlap.models import GPT, GPTConfig, gpt_loss
from overlap.pp import Pipeline, build_schedule, pipeline_stages
from tests.harness import run_ranks

pipelining = pytest.importorskip("torch.distributed.pipelining")

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def _side_by_side(cases):
    g = dist.group.WORLD
    p, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=31, seq_len=8, d_model=16, n_layer=2 * p, n_head=2))
    out = {}
    for name, m, v in cases:
        idx = torch.randint(0, 31, (2 * m, 8), generator=torch.Generator().manual_seed(m))
        tgt = torch.randint(0, 31, (2 * m, 8), generator=torch.Generator().manual_seed(m + 1))
        stages = pipeline_stages(model, pp_group=g, num_virtual=v)
        ours = Pipeline(stages, build_schedule(name, pp_size=p, num_microbatches=m,
                                               num_virtual=v), loss_fn=gpt_loss, pp_group=g)
        res = ours.step(idx, tgt)
        params = [q for s in stages for q in s.module.parameters()]
        our_grads = [q.grad.clone() for q in params]
        model.zero_grad(set_to_none=True)

        theirs = [pipelining.PipelineStage(s.module, s.stage_index, p * v, torch.device("cpu"),
                                           group=g) for s in stages]
        cls = getattr(pipelining, TORCH_SCHEDULES[name])
        sched = cls(theirs if v > 1 else theirs[0], m, loss_fn=gpt_loss)
        losses = []
        kwargs = {}
        if res.loss is not None:
            kwargs = {"target": tgt, "losses": losses}
        if 0 in ours.stages:
            sched.step(idx, **kwargs)
        else:
            sched.step(**kwargs)
        for q, ref in zip(params, our_grads):
            torch.testing.assert_close(q.grad, ref, rtol=1e-5, atol=1e-6)
        if res.loss is not None:
            torch.testing.assert_close(torch.stack(losses).mean(), res.loss,
                                       rtol=1e-5, atol=1e-6)
            out[name] = float(res.loss)
        model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("world, cases", [
    (2, [("gpipe", 4, 1), ("1f1b", 3, 1), ("interleaved_1f1b", 4, 2)]),
    (4, [("1f1b", 4, 1), ("interleaved_1f1b", 4, 2)]),
], ids=["p2", "p4"])
def test_same_gradients_as_torch_pipelining(world, cases):
    results = run_ranks(_side_by_side, world, cases, timeout=120)
    assert set(results[-1]) == {c[0] for c in cases}
