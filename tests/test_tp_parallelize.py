"""parallelize(): real models (transformers GPT-2, Llama, Qwen2; overlap's GPT) give the same
logits, gathered gradients and 5-step training losses as the unsharded model, and the same
outputs as PyTorch's own DTensor tensor parallelism on the same model.

One rank job per world size (1: overlap GPT only; 2, 4: all) runs every model (importing
transformers in each rank is the expensive part); each check is then its own pytest item. Tolerances (max-relative, fp32):
logits 1e-5, gradients 1e-4 (relative to the parameter's largest entry, or to 1% of the largest
gradient entry of the model where a gradient is zero in exact arithmetic, e.g. key biases),
losses of 5 AdamW steps within 1e-5 absolute.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from overlap.tp.comm import default_comm

pytestmark = [
    pytest.mark.no_delay_pass("models; the op and layer files run delayed"),
    pytest.mark.no_numerics_pass("models of the layers test_tp_ops_numerics checks"),
]

VOCAB = 61  # not divisible by 2 or 4: uneven vocabulary shards
TOL = {"logits": 1e-5, "grads": 1e-4, "state": 0.0, "losses": 1e-5, "dtensor": 1e-5}


def _rel(got, want, floor=1e-12):
    want = want.double()
    return ((got.double() - want).abs().max() / max(want.abs().max().item(), floor)).item()


def _hf_model(arch, **overrides):
    import transformers as T

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=4,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=0, **overrides)
        return T.GPT2LMHeadModel(cfg)
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)
    kw.update(overrides)
    if arch == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**kw))
    return T.Qwen2ForCausalLM(T.Qwen2Config(**kw))


def _gpt_model(n_head=4, d_model=16):
    from overlap.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, d_model=d_model, n_layer=2,
                         n_head=n_head))


def _batch(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2, 4 * world), generator=g)


def _loss_fn(kind):
    """(model, ids) -> (logits, loss) for a model family."""
    if kind == "hf":
        def run(model, ids):
            out = model(input_ids=ids, labels=ids, use_cache=False)
            return out.logits, out.loss
        return run
    if kind == "gpt-vocab-parallel":
        from overlap.nn.embedding import vocab_parallel_cross_entropy

        def run(model, ids):
            logits = model(ids)  # sharded over the vocabulary when parallelized
            if not hasattr(model.lm_head, "tp_group"):
                return logits, torch.nn.functional.cross_entropy(
                    logits.reshape(-1, VOCAB), ids.reshape(-1))
            loss = vocab_parallel_cross_entropy(logits, ids, group=model.lm_head.tp_group)
            return logits, loss
        return run
    return lambda model, ids: model(ids, ids)


def _compare(ref, model, run, world, out, prefix):
    from overlap.nn.parallelize import gather_grads, gather_state_dict

    ids = _batch(0, world)
    logits_ref, loss_ref = run(ref, ids)
    logits, loss = run(model, ids)
    if logits.shape != logits_ref.shape:  # vocab-parallel logits: compare this rank's columns
        lm = model.lm_head
        lo = sum(lm.local_sizes[:lm.tp_rank])
        logits_ref = logits_ref[..., lo:lo + logits.shape[-1]]
    out[f"{prefix}-logits"] = max(_rel(logits, logits_ref), _rel(loss, loss_ref))
    loss_ref.backward()
    loss.backward()
    grads = gather_grads(model)
    # Some gradients are zero in exact arithmetic (a key bias cannot change a softmax), so
    # each parameter's error is relative to at least 1% of the largest gradient entry.
    floor = 1e-2 * max(p.grad.abs().max().item() for p in ref.parameters())
    out[f"{prefix}-grads"] = max(_rel(grads[n], p.grad, floor) for n, p in ref.named_parameters())
    full = gather_state_dict(model)
    want = ref.state_dict()
    same_keys = full.keys() == want.keys()
    out[f"{prefix}-state"] = 0.0 if same_keys and all(
        torch.equal(full[k], want[k]) for k in want) else float("inf")
    losses = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        steps = []
        for step in range(5):
            _, loss = run(m, _batch(step + 1, world))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append(loss.item())
        losses.append(steps)
    out[f"{prefix}-losses"] = max(abs(a - b) for a, b in zip(*losses))


def _dtensor_compare(ref, run, world, out, prefix, names, heads_attr, backend="auto"):
    """The same (fresh) model under ours and under torch DTensor TP (ColwiseParallel /
    RowwiseParallel on the same linears, embedding and head replicated): same outputs."""
    from overlap.nn.parallelize import parallelize

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    dt = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for name, module in dt.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in names["column"]:
            plan[name] = ColwiseParallel()
        elif leaf in names["row"]:
            plan[name] = RowwiseParallel()
        elif heads_attr and hasattr(module, heads_attr):
            setattr(module, heads_attr, getattr(module, heads_attr) // world)
    parallelize_module(dt, mesh, plan)
    model_ours = parallelize(copy.deepcopy(ref),
                             comm=default_comm(dist.group.WORLD, backend=backend))
    ids = _batch(7, world)
    with torch.no_grad():
        want = run(dt, ids)[0]
        got = run(model_ours, ids)[0]
        unsharded = run(ref, ids)[0]
    out[f"{prefix}-dtensor"] = max(_rel(got, want), _rel(unsharded, want))


def _gpt_cases(world, out):
    from overlap.nn.parallelize import parallelize
    from overlap.models.tp_plans import gpt_plan

    group = dist.group.WORLD
    for sp, backend, loss_parallel in ((False, "chunked", False), (True, "chunked", False),
                                       (True, "symmetric", False), (False, "symmetric", True),
                                       (True, "chunked", True)):
        kind = "gpt-vocab-parallel" if loss_parallel else "gpt"
        ref = _gpt_model()
        model = parallelize(copy.deepcopy(ref), comm=default_comm(group, backend=backend),
                            sequence_parallel=sp, plan=gpt_plan(loss_parallel=loss_parallel))
        name = f"{kind}-{'sp' if sp else 'nosp'}-{backend}"
        _compare(ref, model, _loss_fn(kind), world, out, name)
        if not sp and not loss_parallel:
            _dtensor_compare(_gpt_model(), _loss_fn("gpt"), world, out, name,
                             {"column": ("q_proj", "k_proj", "v_proj", "fc1"),
                              "row": ("o_proj", "fc2")}, "num_heads", backend=backend)


def _hf_cases(world, out):
    from overlap.nn.parallelize import parallelize

    group = dist.group.WORLD
    run = _loss_fn("hf")
    for arch in ("gpt2", "llama", "qwen2"):
        ref = _hf_model(arch)
        model = parallelize(copy.deepcopy(ref), comm=default_comm(group))
        _compare(ref, model, run, world, out, f"hf-{arch}")
        if arch == "llama":
            _dtensor_compare(_hf_model(arch), run, world, out, "hf-llama",
                             {"column": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
                              "row": ("o_proj", "down_proj")}, None)
    # Sequence parallelism is refused for HF models, with the reason.
    try:
        parallelize(_hf_model("llama"), comm=default_comm(group), sequence_parallel=True)
        out["hf-sp-refused"] = None
    except NotImplementedError as exc:
        out["hf-sp-refused"] = str(exc)
    if world == 4:  # GQA: 2 kv heads cannot be split over 4 ranks
        model = _hf_model("llama", num_key_value_heads=2)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            parallelize(model, comm=default_comm(group))
            out["hf-gqa-error"] = None
        except ValueError as exc:
            unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            out["hf-gqa-error"] = (str(exc), unchanged)


def _run_all(world):
    from overlap.tp import close_default_comms

    out = {}
    try:
        _gpt_cases(world, out)
        if world > 1:  # importing transformers costs ~5 s of CPU per rank
            _hf_cases(world, out)
    finally:
        close_default_comms()  # the symmetric backend's cached workspaces
    return out


_results: dict[int, list[dict]] = {}


def _results_for(world):
    if world not in _results:
        _results[world] = run_ranks(_run_all, world, world, timeout=300)
    return _results[world]


GPT_NAMES = ["gpt-nosp-chunked", "gpt-sp-chunked", "gpt-sp-symmetric",
             "gpt-vocab-parallel-nosp-symmetric", "gpt-vocab-parallel-sp-chunked",
             "hf-gpt2", "hf-llama", "hf-qwen2"]
CHECKS = [(w, f"{n}-{c}") for w in (1, 2, 4) for n in GPT_NAMES
          for c in ("logits", "grads", "state", "losses") if w > 1 or not n.startswith("hf")]
CHECKS += [(w, f"{n}-dtensor") for w in (1, 2, 4) for n in ("gpt-nosp-chunked", "hf-llama")
           if w > 1 or not n.startswith("hf")]


@pytest.mark.parametrize("world,check", CHECKS, ids=[f"w{w}-{c}" for w, c in CHECKS])
def test_parallel_model_matches_unsharded(world, check):
    tol = TOL[check.rsplit("-", 1)[1]]
    for rank, res in enumerate(_results_for(world)):
        assert res[check] <= tol, f"rank {rank}: {check} = {res[check]} > {tol}"


@pytest.mark.parametrize("world", [2, 4])
def test_hf_errors(world):
    for res in _results_for(world):
        assert "does not support sequence_parallel=True" in (res["hf-sp-refused"] or "")
        if world == 4:
            msg, unchanged = res["hf-gqa-error"]
            assert "num_key_value_heads=2 is not divisible by tp=4" in msg
            assert unchanged


def _plan_errors():
    import torch.nn as nn

    from overlap.nn.layers import TPModule
    from overlap.nn.parallelize import TPPlan, parallelize
    from overlap.models.tp_plans import gpt_plan, plan_for

    group, out = dist.group.WORLD, {}
    # 6 heads over 4 ranks, a LayerNorm asked to be a column, a pattern that matches nothing.
    model = _gpt_model(n_head=6, d_model=24)
    plan = gpt_plan()
    plan.layers = {"blocks.0.ln2": "column", "no_such.*": "row", **plan.layers}
    model.blocks[1].attn.__class__ = type("MyAttention", (type(model.blocks[1].attn),), {})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        parallelize(model, comm=default_comm(group), plan=plan)
    except ValueError as exc:
        out["msg"] = str(exc)
    out["unchanged"] = (not any(isinstance(m, TPModule) for m in model.modules())
                        and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
                        and model.blocks[0].attn.num_heads == 6)
    try:
        plan_for(nn.Sequential(nn.Linear(2, 2)))
    except ValueError as exc:
        out["unknown"] = str(exc)
    try:
        parallelize(_gpt_model(), comm=default_comm(group),
                    plan=TPPlan(name="toy", layers={"lm_head": "diagonal"}))
    except ValueError as exc:
        out["style"] = str(exc)
    return out


def test_bad_plan_lists_every_problem_and_changes_nothing():
    for rank, res in enumerate(run_ranks(_plan_errors, 4)):
        msg = res.get("msg", "")
        assert f"on rank {rank}" in msg and "nothing was changed" in msg
        for part in ("blocks.0.ln2: style 'column' needs nn.Linear or Conv1D, got LayerNorm",
                     "pattern 'no_such.*' (row) matched no module",
                     "blocks.0.attn.num_heads=6 is not divisible by tp=4",
                     "blocks.1.attn.num_heads=6 is not divisible by tp=4",
                     "blocks.1.attn: custom style accepts ['CausalSelfAttention'], got "
                     "MyAttention"):
            assert part in msg, f"rank {rank}: {part!r} missing from:\n{msg}"
        assert res["unchanged"], f"rank {rank}: the model was modified by a failing parallelize"
        assert "no shipped plan for Sequential" in res["unknown"]
        assert "unknown style 'diagonal'" in res["style"]


def _probe_rejected():
    from overlap.models import GPT
    from overlap.nn.parallelize import parallelize

    class MaskedGPT(GPT):  # a forward the default probe (ids only) cannot call
        def forward(self, ids, scale):
            return super().forward(ids) * scale

    group, out = dist.group.WORLD, {}
    ref = _gpt_model()
    model = MaskedGPT(ref.config)
    model.load_state_dict(ref.state_dict())
    try:
        parallelize(copy.deepcopy(model), comm=default_comm(group), sequence_parallel=True)
    except ValueError as exc:
        out["sp"] = str(exc)
    # with probe= the same model parallelizes and gives the unsharded logits
    ids = _batch(0, dist.get_world_size())
    tp_model = parallelize(copy.deepcopy(model), comm=default_comm(group),
                           sequence_parallel=True, probe=lambda m: m(ids, 2.0))
    out["logits"] = _rel(tp_model(ids, 2.0), model(ids, 2.0).detach())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_needs_a_probe_the_model_accepts(world):
    """Which replicated modules run on sequence-sharded activations (and need their gradients
    summed over TP) is found by running the model; a forward that rejects the default probe
    is an error naming probe=, not a silently skipped check."""
    for rank, res in enumerate(run_ranks(_probe_rejected, world, timeout=120)):
        msg = res.get("sp") or ""
        assert "the verification probe failed on the unsharded model (pass probe=" in msg, msg
        assert "sequence parallelism" in msg and "TypeError" in msg, msg
        assert res["logits"] <= TOL["logits"], (rank, res["logits"])
