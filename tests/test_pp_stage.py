"""overlap.pp stages: the split I/W backward, model splitting, stage/pipeline argument checks,
and the gradient hooks a data-parallel reducer relies on."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.models import GPT, GPTConfig, gpt_loss, pipeline_piece_costs
from overlap.pp import Pipeline, PipelineStage, build_schedule, pipeline_stages, split_pieces
from overlap.pp.backward import backward_input, backward_weight
from tests.harness import run_ranks


def _gpt(n_layer=3, vocab=29, seq=7, d=12, heads=3):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, seq_len=seq, d_model=d, n_layer=n_layer,
                         n_head=heads))


class _Shared(nn.Module):
    """The same Linear twice (a weight reached from two boundary nodes) plus a free bias."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.extra = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x))) * 2 + self.extra


class _IgnoresInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5))

    def forward(self, x):
        return self.w.sum(0).expand(x.shape[0], 5) * 1.5


def _cases():
    gpt = _gpt()
    pieces = gpt.pipeline_pieces()
    tgt = torch.randint(0, 29, (3, 7), generator=torch.Generator().manual_seed(1))
    return [
        ("gpt_blocks_and_head_loss", nn.Sequential(*pieces[2:]), (3, 7, 12),
         lambda out: gpt_loss(out, tgt)),
        ("gpt_two_blocks", nn.Sequential(*pieces[1:3]), (3, 7, 12), None),
        ("shared_weight", _Shared(), (4, 5), None),
        ("ignores_input", _IgnoresInput(), (4, 5), None),
    ]


@pytest.mark.parametrize("case", range(4), ids=[c[0] for c in _cases()])
def test_split_backward_equals_full_backward(case):
    _, module, shape, loss = _cases()[case]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    params = list(module.parameters())

    def run(split):
        module.zero_grad(set_to_none=True)
        fired = []
        handles = [q.register_post_accumulate_grad_hook(lambda q: fired.append(id(q)))
                   for q in params]
        xi = x.clone().requires_grad_(True)
        out = module(xi)
        out = loss(out) if loss else out
        dy = None if loss else torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        if split:
            dx, state = backward_input(out, dy, xi, params)
            assert fired == [] and all(q.grad is None for q in params)
            backward_weight(state)
        else:
            torch.autograd.backward(out, dy)
            dx = xi.grad if xi.grad is not None else torch.zeros_like(xi)
        for h in handles:
            h.remove()
        return dx, [q.grad.clone() for q in params], sorted(fired)

    full, split = run(False), run(True)
    # Same ops on the same values; only the graph traversal differs: equal to fp32 rounding.
    torch.testing.assert_close(split[0], full[0], rtol=1e-6, atol=1e-7)
    for a, b in zip(split[1], full[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert split[2] == full[2]  # every post-accumulate-grad hook fired, as many times


def test_split_pieces_balances_costs():
    pieces = [nn.Identity() for _ in range(6)]
    sizes = [len(c) for c in split_pieces(pieces, 3)]
    assert sizes == [2, 2, 2]
    chunks = split_pieces(pieces, 3, costs=[0, 5, 5, 5, 5, 10])
    assert [len(c) for c in chunks] == [3, 2, 1]  # max chunk cost 10
    assert chunks[0][0] is pieces[0]  # shared, not copied
    gpt = _gpt(n_layer=4, vocab=500)
    costs = pipeline_piece_costs(gpt.config)
    # The head (2*d*V) is heavier than a block here: it gets a chunk of its own.
    assert [len(c) for c in split_pieces(gpt.pipeline_pieces(), 4, costs=costs)][-1] == 1
    with pytest.raises(ValueError, match=r"num_chunks=7 must be in \[1, 6\]"):
        split_pieces(pieces, 7)
    with pytest.raises(ValueError, match="costs must be 6 non-negative"):
        split_pieces(pieces, 2, costs=[1, 2])


def _stage_checks():
    g = dist.group.WORLD
    rank = dist.get_rank()
    errors = []
    try:
        PipelineStage(nn.Linear(2, 2), stage_index=1 - rank, num_stages=2, pp_group=g)
    except ValueError as exc:
        errors.append(str(exc))
    gpt = _gpt(n_layer=2)
    stages = pipeline_stages(gpt, pp_group=g)
    try:
        Pipeline(stages, build_schedule("interleaved_1f1b", pp_size=2, num_microbatches=2,
                                        num_virtual=2), loss_fn=gpt_loss, pp_group=g)
    except ValueError as exc:
        errors.append(str(exc))
    # Post-accumulate-grad hooks (what a DP reducer uses) and the last_backward flag.
    results = {}
    for name, m in (("1f1b", 3), ("zb_h1", 3), ("gpipe", 2)):
        gpt.zero_grad(set_to_none=True)
        log = []
        handles = [q.register_post_accumulate_grad_hook(
            lambda q, s=s: log.append((id(q), s.last_backward)))
            for s in stages for q in s.parameters()]
        pipe = Pipeline(stages, build_schedule(name, pp_size=2, num_microbatches=m),
                        loss_fn=gpt_loss, pp_group=g, timeout=30)
        idx = torch.randint(0, 29, (2 * m, 7), generator=torch.Generator().manual_seed(m))
        pipe.step(idx, idx)
        for h in handles:
            h.remove()
        per_param = {}
        for pid, last in log:
            per_param.setdefault(pid, []).append(last)
        results[name] = sorted({tuple(v) for v in per_param.values()})
        assert len(per_param) == len(stages[0].parameters())
    return errors, results


def test_stage_errors_and_grad_hooks():
    for rank, (errors, results) in enumerate(run_ranks(_stage_checks, 2)):
        assert f"stage {1 - rank} belongs to pp rank {1 - rank}, but this is pp rank {rank}" \
            in errors[0]
        assert f"pp rank {rank} must hold stages [{rank}, {rank + 2}] of 4" in errors[1]
        # Each parameter's hook fires once per micro-batch; only the last one is flagged.
        assert results == {"1f1b": [(False, False, True)], "zb_h1": [(False, False, True)],
                           "gpipe": [(False, True)]}
