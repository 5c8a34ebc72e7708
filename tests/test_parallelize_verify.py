"""parallelize() verifies itself: the four silent wrong answers of issue 14 are each caught
with a message naming the module, the style, the error and the likely cause, and the model is
restored unsharded; without verification the same plans give wrong numbers (so it is the check
that catches them). Also: weights that differ across TP ranks, subclass safety (Gemma works
with a Llama-style plan because its scaled embedding is wrapped; "refuse" refuses it), and the
whole-model check (verify="model") with a caller's probe on a model that takes no token ids.
Issue 49: a probe the model rejects (or none at all) is an error, not a skipped check; a failure
inside (OLMo2's q_norm and Bloom's ALiBi on sharded heads, a toy, a build that raises, on one
rank or all) restores the model exactly and raises one ValueError on every rank.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_ranks
from test_parallelize_plans import hf_model
from overlap.tp.comm import default_comm


def _ids(world):
    return torch.randint(0, 61, (2, 4 * world), generator=torch.Generator().manual_seed(5))


def _logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _swap(plan, suffix, style):
    plan.layers = {k: (style if k.endswith(suffix) else v) for k, v in plan.layers.items()}
    return plan


def _no_divide(plan):
    plan.divide = {}
    return plan


# name: (arch, plan edit, parallelize kwargs, text the message must hold)
CASES = {
    "gemma-embedding": ("gemma", lambda p: p, {"subclasses": "replace"},
                        ["model.embed_tokens (GemmaTextScaledWordEmbedding, style 'embedding')",
                         "likely cause: module has its own forward"]),
    "neox-interleaved-qkv": ("gpt_neox", lambda p: _swap(p, "query_key_value", "qkv"), {},
                             ["gpt_neox.layers.0.attention (containing query_key_value: "
                              "column(parts=3)", "likely cause: fused layout",
                              "layout='per_head'"]),
    "fused-gate-up-as-column": ("phi3", lambda p: _swap(p, "gate_up_proj", "column"), {},
                                ["model.layers.0.mlp (containing gate_up_proj: column",
                                 "likely cause: fused layout", "use parts=2"]),
    "missing-head-divide": ("opt", _no_divide, {},
                            ["model.decoder.layers.0.self_attn (containing q_proj: column",
                             "likely cause: head count attribute not divided",
                             "model.decoder.layers.0.self_attn.num_heads="]),
}


class _Up(nn.Module):
    """A model with no token ids: a fused [gate; up] projection feeding down (root-level)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


class _Scaled(nn.Linear):
    """A Linear subclass whose forward adds behaviour on top of super().forward: wrapped."""

    def forward(self, x):
        return super().forward(x) * 2.0 + 1.0


class _OwnMatmul(nn.Linear):
    """A Linear subclass whose forward reads the weight itself: cannot be wrapped."""

    def forward(self, x):
        return x @ self.weight.t() * 2.0


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Up()

    def forward(self, x, scale):
        return self.inner(x) * scale


def _verify_job(world):
    from overlap.models.tp_plans import llama_plan, plan_for
    from overlap.nn import TPPlan, parallelize
    from overlap.nn.layers import TPModule
    from overlap.tp import close_default_comms

    group, out = dist.group.WORLD, {}
    ids = _ids(world)
    try:
        for name, (arch, edit, kwargs, _) in CASES.items():
            ref = hf_model(arch)
            model = copy.deepcopy(ref)
            try:
                parallelize(model, comm=default_comm(group, backend="chunked"),
                            plan=edit(plan_for(model)), **kwargs)
                out[name] = None
            except ValueError as exc:
                restored = (not any(isinstance(m, TPModule) for m in model.modules())
                            and _rel(_logits(model, ids), _logits(ref, ids)) == 0.0)
                out[name] = (str(exc), restored)
            # The same plan without verification: a model that runs and is wrong.
            model = parallelize(copy.deepcopy(ref), comm=default_comm(group, backend="chunked"),
                                plan=edit(plan_for(ref)), verify=False, **kwargs)
            with torch.no_grad():
                out[f"{name}-unverified"] = _rel(_logits(model, ids), _logits(ref, ids))

        # Gemma with the Llama plan a user would write: its embedding scale is kept.
        ref = hf_model("gemma")
        model = parallelize(copy.deepcopy(ref), comm=default_comm(group), plan=llama_plan(ref),
                            verify="model")
        with torch.no_grad():
            out["gemma-llama-plan"] = _rel(_logits(model, ids), _logits(ref, ids))
        out["gemma-wrapped-type"] = type(model.model.embed_tokens).__name__
        try:
            parallelize(hf_model("gemma"), comm=default_comm(group), subclasses="refuse")
            out["refuse"] = None
        except ValueError as exc:
            out["refuse"] = str(exc)

        # Different weights on one rank (a different seed).
        torch.manual_seed(dist.get_rank())
        try:
            parallelize(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), comm=default_comm(group),
                        plan=TPPlan(name="two", layers={"0": "column", "1": "row"}))
            out["seed"] = None
        except ValueError as exc:
            out["seed"] = str(exc)

        # Linear subclasses: kept by wrapping, or caught when their forward bypasses super().
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
        for key, cls in (("scaled", _Scaled), ("own-matmul", _OwnMatmul)):
            torch.manual_seed(0)
            ref = nn.Sequential(cls(8, 16), nn.Tanh(), cls(16, 8))
            try:
                model = parallelize(copy.deepcopy(ref), comm=default_comm(group),
                                    plan=TPPlan(name=key, layers={"0": "column", "2": "row"}))
                out[key] = _rel(model(x), ref(x))
            except ValueError as exc:
                out[key] = str(exc)

        # verify="model" with a probe, on a model that takes no token ids.
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(0)
        ref = _Up()
        good = parallelize(copy.deepcopy(ref), comm=default_comm(group), verify="model", probe=x,
                           plan=TPPlan(name="up", layers={"up": "gate_up", "down": "row"}))
        out["probe-good"] = _rel(good(x), ref(x))
        for key, kwargs in (("probe-bad", {"verify": "model", "probe": (x,)}),
                            ("probe-bad-default", {})):
            try:
                parallelize(copy.deepcopy(ref), comm=default_comm(group),
                            plan=TPPlan(name="up", layers={"up": "column", "down": "row"}),
                            **kwargs)
                out[key] = None
            except ValueError as exc:
                out[key] = str(exc)
        try:  # a forward that takes two inputs: the default probe cannot call it
            two = _Two()
            parallelize(two, comm=default_comm(group), verify="model",
                        plan=TPPlan(name="up", layers={"inner.up": "gate_up",
                                                       "inner.down": "row"}))
            out["probe-missing"] = None
        except ValueError as exc:
            out["probe-missing"] = str(exc)
    finally:
        close_default_comms()
    return out


_results: dict[int, list[dict]] = {}


def _results_for(world):
    if world not in _results:
        _results[world] = run_ranks(_verify_job, world, world, timeout=300)
    return _results[world]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_silent_error_is_caught_with_its_cause(world, case):
    needles = CASES[case][3]
    for rank, res in enumerate(_results_for(world)):
        assert res[case] is not None, f"rank {rank}: {case} was accepted"
        msg, restored = res[case]
        assert f"tp={world}) on rank {rank}: verification failed" in msg, msg
        for needle in needles:
            assert needle in msg, f"rank {rank}: {needle!r} missing from:\n{msg}"
        assert restored, f"rank {rank}: {case}: the model was not restored unsharded"
        # Without verification the same plan runs and is wrong: logits off by 7% to 61%
        # (measured; max-relative, tp 2 and 4).
        assert res[f"{case}-unverified"] > 0.05, res[f"{case}-unverified"]


@pytest.mark.parametrize("world", [2, 4])
def test_subclass_safety_and_same_weights(world):
    for rank, res in enumerate(_results_for(world)):
        assert res["gemma-llama-plan"] <= 1e-5
        assert res["gemma-wrapped-type"] == "ParallelGemmaTextScaledWordEmbedding"
        assert ("model.embed_tokens: GemmaTextScaledWordEmbedding overrides ['forward'] of "
                "Embedding" in res["refuse"])
        seed = res["seed"] or ""
        assert f"parallelize on rank {rank}: the unsharded model is not the same" in seed
        assert "0.weight differs between ranks [0] vs [1]" in seed, seed
        assert res["scaled"] <= 1e-5, res["scaled"]
        msg = res["own-matmul"]
        assert isinstance(msg, str) and "0 (_OwnMatmul, style 'column')" in msg, msg
        assert "module has its own forward: 0 is a _OwnMatmul" in msg, msg


@pytest.mark.parametrize("world", [2, 4])
def test_whole_model_check_with_probe(world):
    for rank, res in enumerate(_results_for(world)):
        assert res["probe-good"] <= 1e-5
        for key in ("probe-bad", "probe-bad-default"):
            msg = res[key] or ""
            assert "<model> (containing up: column, down: row)" in msg, msg
            assert "fused layout: up has 64 outputs but down takes 32" in msg, msg
        assert "the verification probe failed on the unsharded model (pass probe=" in (
            res["probe-missing"] or "")


# ---------------------------------------------------------------- failures restore the model
# Issue 49: a probe the model rejects is an error (it was skipped), and whatever raises inside
# parallelize (the model's own forward on the sharded shapes included) leaves the model exactly
# as it was and raises one ValueError naming the module and the cause, on every rank.

class _StrictBlock(nn.Module):
    """Runs only on the unsharded width: its forward checks the feature count itself."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        if h.shape[-1] != 32:
            raise RuntimeError(f"_StrictBlock needs 32 features, got {h.shape[-1]}")
        return self.down(torch.tanh(h))


class _Strict(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _StrictBlock()
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.block(x))


class _TwoInputs(nn.Module):
    """Token ids and a scale: the default probe (ids alone) cannot call it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(61, 16)
        self.block = _StrictBlock()

    def forward(self, ids, scale):
        return self.block(self.embed(ids)) * scale


def _tiny_olmo2():
    import transformers as T

    torch.manual_seed(0)
    return T.Olmo2ForCausalLM(T.Olmo2Config(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=0, eos_token_id=0))


def _tiny_bloom():
    import transformers as T

    torch.manual_seed(0)
    return T.BloomForCausalLM(T.BloomConfig(vocab_size=61, hidden_size=32, n_layer=2, n_head=4,
                                            hidden_dropout=0.0, attention_dropout=0.0))


def _snapshot(model):
    """Everything a failed parallelize must leave as it was."""
    return {"modules": [(n, type(m), id(m)) for n, m in model.named_modules()],
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "requires_grad": [(n, p.requires_grad, id(p)) for n, p in model.named_parameters()],
            "hooks": [(n, list(m._forward_hooks), list(m._forward_pre_hooks),
                       list(m._backward_hooks)) for n, m in model.named_modules()],
            "training": [m.training for m in model.modules()]}


def _restored(before, model) -> list[str]:
    """What differs from the snapshot (empty: restored exactly)."""
    after, bad = _snapshot(model), []
    for key in ("modules", "requires_grad", "hooks", "training"):
        if after[key] != before[key]:
            bad.append(key)
    if list(after["state"]) != list(before["state"]) or not all(
            torch.equal(after["state"][k], v) for k, v in before["state"].items()):
        bad.append("state_dict")
    return bad


def _failure_job(world):
    from overlap.models.tp_plans import llama_plan
    from overlap.nn import Style, TPPlan, parallelize
    from overlap.tp import close_default_comms

    group, out = dist.group.WORLD, {}
    ids = _ids(world)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))

    def comm():
        return default_comm(group, backend="chunked")

    def logits(m):
        return m(input_ids=ids, use_cache=False).logits

    def refused(key, model, run_ref, **kwargs):
        ref = copy.deepcopy(model)
        before = _snapshot(model)
        try:
            parallelize(model, comm=comm(), **kwargs)
            out[key] = None
            return
        except Exception as exc:
            err = exc
        try:  # a model left half-replaced may not run at all
            with torch.no_grad():
                same = torch.equal(run_ref(model), run_ref(ref))
        except Exception:
            same = False
        out[key] = (type(err).__name__, str(err), type(err.__cause__).__name__
                    if err.__cause__ is not None else None, _restored(before, model), same)

    try:
        # A forward that rejects the default probe: an error now, not a skipped check.
        torch.manual_seed(0)
        refused("probe-rejected", _TwoInputs(), lambda m: m(ids, 2.0),
                plan=TPPlan(name="two", layers={"block.up": "column", "block.down": "row"}))
        # No default probe (no ids, no nn.Linear first) under sequence parallelism: the norm
        # after the row layer runs on sequence shards and needs its gradients summed over TP,
        # which only the probe finds. An error now (it was accepted unchecked).
        from transformers.pytorch_utils import Conv1D

        torch.manual_seed(0)
        refused("no-default-probe", nn.Sequential(Conv1D(32, 16), nn.Tanh(), Conv1D(16, 32),
                                                  nn.LayerNorm(16)),
                lambda m: m(x), sequence_parallel=True, plan=TPPlan(
                    name="conv", layers={"0": "column", "2": "row"}, sequence_parallel=True))
        if world == 1:
            return out
        # OLMo2 with a user's Llama-style plan: q_norm spans every head's features.
        olmo = _tiny_olmo2()
        user = TPPlan(name="user-olmo2", layers=dict(llama_plan(olmo).layers),
                      check=llama_plan(olmo).check)
        refused("olmo2", olmo, logits, plan=user)
        # Bloom: ALiBi is built for every head, the attention runs on this rank's.
        bloom = _tiny_bloom()
        p = "transformer.h.*."
        plan = TPPlan(name="user-bloom", layers={
            f"{p}self_attention.query_key_value": Style(kind="column", layout="per_head",
                                                        heads=4),
            f"{p}self_attention.dense": "row", f"{p}mlp.dense_h_to_4h": "column",
            f"{p}mlp.dense_4h_to_h": "row"}, divide={f"{p}self_attention": ("num_heads",)})
        refused("bloom", bloom, logits, plan=plan)
        # A toy whose own forward raises on sharded shapes; a user hook, a frozen parameter.
        torch.manual_seed(0)
        strict = _Strict()
        strict.block.register_forward_hook(lambda m, a, o: None)
        strict.head.bias.requires_grad_(False)
        refused("toy", strict, lambda m: m(x),
                plan=TPPlan(name="strict", layers={"block.up": "column", "block.down": "row"}))
        # A failure while replacing (a custom build that raises), after others were replaced.
        torch.manual_seed(0)

        def build(module, **_):
            raise RuntimeError("no parallel twin for this head")

        refused("replace", _Strict(), lambda m: m(x), verify=False, plan=TPPlan(
            name="custom", layers={"block.up": "column", "block.down": "row",
                                   "head": Style(kind="custom", build=build,
                                                 accepts=(nn.Linear,))}))
        # The same on the last rank only: every rank restores and raises, none waits.
        torch.manual_seed(0)

        def build_here(module, comm, **_):
            if dist.get_rank() == world - 1:
                raise RuntimeError("no parallel twin for this head")
            return module

        refused("replace-one-rank", nn.Sequential(nn.Linear(16, 32), nn.Tanh(),
                                                  nn.Linear(32, 16), nn.Linear(16, 16)),
                lambda m: m(x), plan=TPPlan(name="custom", layers={
                    "0": "column", "2": "row",
                    "3": Style(kind="custom", build=build_here, accepts=(nn.Linear,))}))
    finally:
        close_default_comms()
    return out


_failures: dict[int, list[dict]] = {}


def _failures_for(world):
    if world not in _failures:
        _failures[world] = run_ranks(_failure_job, world, world, timeout=300)
    return _failures[world]


def _check_refused(res, key, rank, needles, cause):
    assert res[key] is not None, f"rank {rank}: {key} was accepted"
    kind, msg, got_cause, not_restored, same = res[key]
    assert kind == "ValueError", (kind, msg)
    assert f"on rank {rank}:" in msg, msg
    for needle in needles:
        assert needle in msg, f"rank {rank}: {needle!r} missing from:\n{msg}"
    assert got_cause == cause, (got_cause, msg)
    assert not_restored == [], f"rank {rank}: {key}: not restored: {not_restored}"
    assert same, f"rank {rank}: {key}: the restored model computes something else"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_probe_the_model_rejects_is_an_error(world):
    for rank, res in enumerate(_failures_for(world)):
        _check_refused(res, "probe-rejected", rank, [
            "the verification probe failed on the unsharded model (pass probe=",
            "raised TypeError", "missing 1 required positional argument: 'scale'",
            "summed over TP"], "TypeError")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_no_default_probe_is_an_error(world):
    for rank, res in enumerate(_failures_for(world)):
        _check_refused(res, "no-default-probe", rank, [
            "verification needs probe= (the model's input", "Sequential takes neither token ids",
            "gradients must be summed over TP"], None)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case,needles", [
    ("olmo2", ["the parallel model's probe raised in model.layers.0.self_attn.q_norm "
               "(Olmo2RMSNorm), inside model.layers.0.self_attn (containing q_proj: column",
               "RuntimeError: The size of tensor a (32) must match the size of tensor b",
               "restored unsharded", "likely cause: the model's own code"]),
    ("bloom", ["the parallel model's probe raised in transformer.h.0.self_attention "
               "(BloomAttention, containing query_key_value: column(layout='per_head', heads=4)"
               ", dense: row): RuntimeError: The expanded size of the tensor",
               "likely cause: the model's own code"]),
    ("toy", ["the parallel model's probe raised in block (_StrictBlock, containing up: column, "
             "down: row): RuntimeError: _StrictBlock needs 32 features, got"]),
    ("replace", ["building the replacement of head (Linear, style 'custom') raised "
                 "RuntimeError: no parallel twin for this head"]),
])
def test_a_failure_inside_restores_the_model(world, case, needles):
    for rank, res in enumerate(_failures_for(world)):
        _check_refused(res, case, rank, needles, "RuntimeError")


@pytest.mark.parametrize("world", [2, 4])
def test_a_failure_on_one_rank_refuses_on_every_rank(world):
    cause = ("building the replacement of 3 (Linear, style 'custom') raised RuntimeError: "
             "no parallel twin for this head")
    for rank, res in enumerate(_failures_for(world)):
        last = rank == world - 1
        needles = [cause] if last else [f"refused because rank {world - 1} failed", cause]
        _check_refused(res, "replace-one-rank", rank, needles, "RuntimeError" if last else None)
