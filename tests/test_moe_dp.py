"""Data parallelism around the MoE layer (issue 26 item 2): dense parameters reduce over DP,
expert parameters over the expert-data-parallel group (the ranks holding the same experts)
with the DP size as the divisor, and the result equals one process that runs every rank's
batch through the full layer (the mean of the ranks' losses).

Layouts (ParallelDims, tp 1): dp 2 ep 2 (EDP of 1), dp 4 ep 2 (EDP of 2), dp 4 ep 4, dp 2
ep 1 (EDP = DP). Tolerance: fp32, 1e-5 relative to max(1, max|ref|): the sharded and the
single-process sides differ in summation order only (reduction lengths of at most 64 here,
a few ulps each), far below that on any x86 summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_ranks

D, FF, E, K = 16, 32, 8, 2
TOL = 1e-5


def _rel(a, b) -> float:
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


class _Net(nn.Module):
    """A dense layer, then an MoE layer with a shared expert, then a dense head."""

    def __init__(self, comm, cf):
        from overlap.moe import MoE

        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D, FF, E, K, comm=comm, capacity_factor=cf, shared_d_ff=16)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.moe(torch.tanh(self.inp(x))))


def _batch(r):
    g = torch.Generator().manual_seed(r)
    return torch.randn(10, D, generator=g), torch.randn(10, D, generator=g)


def _reduced(dp, ep, cf, sharded=False):
    from overlap.dist import ParallelDims
    from overlap.dp import GradReducer, ShardedOptimizer
    from overlap.moe import split_expert_parameters

    dims = ParallelDims.build(dp=dp, ep=ep)
    comm = dims.ep_comm(timeout=30)
    torch.manual_seed(0)
    net = _Net(comm, cf)
    dense, expert = split_expert_parameters(net)
    reducers = [GradReducer(net, dp_group=dims.dp_group, params=dense, timeout=30,
                            shard=sharded),
                GradReducer(net, dp_group=dims.edp_group, params=expert, divisor=dp,
                            timeout=30, shard=sharded)]
    torch.manual_seed(0)
    ref = _Net(None, cf)
    if sharded:
        return _sharded_steps(dims, net, ref, reducers, ShardedOptimizer, dp, ep)
    errs = {}
    for step in range(2):
        x, t = _batch(100 * step + dims.dp_rank)
        ((net(x) - t) ** 2).mean().backward()
        batches = [_batch(100 * step + r) for r in range(dp)]
        (sum(((ref(bx) - bt) ** 2).mean() for bx, bt in batches) / dp).backward()
        el = E // ep
        mine = slice(dims.ep_rank * el, (dims.ep_rank + 1) * el)
        rp = dict(ref.named_parameters())
        for n, p in net.named_parameters():
            want = rp[n].grad[mine] if ".experts." in n else rp[n].grad
            errs[f"{step} {n}"] = _rel(p.grad, want)
        for m in (net, ref):
            m.zero_grad(set_to_none=True)
    for r in reducers:
        r.close()
    return errs, [p.shape[0] for p in expert]


@pytest.mark.parametrize("dp,ep", [(2, 2), (4, 2), (4, 4), (2, 1)])
@pytest.mark.parametrize("cf", [None, 1.0])
def test_expert_gradients_reduce_over_the_expert_data_parallel_group(dp, ep, cf):
    for rank, (errs, expert_rows) in enumerate(run_ranks(_reduced, dp, dp, ep, cf,
                                                         timeout=120)):
        assert expert_rows == [E // ep] * 2, (rank, expert_rows)
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad, f"rank {rank} (dp {dp}, ep {ep}): beyond {TOL}: {bad}"


def _sharded_steps(dims, net, ref, reducers, sharded_cls, dp, ep):
    """Two ShardedOptimizers (dense over DP, experts over EDP) vs AdamW on one process, 3
    steps. AdamW's eps (1e-3) is far above a gradient's rounding difference, so a step is
    known to ~1e-7 of lr even where the gradient is near zero."""
    opts = [sharded_cls(r, torch.optim.AdamW, lr=1e-2, eps=1e-3) for r in reducers]
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    el = E // ep
    mine = slice(dims.ep_rank * el, (dims.ep_rank + 1) * el)
    for step in range(3):
        x, t = _batch(100 * step + dims.dp_rank)
        ((net(x) - t) ** 2).mean().backward()
        batches = [_batch(100 * step + r) for r in range(dp)]
        (sum(((ref(bx) - bt) ** 2).mean() for bx, bt in batches) / dp).backward()
        for o in opts:
            o.step()
            o.zero_grad()
        ropt.step()
        ropt.zero_grad(set_to_none=True)
    for o in opts:
        o.wait_params()
    rp = dict(ref.named_parameters())
    errs = {n: _rel(p.detach(), rp[n].detach()[mine] if ".experts." in n else rp[n].detach())
            for n, p in net.named_parameters()}
    for o in opts:
        o.close()
    for r in reducers:
        r.close()
    return errs, [E // ep] * 2


@pytest.mark.parametrize("dp,ep", [(2, 2), (4, 2)])
def test_sharded_optimizers_per_group_equal_adamw_on_one_process(dp, ep):
    for rank, (errs, _) in enumerate(run_ranks(_reduced, dp, dp, ep, None, True,
                                               timeout=120)):
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad, f"rank {rank} (dp {dp}, ep {ep}): beyond {TOL}: {bad}"


def _bad_params():
    from overlap.dp import GradReducer

    net, other = nn.Linear(4, 4), nn.Linear(4, 4)
    out = []
    for kw in (dict(params=[other.weight]), dict(params=[net.weight, net.weight]),
               dict(params=[]), dict(divisor=0), dict(divisor=2.0)):
        try:
            GradReducer(net, dp_group=dist.group.WORLD, timeout=30, **kw).close()
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_bad_params_or_divisor_is_a_clear_error():
    errs = run_ranks(_bad_params, 2, timeout=60)
    for rank, e in enumerate(errs):
        assert all(m is not None and f"rank {rank}" in m for m in e), e
        assert "params must be distinct parameters of the module" in e[0], e[0]
        assert "entries [0]" in e[0] and "entries [1]" in e[1], e
        assert "params is empty" in e[2], e[2]
        assert "divisor must be a positive int" in e[3] and "2.0" in e[4], e
