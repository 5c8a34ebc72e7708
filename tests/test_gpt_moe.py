"""overlap's GPT with MoE blocks (issue 26 item 3, the model): the auxiliary losses train the
router through the activations' gradient, and the model with its experts sharded over an EP
group equals the model on one process.

Tolerance: fp32, 1e-5 relative to max(1, max|ref|) on every gradient: the two sides differ
only in summation order (grouped GEMM vs per-expert GEMMs, all-reduced partial sums), a few
ulps times reduction lengths of at most a few hundred here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

TOL = 1e-5


def _config(**kw):
    from overlap.models.gpt import GPTConfig

    base = dict(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4, moe_experts=4,
                moe_top_k=2, moe_shared=1, moe_token_groups=2, moe_aux_coef=0.1,
                moe_z_coef=0.01)
    return GPTConfig(**{**base, **kw})


def _rel(a, b) -> float:
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def _tokens(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


@pytest.mark.parametrize("cf", [None, 1.0])
def test_aux_losses_reach_the_router_as_if_added_to_the_loss(cf):
    """With the auxiliary losses injected at scale s, every gradient equals that of
    loss + s * sum over MoE blocks of (aux_coef * lb + z_coef * z)."""
    from overlap.models.gpt import GPT, MoEMLP, gpt_loss

    cfg = _config(capacity_factor=cf)
    torch.manual_seed(0)
    a = GPT(cfg)
    torch.manual_seed(0)
    b = GPT(cfg)
    mlps_a = [m for m in a.modules() if isinstance(m, MoEMLP)]
    mlps_b = [m for m in b.modules() if isinstance(m, MoEMLP)]
    assert len(mlps_a) == 2
    for m in mlps_a:
        m.aux_scale = 0.25
    for m in mlps_b:
        m.coefs = (0.0, 0.0)  # no injection: the aux terms are added to the loss by hand
    x, y = _tokens(1)
    gpt_loss(a(x), y).backward()
    loss_b = gpt_loss(b(x), y) + 0.25 * sum(0.1 * m.last_aux[0] + 0.01 * m.last_aux[1]
                                            for m in mlps_b)
    loss_b.backward()
    pb = dict(b.named_parameters())
    errs = {n: _rel(p.grad, pb[n].grad) for n, p in a.named_parameters()}
    assert max(errs.values()) <= TOL, errs
    router = a.blocks[0].mlp.moe.router.weight.grad
    torch.manual_seed(0)
    c = GPT(_config(capacity_factor=cf, moe_aux_coef=0.0, moe_z_coef=0.0))
    gpt_loss(c(x), y).backward()
    assert _rel(router, c.blocks[0].mlp.moe.router.weight.grad) > 1e-4  # the aux terms count


def _sharded(cf, every, backend):
    from overlap.models.gpt import GPT, gpt_loss
    from overlap.moe import EPComm, split_expert_parameters

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(capacity_factor=cf, moe_every=every, n_layer=2 * every)
    extra = dict(max_tokens=16) if backend == "symmetric" else {}
    comm = EPComm(dist.group.WORLD, timeout=30, backend=backend, **extra)
    torch.manual_seed(0)
    model = GPT(cfg, ep_comm=comm)
    torch.manual_seed(0)
    ref = GPT(cfg)
    x, y = _tokens(10 + rank)
    gpt_loss(model(x), y).backward()
    dense, expert = split_expert_parameters(model)
    for p in dense:  # the DP reduction (sum): every rank ran its own batch
        dist.all_reduce(p.grad)
    batches = [_tokens(10 + r) for r in range(world)]
    sum(gpt_loss(ref(bx), by) for bx, by in batches).backward()
    el = cfg.moe_experts // world
    mine = slice(rank * el, (rank + 1) * el)
    rp = dict(ref.named_parameters())
    errs = {n: _rel(p.grad, rp[n].grad[mine] if ".experts." in n else rp[n].grad)
            for n, p in model.named_parameters()}
    comm.close()
    return errs, len(expert)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cf,every,backend", [(None, 1, "chunked"), (1.0, 2, "chunked"),
                                              (None, 2, "symmetric")])
def test_gpt_with_experts_sharded_over_ep_equals_one_process(world, cf, every, backend):
    for rank, (errs, n_expert) in enumerate(run_ranks(_sharded, world, cf, every, backend,
                                                      timeout=120)):
        assert n_expert == 2 * 2, (rank, n_expert)  # 2 MoE blocks x (gate_up, down)
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad, f"rank {rank}: beyond {TOL}: {bad}"


@pytest.mark.parametrize("kw, match", [
    (dict(moe_experts=-1), "moe_experts must be an int >= 0"),
    (dict(moe_top_k=5), "moe_top_k=5 is larger than moe_experts=4"),
    (dict(moe_token_groups=3), "seq_len=16 must be divisible by moe_token_groups=3"),
    (dict(moe_every=0), "moe_every must be a positive int"),
    (dict(moe_shared=-1), "moe_shared, moe_aux_coef and moe_z_coef must be >= 0"),
])
def test_bad_moe_config_is_a_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)
