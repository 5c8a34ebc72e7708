"""overlap.pp executor on gloo ranks: every schedule's loss and parameter gradients equal the
unsplit model run on one process over the same micro-batches.

Tolerance (fp32): rtol=1e-5, atol=1e-6. The per-micro-batch math is the same ops as the
reference; only the order in which micro-batch gradients are summed into ``param.grad`` (and,
for ZB-H1, the split I/W backward) differ, which moves the last bits.
"""

import os

import pytest
import torch
import torch.distributed as dist

from overlap.models import GPT, GPTConfig, gpt_loss
from overlap.pp import Pipeline, P2PError, build_schedule, pipeline_stages
from tests.harness import run_ranks, run_ranks_outcomes

RTOL, ATOL = 1e-5, 1e-6
VOCAB, SEQ, D = 37, 8, 16


def _model(n_layer: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=D, n_layer=n_layer, n_head=2))


def _batch(m: int, seq, seed: int, mb_size: int = 2):
    """A (batch, seq) tensor pair, or with ``seq`` a tuple of m lengths, lists of
    micro-batches of different sequence lengths."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(seq, tuple):
        pairs = [_batch(1, t, seed + i, mb_size) for i, t in enumerate(seq)]
        return [a for a, _ in pairs], [b for _, b in pairs]
    idx = torch.randint(0, VOCAB, (m * mb_size, seq), generator=g)
    return idx, torch.randint(0, VOCAB, (m * mb_size, seq), generator=g)


def _reference(model: GPT, idx, tgt, m: int):
    """Unsplit model, same micro-batches, loss averaged over micro-batches."""
    model.zero_grad(set_to_none=True)
    losses = []
    if isinstance(idx, torch.Tensor):
        idx, tgt = idx.chunk(m), tgt.chunk(m)
    for x, y in zip(idx, tgt):
        loss = gpt_loss(model(x), y)
        (loss * (1.0 / m)).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return torch.stack(losses).mean(), grads


def _owned(model: GPT, stages) -> set[str]:
    ids = {id(q) for s in stages for q in s.module.parameters()}
    return {n for n, q in model.named_parameters() if id(q) in ids}


def _check_schedules(cases, n_layer, pp_group=None):
    """Run each (schedule, m, v, seq_lens) case; return {case: max error} on this rank."""
    group = pp_group if pp_group is not None else dist.group.WORLD
    model = _model(n_layer)
    results = {}
    for case, (name, m, v, seqs) in enumerate(cases):
        stages = pipeline_stages(model, pp_group=group, num_virtual=v)
        sched = build_schedule(name, pp_size=dist.get_world_size(group), num_microbatches=m,
                               num_virtual=v)
        pipe = Pipeline(stages, sched, loss_fn=gpt_loss, pp_group=group, timeout=30)
        owned = _owned(model, stages)
        for step, seq in enumerate(seqs):
            idx, tgt = _batch(m, seq, seed=100 * step + m)
            ref_loss, ref_grads = _reference(model, idx, tgt, m)
            out = pipe.step(idx, tgt)
            for n, q in model.named_parameters():
                if n in owned:
                    torch.testing.assert_close(q.grad, ref_grads[n], rtol=RTOL, atol=ATOL,
                                               msg=lambda s: f"{name} m={m} v={v} {n}: {s}")
                else:
                    assert q.grad is None, f"{name}: rank computed a grad it does not own: {n}"
            if sched.num_stages - 1 in pipe.stages:
                torch.testing.assert_close(out.loss, ref_loss, rtol=RTOL, atol=ATOL)
                results[(case, step)] = float(out.loss)
            else:
                assert out.loss is None
            model.zero_grad(set_to_none=True)
        # One shape table per distinct input-shape signature: repeats reused the cache.
        assert len(pipe._shapes) == len(set(seqs)), (name, seqs, len(pipe._shapes))
    return results


P2_CASES = [(name, m, 1, (SEQ, SEQ, 5)) for name in ("gpipe", "1f1b", "zb_h1")
            for m in (2, 3, 8)]
P2_CASES += [("interleaved_1f1b", m, 2, (SEQ, 5, SEQ)) for m in (2, 4, 8)]
# Sequence length varying across the micro-batches of one step (then repeated: cached).
P2_CASES += [(name, 3, 1, ((SEQ, 3, 6), (SEQ, 3, 6))) for name in ("1f1b", "zb_h1")]
P4_CASES = [(name, m, 1, (SEQ, 6)) for name in ("gpipe", "1f1b", "zb_h1") for m in (4, 7)]
P4_CASES += [("1f1b", 16, 1, (SEQ,)), ("zb_h1", 16, 1, (SEQ,)),
             ("interleaved_1f1b", 4, 2, (SEQ, 6)), ("interleaved_1f1b", 8, 2, (SEQ,))]
P1_CASES = [("gpipe", 1, 1, (SEQ,)), ("1f1b", 3, 1, (SEQ, 5)), ("zb_h1", 2, 1, (SEQ,)),
            ("interleaved_1f1b", 2, 3, (SEQ, 5))]


@pytest.mark.parametrize("world, cases, n_layer", [(1, P1_CASES, 2), (2, P2_CASES, 2),
                                                   (4, P4_CASES, 6)],
                         ids=["p1", "p2", "p4"])
def test_schedules_match_unsplit_model(world, cases, n_layer):
    results = run_ranks(_check_schedules, world, cases, n_layer, timeout=120)
    # Every case reported its loss on the rank that holds the last stage.
    assert len(results[-1]) == sum(len(c[3]) for c in cases)


def _pp_dp(cases):
    rank = dist.get_rank()
    # pp groups {0,1}, {2,3}; dp groups {0,2}, {1,3}. Every rank creates every group.
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, dp = pp_groups[rank // 2], dp_groups[rank % 2]
    model = _model(2)
    out = {}
    for name, m, v in cases:
        idx, tgt = _batch(2 * m, SEQ, seed=m)  # the global batch: 2m micro-batches
        ref_loss, ref_grads = _reference(model, idx, tgt, 2 * m)
        half = (rank // 2) * (idx.shape[0] // 2)
        local = slice(half, half + idx.shape[0] // 2)
        stages = pipeline_stages(model, pp_group=pp, num_virtual=v)
        sched = build_schedule(name, pp_size=2, num_microbatches=m, num_virtual=v)
        res = Pipeline(stages, sched, loss_fn=gpt_loss, pp_group=pp, timeout=30).step(
            idx[local], tgt[local])
        owned = _owned(model, stages)
        for n, q in model.named_parameters():
            if n in owned:
                dist.all_reduce(q.grad, group=dp)
                q.grad /= 2
                torch.testing.assert_close(q.grad, ref_grads[n], rtol=RTOL, atol=ATOL)
        if res.loss is not None:
            loss = res.loss.clone()
            dist.all_reduce(loss, group=dp)
            torch.testing.assert_close(loss / 2, ref_loss, rtol=RTOL, atol=ATOL)
            out[name] = float(loss / 2)
        model.zero_grad(set_to_none=True)
    return out


def test_pp2_dp2_matches_single_process():
    cases = [("1f1b", 2, 1), ("zb_h1", 3, 1), ("interleaved_1f1b", 2, 2)]
    results = run_ranks(_pp_dp, 4, cases, timeout=120)
    assert set(results[1]) == {c[0] for c in cases} and results[1] == results[3]


def _bad_microbatches():
    model = _model(2)
    stages = pipeline_stages(model, pp_group=dist.group.WORLD)
    pipe = Pipeline(stages, build_schedule("1f1b", pp_size=2, num_microbatches=4),
                    loss_fn=gpt_loss, pp_group=dist.group.WORLD, timeout=10)
    idx, tgt = _batch(4, SEQ, seed=0)
    errors = []
    for inputs, targets in ((idx[:6], tgt[:6]), (list(idx.chunk(3)), list(tgt.chunk(3)))):
        try:
            pipe.step(inputs, targets)
        except ValueError as exc:
            errors.append(str(exc))
    # The pipeline still works afterwards: nothing was posted before the check failed.
    pipe.step(idx, tgt)
    return errors


def test_bad_microbatch_count_is_a_clear_error():
    errors = run_ranks(_bad_microbatches, 2)
    assert "divisible by num_microbatches=4" in errors[0][0]
    assert "has 3 micro-batches on pp rank 1" in errors[1][1]
    with pytest.raises(ValueError, match="num_microbatches=2 must be >= pp_size=4"):
        build_schedule("1f1b", pp_size=4, num_microbatches=2)


def _dead_peer():
    model = _model(2)
    stages = pipeline_stages(model, pp_group=dist.group.WORLD)
    pipe = Pipeline(stages, build_schedule("1f1b", pp_size=2, num_microbatches=2),
                    loss_fn=gpt_loss, pp_group=dist.group.WORLD, timeout=20)
    idx, tgt = _batch(2, SEQ, seed=0)
    pipe.step(idx, tgt)
    if dist.get_rank() == 1:
        # Die in the middle of the next step, while rank 0 waits for a gradient.
        stages[0].module.register_forward_pre_hook(lambda *_: os._exit(7))
    pipe.step(idx, tgt)


def test_dead_peer_fails_the_survivor():
    outcomes = run_ranks_outcomes(_dead_peer, 2, timeout=60, grace=30)
    assert outcomes[1].status == "died"
    assert outcomes[0].status == "error", outcomes[0]
    assert outcomes[0].error.startswith("P2PError"), outcomes[0].error
    assert "with pp rank 1 (global rank 1)" in outcomes[0].error
    assert outcomes[0].seconds < 20  # the dead peer is noticed, not waited out
    # The message says it failed at once, not that it "timed out after 20s".
    assert "failed after" in outcomes[0].error and "timed out" not in outcomes[0].error


def _hung_peer():
    model = _model(2)
    stages = pipeline_stages(model, pp_group=dist.group.WORLD)
    sched = build_schedule("gpipe", pp_size=2, num_microbatches=2)
    idx, tgt = _batch(2, SEQ, seed=0)
    # A healthy step with a generous timeout (the machine may be loaded), then a short one.
    Pipeline(stages, sched, loss_fn=gpt_loss, pp_group=dist.group.WORLD, timeout=30).step(
        idx, tgt)
    pipe = Pipeline(stages, sched, loss_fn=gpt_loss, pp_group=dist.group.WORLD, timeout=1.5)
    if dist.get_rank() == 1:
        import time
        slept = []
        # Stall once, far longer than the 1.5 s timeout, instead of dying.
        stages[0].module.register_forward_pre_hook(
            lambda *_: slept or slept.append(time.sleep(6)))
    pipe.step(idx, tgt)


def test_hung_peer_times_out():
    outcomes = run_ranks_outcomes(_hung_peer, 2, timeout=60, grace=1)
    assert outcomes[0].status == "error", outcomes[0]
    assert "timed out after 1.5s" in outcomes[0].error and "pp rank 1" in outcomes[0].error
