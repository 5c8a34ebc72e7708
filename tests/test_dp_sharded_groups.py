"""ShardedOptimizer: param groups, global-norm clipping and state_dict, on 1, 2 and 4 ranks.

References: torch AdamW with the same two groups on one process over the whole model
(every rank feeds the same batch, so the DP average is that batch's gradient), and
torch.nn.utils.clip_grad_norm_. Tolerance 1e-6 absolute on parameters, the norm within 1e-6
relative; the state_dict round trip is bitwise. Why 1e-6 holds on any CPU: the average of the
ranks' identical gradients differs from the single-process one by at most 2 ulp (|d| <= 1.2e-7
|g|, |g| < 1 here); AdamW runs with eps=1e-3 (LR_EPS), which makes its update Lipschitz in g
(<= lr * 2|d| / eps per step; with the default 1e-8 a near-zero gradient's noise moves a
weight by +-lr), so 6 steps at lr 3e-3 stay below 6 * 3e-3 * 2 * 1.2e-7 / 1e-3 = 4.3e-9."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from harness import WORLD_SIZES, run_ranks
from overlap.dp import GradReducer, ShardedOptimizer
from overlap.models.gpt import GPT, GPTConfig

STEPS = 6
LR_EPS = dict(lr=3e-3, eps=1e-3)  # eps: see the docstring
MAX_NORM = 0.05  # below the gradient norm of every step: clipping is active


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 or "emb" in n]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _batch(step):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 29, (3, 8), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _body():
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=29, seq_len=8, d_model=16, n_layer=2, n_head=2, bias=False))
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(_groups(ref), **LR_EPS)
    model = copy.deepcopy(base)
    # small buckets: groups alternate inside bucket shards
    red = GradReducer(model, dp_group=dist.group.WORLD, shard=True, bucket_cap_mb=0.001,
                      first_bucket_cap_mb=0.001, rebuild_buckets=False)
    opt = ShardedOptimizer(red, torch.optim.AdamW, param_groups=_groups(model), **LR_EPS)
    norms, ref_norms, saved = [], [], None
    for step in range(STEPS):
        if step == STEPS - 2:
            saved = (opt.state_dict(), [p.detach().clone() for p in model.parameters()])
        for m, o in ((ref, None), (model, opt)):
            idx, tgt = _batch(step)
            _, loss = m(idx, tgt)
            loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        ref_opt.step()
        ref_opt.zero_grad()
        sq = opt.grad_norm_sq()
        dist.all_reduce(sq)
        norm = sq.sqrt()
        opt.scale_grads_((MAX_NORM / (norm + 1e-6)).clamp(max=1.0))
        norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    opt.wait_params()
    param_err = max((p - q).abs().max().item() for p, q in zip(model.parameters(),
                                                                 ref.parameters()))
    final = [p.detach().clone() for p in model.parameters()]
    groups = [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups]
    # state_dict round trip: a fresh optimizer loaded with the state of step STEPS-2 and the
    # parameters of then replays the last two steps bit for bit
    model2 = copy.deepcopy(base)
    red2 = GradReducer(model2, dp_group=dist.group.WORLD, shard=True, bucket_cap_mb=0.001,
                       first_bucket_cap_mb=0.001, rebuild_buckets=False)
    opt2 = ShardedOptimizer(red2, torch.optim.AdamW, param_groups=_groups(model2), **LR_EPS)
    with torch.no_grad():
        for p, w in zip(model2.parameters(), saved[1]):
            p.copy_(w)
    opt2.load_state_dict(saved[0])
    for step in range(STEPS - 2, STEPS):
        idx, tgt = _batch(step)
        _, loss = model2(idx, tgt)
        loss.backward()
        sq = opt2.grad_norm_sq()
        dist.all_reduce(sq)
        norm = sq.sqrt()
        opt2.scale_grads_((MAX_NORM / (norm + 1e-6)).clamp(max=1.0))
        opt2.step()
        opt2.zero_grad()
    opt2.wait_params()
    replay_equal = all(torch.equal(p, q) for p, q in zip(model2.parameters(), final))
    # loading a state of another layout is refused
    bad = dict(saved[0], dp=(99, 0))
    try:
        opt2.load_state_dict(bad)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    for o, r in ((opt, red), (opt2, red2)):
        o.close()
        r.close()
    return dict(norms=norms, ref_norms=ref_norms, param_err=param_err, groups=groups,
                replay_equal=replay_equal, refused=refused,
                num_segments=len(opt.masters), num_buckets=len(red.buckets))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_groups_clipping_and_state_dict(world):
    for res in run_ranks(_body, world, timeout=120):
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(res["ref_norms"]),
                                   rtol=1e-6, atol=0)
        assert all(n > MAX_NORM for n in res["ref_norms"])  # clipping was active every step
        assert res["param_err"] <= 1e-6, res["param_err"]
        assert res["replay_equal"]
        assert "another layout" in res["refused"]
        assert [wd for _, wd in res["groups"]] == [0.1, 0.0]
        assert res["num_segments"] >= res["num_buckets"]


def _bf16_body():
    from overlap.train.precision import MasterOptimizer

    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=29, seq_len=8, d_model=16, n_layer=2, n_head=2)).to(
        torch.bfloat16)
    ref = copy.deepcopy(base)
    ref_opt = MasterOptimizer(_groups(ref), torch.optim.AdamW, **LR_EPS)
    model = copy.deepcopy(base)
    red = GradReducer(model, dp_group=dist.group.WORLD, shard=True, bucket_cap_mb=0.001,
                      first_bucket_cap_mb=0.001, rebuild_buckets=False,
                      grad_dtype=torch.float32)
    opt = ShardedOptimizer(red, torch.optim.AdamW, param_groups=_groups(model), **LR_EPS)
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            idx, tgt = _batch(step)  # the same batch on every rank: the DP mean is exact
            _, loss = m(idx, tgt)
            loss.float().backward()
            o.step()
            o.zero_grad()
    opt.wait_params()
    out = dict(
        equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())),
        param_dtypes={str(p.dtype) for p in model.parameters()},
        buffer_dtypes=sorted(str(dt) for dt in opt.flat_params),
        grad_dtypes=sorted({str(b.dtype) for b in red.buckets}),
        master_dtypes={str(m.dtype) for m in opt.masters},
        moved=any(not torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters())))
    opt.close()
    red.close()
    # a bucket mixing parameter dtypes (fp32 norms, bf16 matrices, one fp32 gradient buffer)
    mixed = copy.deepcopy(base)
    for mod in mixed.modules():
        if isinstance(mod, torch.nn.LayerNorm):
            mod.float()
    red2 = GradReducer(mixed, dp_group=dist.group.WORLD, shard=True, grad_dtype=torch.float32,
                       rebuild_buckets=False)
    try:
        ShardedOptimizer(red2, torch.optim.AdamW, **LR_EPS)
        out["refused"] = ""
    except ValueError as exc:
        out["refused"] = str(exc)
    red2.close()
    return out


@pytest.mark.parametrize("world", [2])
def test_bf16_params_fp32_main_grads_and_masters(world):
    """bf16 parameters, fp32 main grads (grad_dtype) and fp32 masters: bitwise the one-process
    MasterOptimizer's AdamW (every rank feeds the same batch, so the fp32 DP mean of the bf16
    gradients is exact); bf16 parameter buffers for the all-gather, fp32 gradient buckets."""
    for res in run_ranks(_bf16_body, world, timeout=120):
        assert res["equal"] and res["moved"]
        assert res["param_dtypes"] == {"torch.bfloat16"}
        assert res["buffer_dtypes"] == ["torch.bfloat16"]
        assert res["grad_dtypes"] == ["torch.float32"]
        assert res["master_dtypes"] == {"torch.float32"}
        assert "holds parameters of dtypes torch.bfloat16, torch.float32" in res["refused"]
