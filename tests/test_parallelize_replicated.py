"""Replicated parameters inside a sharded TP region (issue 23, item 1).

Qwen3 normalises each attention head with a per-head RMSNorm (``q_norm``, ``k_norm``, weight
of size head_dim, replicated on every TP rank). Under a Llama-style plan each rank only sees its
own heads, so the weight's gradient on one rank is a partial sum: the forward is right and the
gradient is wrong unless it is summed over TP. parallelize must either sum it or refuse, and its
verification must compare every parameter's gradient, not only outputs and input gradients.

Everything runs in float64. Why the tolerances hold on any CPU: both models sum the same terms
in different orders (the TP split, the vector width); in float64 each sum of n terms is off by at
most n * 2^-53 * sum|terms|. The largest sums here are over the 16 tokens times the hidden width
(<= 48) for a weight gradient, through two layers whose entries are O(1), so the differences stay
below 1e-12 relative to the largest gradient; the partial gradient this file exists for is off
by about 1 - 1/tp, i.e. >= 0.5. GRAD_TOL = 1e-9 leaves a factor 1000 for the chain of layers.
AdamW runs with eps = 1e-3, so its update is Lipschitz in the gradient (|change| <= lr * 2|d| /
eps per step, d the gradient difference): 3 steps at lr 1e-2 move the weights apart by at most
3 * 1e-2 * 2 * 1e-12 / 1e-3 = 6e-11, under WEIGHT_TOL = 1e-9. The Qwen3 RMSNorm casts its input
to float32 internally: inputs that differ by ~1e-16 round to the same float32 unless one sits
within 1e-16 of a rounding boundary (probability ~1e-16 / 2^-24 ~ 2e-9 per element, a few
thousand elements per run), so the float32 steps match too.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_ranks

VOCAB = 61
GRAD_TOL = 1e-9
WEIGHT_TOL = 1e-9
LOSS_TOL = 1e-9


def qwen3(**overrides):
    import transformers as T

    torch.manual_seed(0)
    cfg = T.Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=4,
                        intermediate_size=48, max_position_embeddings=32, bos_token_id=0,
                        eos_token_id=0, pad_token_id=0, **overrides)
    model = T.Qwen3ForCausalLM(cfg).double()
    # the norms start at 1 (their gradient would then be the same on every layer); make them
    # distinct so a wrong gradient cannot hide behind a symmetric one
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return model


def _batch(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2, 4 * max(world, 2)), generator=g)


def _rel(got, want, scale):
    return ((got.double() - want.double()).abs().max() / scale).item()


def _qwen3_job(world, backend, plan_kind):
    from overlap.models.tp_plans import llama_plan
    from overlap.nn import gather_grads, gather_state_dict, parallelize
    from overlap.tp import TPComm

    out = {}
    ref = qwen3()
    comm = TPComm(dist.group.WORLD, backend=backend)
    try:
        plan = llama_plan(ref)
        if plan_kind == "found":  # the norms not named: parallelize finds them on the probe
            plan.layers = {k: v for k, v in plan.layers.items() if v != "sum_grads"}
            assert not any(k.endswith("_norm") for k in plan.layers)
        model = parallelize(copy.deepcopy(ref), comm=comm, plan=plan,
                            verify=plan_kind != "named-unverified")
        ids = _batch(0, world)
        loss_ref = ref(input_ids=ids, labels=ids, use_cache=False).loss
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss_ref.backward()
        loss.backward()
        grads = gather_grads(model)
        scale = max(p.grad.abs().max().item() for p in ref.parameters())
        errs = {n: _rel(grads[n], p.grad, scale) for n, p in ref.named_parameters()}
        out["grad_err"] = max(errs.values())
        out["grad_worst"] = max(errs, key=errs.get)
        out["norm_err"] = max(v for n, v in errs.items() if "_norm." in n)
        out["loss_err"] = abs(loss.item() - loss_ref.item())
        losses = []
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-3)
            steps = []
            for step in range(3):
                ids = _batch(step + 1, world)
                loss = m(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps.append(loss.item())
            losses.append(steps)
        out["steps_err"] = max(abs(a - b) for a, b in zip(*losses))
        trained, want = gather_state_dict(model), ref.state_dict()
        out["weight_err"] = max((trained[k] - want[k]).abs().max().item() for k in want
                                if want[k].is_floating_point())
    finally:
        comm.close()
    return out


QWEN3_CASES = [(1, "chunked", "named"), (2, "chunked", "named"), (2, "symmetric", "found"),
               (2, "unfused", "named-unverified"), (4, "symmetric", "named"),
               (4, "unfused", "found")]


@pytest.mark.parametrize("world,backend,plan_kind", QWEN3_CASES)
def test_qwen3_per_head_norms_get_full_gradients(world, backend, plan_kind):
    """Every parameter's gradient equals the unsharded model's, q_norm/k_norm included, and 3
    AdamW steps end at the same weights: with the shipped llama_plan (which names the norms
    'sum_grads'; also with verify=False), and with a plan that leaves them out (found on the
    probe)."""
    for rank, res in enumerate(run_ranks(_qwen3_job, world, world, backend, plan_kind,
                                         timeout=240)):
        assert res["norm_err"] <= GRAD_TOL, (rank, res)
        assert res["grad_err"] <= GRAD_TOL, (rank, res)
        assert res["loss_err"] <= LOSS_TOL and res["steps_err"] <= LOSS_TOL, (rank, res)
        assert res["weight_err"] <= WEIGHT_TOL, (rank, res)


# ------------------------------------------------------------ verification sees grads


class _HeadScaled(nn.Module):
    """up (column) -> a per-head scale -> down (row). ``scale`` is a parameter of the module
    itself (not of a submodule), used on this rank's heads only: its gradient is partial on
    every rank, and nothing in the output or the input gradient shows it."""

    def __init__(self, d=16, heads=8, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        self.up = nn.Linear(d, heads * head_dim)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, head_dim))
        self.down = nn.Linear(heads * head_dim, d)

    def forward(self, x):
        h = self.up(x)
        h = (h.unflatten(-1, (-1, self.head_dim)) * self.scale).flatten(-2)
        return self.down(torch.tanh(h))


class _PerHeadNorm(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, head_dim))

    def forward(self, h):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _HeadNormed(nn.Module):
    """The same with the per-head weight in a submodule (a norm, as Qwen3 has it)."""

    def __init__(self, d=16, heads=8, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        self.up = nn.Linear(d, heads * head_dim)
        self.norm = _PerHeadNorm(head_dim)
        self.down = nn.Linear(heads * head_dim, d)

    def forward(self, x):
        h = self.up(x).unflatten(-1, (-1, self.head_dim))
        return self.down(self.norm(h).flatten(-2))


def _model(kind):
    torch.manual_seed(3)
    block = _HeadScaled() if kind == "scaled" else _HeadNormed()
    return nn.Sequential(nn.Linear(16, 16), block).double()


def _verify_job(kind):
    from overlap.nn import TPPlan, gather_grads, parallelize
    from overlap.tp import TPComm

    plan = TPPlan(name="head-block", layers={"1.up": "column", "1.down": "row"})
    comm = TPComm(dist.group.WORLD, backend="chunked")
    out = {}
    try:
        ref = _model(kind)
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).double()
        model = copy.deepcopy(ref)
        try:
            parallelize(model, comm=comm, plan=plan)
        except ValueError as exc:
            out["error"] = str(exc)
            out["restored"] = type(model[1].up) is nn.Linear and type(model[1]) is type(ref[1])
            return out
        ref(x).square().sum().backward()
        model(x).square().sum().backward()
        grads = gather_grads(model)
        scale = max(p.grad.abs().max().item() for p in ref.parameters())
        out["grad_err"] = max(_rel(grads[n], p.grad, scale) for n, p in ref.named_parameters())
    finally:
        comm.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_verification_refuses_a_partial_gradient_by_name(world):
    """A parameter of the region's own module used on sharded heads: refused, named."""
    for res in run_ranks(_verify_job, world, "scaled", timeout=120):
        assert "error" in res, f"parallelize accepted a plan with a partial gradient: {res}"
        msg = res["error"]
        assert "1.scale" in msg and "gradient" in msg, msg
        assert res["restored"]


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_submodule_in_sharded_region_is_summed(world):
    """The per-head weight in a submodule acting on sharded heads: its gradient is summed
    over TP, so the parallel gradients equal the unsharded ones."""
    for res in run_ranks(_verify_job, world, "normed", timeout=120):
        assert "error" not in res, res["error"]
        assert res["grad_err"] <= GRAD_TOL, res


def _direct_job(world, mark):
    """The layers used directly, without parallelize: a column -> per-head norm -> row block
    built from overlap.nn layers; ``sum_grads_over_tp`` on the norm gives its full gradient."""
    from overlap.nn import ColumnParallelLinear, RowParallelLinear, gather_grads, \
        sum_grads_over_tp
    from overlap.tp import TPComm

    comm = TPComm(dist.group.WORLD, backend="unfused")
    try:
        ref = _HeadNormed().double()
        model = copy.deepcopy(ref)
        model.up = ColumnParallelLinear.from_linear(ref.up, comm=comm)
        model.down = RowParallelLinear.from_linear(ref.down, comm=comm)
        if mark:
            sum_grads_over_tp(model.norm, comm=comm)
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).double()
        ref(x).square().sum().backward()
        model(x).square().sum().backward()
        grads = gather_grads(model)
        scale = max(p.grad.abs().max().item() for p in ref.parameters())
        return _rel(grads["norm.weight"], ref.norm.weight.grad, scale)
    finally:
        comm.close()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layers_used_directly(world):
    errs = run_ranks(_direct_job, world, world, True, timeout=120)
    assert max(errs) <= GRAD_TOL, errs
    if world > 1:  # without it the gradient is partial (what the helper exists for)
        errs = run_ranks(_direct_job, world, world, False, timeout=120)
        assert min(errs) > 0.1, errs
