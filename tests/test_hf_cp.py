"""overlap.cp.hf: tiny Llama, Qwen2, Qwen3, Mistral at cp 2 (Llama also by all-gather, Ulysses,
every rope type, at cp 2 x tp 2 and cp 1) vs the unsharded model on the whole sequence (gathered
logits, loss, every gradient summed over CP, gathered over TP); refusals on every rank.
Tolerance, fp32 (the ring has no fp64): both sides round each operation once (u = 2^-24 = 6e-8)
and differ only in the order of sums (attention blocks merged by log-sum-exp vs one SDPA;
per-rank token sums of weight gradients then a sum over CP; TP partial sums). A reordered sum
of n <= 64 terms moves by ~sqrt(n) u = 4.8e-7 of its terms' size per side (probabilistic bound;
worst case n u), ~1e-6 for two. It passes a chain of ~21 reductions (2 layers x (norm, q/k/v,
scores, softmax, P.V, o, norm, up, down), norm, head, log-sum-exp), each with gain <= 1 but the
softmax: a score error moves it by |s| <= 5.3 here (q/k weights of std 0.15 make attention
peaked, so positions matter), hence logits and loss: (21 + 2 x 5.3) x 1e-6 -> TOL = 3e-5 of the
largest entry; gradients run that chain back plus the token sum: GRAD_TOL = 6e-5 (of the
parameter's largest entry, floored at 1% of the model's). Measured: logits <= 2.3e-7, loss <=
4.8e-7 (1 ulp of ~4.2), gradients <= 9.5e-7. Positions counted from 0 on each rank are off by
0.2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

VOCAB, SEQ, BATCH = 64, 24, 2  # 6 tokens per zig-zag chunk at cp 2
TOL, GRAD_TOL = 3e-5, 6e-5
# rope types (2 x 32 tokens: n <= 64 still): both sides rotate by the same cos/sin (same
# frequencies, same positions); a rotation keeps |q| and |k|, so |s| grows only by the square
# of the attention factor yarn and longrope put on cos/sin (<= 1.1 here): |s| <= 6.4, hence
# (21 + 2 x 6.4) x 1e-6 -> 4e-5, gradients twice. Measured: <= 2.9e-7, 4.8e-7, 9.2e-7.
ROPE_TOL, ROPE_GRAD_TOL = 4e-5, 8e-5
FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def build(family: str, **overrides):
    """A seeded tiny decoder: hidden 32, 2 layers, 4 query heads over 2 kv heads; the norms
    drawn so a wrong gradient cannot hide behind a symmetric one."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4,
                                              n_positions=64, bos_token_id=0,
                                              eos_token_id=0))
    classes = {"llama": (T.LlamaForCausalLM, T.LlamaConfig),
               "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config),
               "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config),
               "mistral": (T.MistralForCausalLM, T.MistralConfig)}
    model_cls, config_cls = classes[family]
    extra = {"head_dim": 8} if family == "qwen3" else {}
    model = model_cls(config_cls(**{**common, **extra, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.15)
    return model


def _batch(seed: int, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


def _rel(got, want, floor=1e-12) -> float:
    want = want.double()
    return ((got.double() - want).abs().max() / max(want.abs().max().item(), floor)).item()


def _grad_err(grads: dict, ref) -> tuple[float, str]:
    floor = 1e-2 * max(p.grad.abs().max().item() for p in ref.parameters())
    errs = {n: _rel(grads[n], p.grad, floor) for n, p in ref.named_parameters()}
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def _cp_grads(model, dims, tp: int) -> dict:
    """Every parameter's gradient summed over CP (each rank holds its tokens' share), then
    gathered over TP into the unsharded layout."""
    from overlap.nn import gather_grads

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dims.cp_group)
    return gather_grads(model) if tp > 1 else {n: p.grad for n, p in model.named_parameters()}


def _job(family: str, tp: int, cp: int, extras: bool, method: str = "ring",
         config: dict | None = None, seq: int = SEQ, again: tuple[int, ...] = ()):
    from overlap.cp import CPComm
    from overlap.cp.hf import cp_gather_logits, cp_loss, cp_shard_inputs, enable_context_parallel
    from overlap.dist import ParallelDims
    from overlap.nn import parallelize
    from overlap.tp import TPComm

    dims = ParallelDims.build(tp=tp, cp=cp)
    cp_comm = CPComm(dims.cp_group, timeout=60)
    tp_comm = TPComm(dims.tp_group) if tp > 1 else None
    solo = None
    out = {}
    try:
        ref = build(family, **(config or {}))
        model = copy.deepcopy(ref)
        if tp > 1:  # TP first (its verification runs the plain model), then the ring
            parallelize(model, comm=tp_comm, cp_comm=cp_comm)
        else:
            enable_context_parallel(model, comm=cp_comm, method=method)
        ids = _batch(1, seq)
        shard = cp_shard_inputs(ids, comm=cp_comm, labels=ids)
        res = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False)
        if extras and cp > 1:  # a second model on another communicator (a group of one)
            solo = CPComm(dims.tp_group, timeout=60)
            other = enable_context_parallel(copy.deepcopy(ref), comm=solo)
            out["solo_err"] = _rel(other(input_ids=ids).logits, ref(input_ids=ids).logits)
        loss = cp_loss(res.logits, shard.labels, comm=cp_comm)
        loss.backward()
        want = ref(input_ids=ids, labels=ids, use_cache=False)
        want.loss.backward()
        out["logit_err"] = _rel(cp_gather_logits(res.logits.detach(), comm=cp_comm),
                                want.logits)
        out["loss_err"] = abs(loss.item() - want.loss.item())
        out["grad_err"], out["worst"] = _grad_err(_cp_grads(model, dims, tp), ref)
        for i, length in enumerate(again):  # later calls, other lengths: the same logits
            more = _batch(10 + i, length)
            piece = cp_shard_inputs(more, comm=cp_comm)
            got = model(input_ids=piece.input_ids, position_ids=piece.position_ids).logits
            out[f"logit_err_{length}_{i}"] = _rel(cp_gather_logits(got.detach(), comm=cp_comm),
                                                  ref(input_ids=more).logits)
        if cp == 1:  # the identity: nothing cut, positions 0..S-1, labels shifted by one
            out["identity"] = (torch.equal(shard.input_ids, ids)
                               and torch.equal(shard.position_ids[0], torch.arange(SEQ))
                               and torch.equal(shard.labels[:, :-1], ids[:, 1:])
                               and bool((shard.labels[:, -1] == -100).all()))
            out["default_pos_err"] = _rel(model(input_ids=ids).logits, want.logits)
        if extras:
            # the loss on gathered logits (the same on every rank) gives the same gradients
            model.zero_grad(set_to_none=True)
            res = model(input_ids=shard.input_ids, position_ids=shard.position_ids)
            full = cp_gather_logits(res.logits, comm=cp_comm)
            torch.nn.functional.cross_entropy(full[:, :-1].flatten(0, 1),
                                              ids[:, 1:].flatten()).backward()
            out["gathered_grad_err"], _ = _grad_err(_cp_grads(model, dims, tp), ref)
            # the negative control: this rank's positions counted from 0
            local = torch.arange(SEQ // cp).unsqueeze(0)
            wrong = model(input_ids=shard.input_ids, position_ids=local).logits
            out["wrong_pos_err"] = _rel(cp_gather_logits(wrong.detach(), comm=cp_comm),
                                        want.logits)
    finally:
        for c in (cp_comm, tp_comm, solo):
            if c is not None:
                c.close()
    return out


def _check(results, tol: float = TOL, grad_tol: float = GRAD_TOL):
    for rank, res in enumerate(results):
        for key in (k for k in res if k.startswith("logit_err")):
            assert res[key] <= tol, (rank, key, res)
        assert res["loss_err"] <= tol, (rank, res)
        assert res["grad_err"] <= grad_tol, (rank, res)
        if "gathered_grad_err" in res:
            assert res["gathered_grad_err"] <= GRAD_TOL, (rank, res)
        if "solo_err" in res:
            assert res["solo_err"] <= TOL, (rank, res)


def test_llama_cp2_equals_the_unsharded_model():
    """Logits, loss and every gradient at cp 2; a loss on the gathered logits gives the same
    gradients; a second model on another communicator runs alongside; positions counted from
    0 on each rank would be visibly wrong."""
    results = run_ranks(_job, 2, "llama", 1, 2, True, timeout=60)
    _check(results)
    for res in results:
        assert res["wrong_pos_err"] > 1e-2, res


@pytest.mark.parametrize("family", FAMILIES[1:])
def test_other_families_cp2_equal_the_unsharded_model(family):
    """Qwen2 (qkv biases), Qwen3 (per-head q/k norms), Mistral (a sliding window longer than
    the sequence, which changes nothing) at cp 2: logits, loss and gradients."""
    _check(run_ranks(_job, 2, family, 1, 2, False, timeout=60))


# one tiny config per rope type transformers ships (head size 8: 4 frequencies); the lengths
# cross the types' thresholds: dynamic grows past max_position_embeddings 16 (each rank's
# largest position differs: 31 / 23 at cp 2), longrope switches to its long factors past 28
_THETA = {"rope_theta": 10000.0}
ROPES = {
    "default": {},
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, **_THETA}),
    "dynamic": dict(max_position_embeddings=16,
                    rope_parameters={"rope_type": "dynamic", "factor": 2.0, **_THETA}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                  "original_max_position_embeddings": 32, **_THETA}),
    "longrope": dict(rope_parameters={"rope_type": "longrope", "factor": 2.0,
                                      "short_factor": [1.0, 1.1, 1.3, 1.6],
                                      "long_factor": [1.5, 2.5, 4.0, 8.0],
                                      "original_max_position_embeddings": 28, **_THETA}),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32, **_THETA}),
    "proportional": dict(rope_parameters={"rope_type": "proportional",
                                          "partial_rotary_factor": 0.5, **_THETA}),
}
# later calls: shorter (dynamic keeps its grown frequencies), below both thresholds (dynamic
# resets, longrope goes short), longer (dynamic grows again)
ROPE_SEQ, ROPE_AGAIN = 32, (24, 8, 40)


@pytest.mark.parametrize("rope", ["default", *sorted(ROPE_INIT_FUNCTIONS)])
def test_llama_rope_types_cp2_equal_the_unsharded_model(rope):
    """Every rope type transformers ships at cp 2: logits, loss, every gradient, then the
    logits of three more calls of other lengths (dynamic's frequencies carry over calls).
    Dynamic and longrope pick frequencies from the largest position, which differs by rank:
    each rank gets the whole sequence's. A new type fails here until it is decided."""
    assert rope in ROPES, f"transformers ships rope type {rope!r}: add a config to ROPES"
    _check(run_ranks(_job, 2, "llama", 1, 2, False, "ring", ROPES[rope], ROPE_SEQ, ROPE_AGAIN,
                     timeout=60), ROPE_TOL, ROPE_GRAD_TOL)


def test_llama_dynamic_rope_cp4_equals_the_unsharded_model():
    """Dynamic rope at cp 4 (largest positions 31, 27, 23, 19 by rank)."""
    _check(run_ranks(_job, 4, "llama", 1, 4, False, "ring", ROPES["dynamic"], ROPE_SEQ,
                     ROPE_AGAIN, timeout=90), ROPE_TOL, ROPE_GRAD_TOL)


@pytest.mark.parametrize("method", ["allgather", "ulysses"])
def test_llama_cp2_other_methods_equal_the_unsharded_model(method):
    """enable_context_parallel(method=...) runs overlap.cp.cp_attention's other methods."""
    _check(run_ranks(_job, 2, "llama", 1, 2, False, method, timeout=60))


def test_llama_cp2_x_tp2_equals_the_unsharded_model():
    """4 ranks: heads over TP (parallelize(comm=tp, cp_comm=cp)), the ring over CP on each TP
    rank's heads."""
    _check(run_ranks(_job, 4, "llama", 2, 2, False, timeout=90))


def test_cp1_is_the_identity():
    """A CP group of one: the inputs are not cut, positions are 0..S-1 (also by default),
    labels are shifted; the model is the unsharded one."""
    (res,) = run_ranks(_job, 1, "llama", 1, 1, False, timeout=60)
    _check([res])
    assert res["identity"], res
    assert res["default_pos_err"] <= TOL, res


# ------------------------------------------------------------------------ bad input

def _refusal_job():
    import torch.nn as nn

    from overlap.cp import CPComm
    from overlap.cp.hf import cp_loss, cp_shard_inputs, enable_context_parallel

    comm = CPComm(dist.group.WORLD, timeout=60)
    out = {}

    def refused(key, fn):
        try:
            fn()
        except (TypeError, ValueError, RuntimeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
        else:
            out[key] = None

    try:
        ref = build("llama")
        model = enable_context_parallel(copy.deepcopy(ref), comm=comm)
        ids = _batch(2)
        shard = cp_shard_inputs(ids, comm=comm, labels=ids)
        kw = dict(input_ids=shard.input_ids, position_ids=shard.position_ids)
        refused("length", lambda: cp_shard_inputs(_batch(2, 18), comm=comm))
        refused("family", lambda: enable_context_parallel(build("gpt2"), comm=comm))
        refused("interface", lambda: enable_context_parallel(nn.Linear(4, 4), comm=comm))
        refused("comm", lambda: enable_context_parallel(build("llama"), comm=dist.group.WORLD))
        refused("method", lambda: enable_context_parallel(build("llama"), comm=comm,
                                                          method="nope"))
        refused("mask", lambda: model(**kw, attention_mask=torch.ones_like(shard.input_ids)))
        refused("positions", lambda: model(input_ids=shard.input_ids))
        refused("labels", lambda: model(**kw, labels=shard.labels))
        refused("odd", lambda: model(input_ids=_batch(3, 5), position_ids=_batch(3, 5)))
        refused("loss", lambda: cp_loss(torch.zeros(2, 4, VOCAB), shard.labels, comm=comm))
        model.train()
        for m in model.modules():
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.1
        refused("dropout", lambda: model(**kw))
        windowed = enable_context_parallel(build("mistral", sliding_window=8), comm=comm)
        refused("window", lambda: windowed(**kw))
        by_hand = build("llama")
        by_hand.config._attn_implementation = "overlap_cp"
        refused("by_hand", lambda: by_hand(**kw))
        # nothing was sent: the communicator still works
        model.eval()
        for m in model.modules():
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.0
        got = model(**kw).logits
        from overlap.cp.hf import cp_gather_logits

        out["after_err"] = _rel(cp_gather_logits(got, comm=comm), ref(input_ids=ids).logits)
    finally:
        comm.close()
    return out


# what each refusal must name (besides the rank)
REFUSALS = {
    "length": ("ValueError", "cp_shard_inputs", "input_ids", "2 * cp = 4", "got 18"),
    "family": ("ValueError", "enable_context_parallel", "model_type 'gpt2'", "llama"),
    "interface": ("TypeError", "enable_context_parallel", "AttentionInterface", "Linear"),
    "comm": ("TypeError", "enable_context_parallel", "comm must be an overlap.cp.CPComm"),
    "method": ("ValueError", "enable_context_parallel", "method must be one of", "'nope'"),
    "mask": ("ValueError", "attention_mask must be None", "padding"),
    "positions": ("ValueError", "position_ids must be given at cp=2", "cp_shard_inputs"),
    "labels": ("ValueError", "labels must be None", "cp_loss"),
    "odd": ("ValueError", "input_ids", "even s", "(2, 5)"),
    "loss": ("ValueError", "cp_loss", "labels (b, s)"),
    "dropout": ("ValueError", "overlap_cp attention", "dropout must be 0", "layer 0"),
    "window": ("ValueError", "overlap_cp attention", "sliding_window=8", "24 tokens"),
    "by_hand": ("RuntimeError", "no CP communicator", "enable_context_parallel"),
}


def test_bad_input_is_refused_on_every_rank():
    """Each refusal is a TypeError/ValueError (RuntimeError for a module switched by hand)
    naming the op, the argument and the rank, raised before any transfer, on every rank; the
    communicator still works afterwards."""
    for rank, res in enumerate(run_ranks(_refusal_job, 2, timeout=60)):
        for key, needles in REFUSALS.items():
            msg = res[key]
            assert msg is not None, f"rank {rank}: {key} was accepted"
            assert msg.startswith(needles[0] + ":"), (rank, key, msg)
            for needle in needles[1:]:
                assert needle in msg, (rank, key, needle, msg)
            assert f"rank {rank}" in msg, (rank, key, msg)
        assert res["after_err"] <= TOL, (rank, res)


def _rotary_refusal_job():
    import transformers as T
    import transformers.modeling_rope_utils as mru

    from overlap.cp import CPComm
    from overlap.cp.hf import enable_context_parallel

    comm = CPComm(dist.group.WORLD, timeout=60)
    out = {}

    def refused(key, model):
        try:
            enable_context_parallel(model, comm=comm)
        except ValueError as exc:
            out[key] = f"ValueError: {exc}"
        else:
            out[key] = None

    try:
        unknown = build("llama")
        unknown.model.rotary_emb.rope_type = "mine"  # as a rope type added by a user would
        refused("unknown", unknown)
        ours = mru.ROPE_INIT_FUNCTIONS["linear"]
        mru.ROPE_INIT_FUNCTIONS["linear"] = lambda config, *a, **kw: ours(config, *a, **kw)
        try:
            refused("replaced", build("llama", **ROPES["linear"]))
        finally:
            mru.ROPE_INIT_FUNCTIONS["linear"] = ours
        custom = build("llama")
        rotary = custom.model.rotary_emb
        rotary.__class__ = type("MyRotaryEmbedding", (type(rotary),),
                                {"forward": lambda self, x, position_ids: (x, x)})
        refused("forward", custom)
        refused("bloom", T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, hidden_size=32,
                                                          n_layer=1, n_head=4)))
        refused("falcon", T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            alibi=True)))
    finally:
        comm.close()
    return out


ROTARY_REFUSALS = {
    "unknown": ("LlamaForCausalLM.model.rotary_emb", "rope type 'mine'",
                "config.rope_parameters['rope_type']", "dynamic"),
    "replaced": ("rope type 'linear'", "ROPE_INIT_FUNCTIONS['linear']"),
    "forward": ("MyRotaryEmbedding", "dynamic_rope_update"),
    "bloom": ("model_type 'bloom'", "ALiBi"),
    "falcon": ("model_type 'falcon'", "ALiBi"),
}


def test_unknown_position_handling_is_refused_on_every_rank():
    """enable_context_parallel refuses, on every rank, naming the model, the module, the
    config field and the rope type: a rope type transformers does not ship, a shipped type
    whose frequency function was replaced, a rotary module with its own forward, ALiBi
    models."""
    for rank, res in enumerate(run_ranks(_rotary_refusal_job, 2, timeout=60)):
        for key, needles in ROTARY_REFUSALS.items():
            msg = res[key]
            assert msg is not None, f"rank {rank}: {key} was accepted"
            for needle in ("ValueError: enable_context_parallel", f"rank {rank}", *needles):
                assert needle in msg, (rank, key, needle, msg)


# ------------------------------------------------------------------------ per-call agreement

def _outcome(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the kind and the message
        return type(exc).__name__, str(exc)
    return None, None


def _layer_order_job(method: str):
    """An agreeing forward (logits vs the unsharded model), then odd ranks run the decoder's
    two layers in the other order: the attention layers alike in everything but layer_idx."""
    import torch.nn as nn

    from overlap.cp import CPComm
    from overlap.cp.hf import cp_gather_logits, cp_shard_inputs, enable_context_parallel

    comm = CPComm(dist.group.WORLD, timeout=20)
    try:
        ref = build("llama")
        model = enable_context_parallel(copy.deepcopy(ref), comm=comm, method=method)
        ids = _batch(4)
        shard = cp_shard_inputs(ids, comm=comm)
        run = lambda: model(input_ids=shard.input_ids,  # noqa: E731
                            position_ids=shard.position_ids, use_cache=False).logits
        err = _rel(cp_gather_logits(run().detach(), comm=comm), ref(input_ids=ids).logits)
        if dist.get_rank() % 2:
            model.model.layers = nn.ModuleList(reversed(model.model.layers))
        return err, _outcome(run)
    finally:
        comm.close()


@pytest.mark.parametrize("world,method", [(2, "ring"), (2, "allgather"), (2, "ulysses"),
                                          (4, "ring"), (4, "allgather"), (4, "ulysses")])
def test_layers_run_in_other_orders_raise_naming_the_layer(world, method):
    # The two layers' attention calls have equal shapes, causal and scale: before, each rank
    # attended another layer's keys and returned wrong logits. Each module's layer_idx now
    # rides in the call's stamp.
    for rank, (err, (kind, msg)) in enumerate(run_ranks(_layer_order_job, world, method,
                                                        timeout=90)):
        assert err <= TOL, (rank, err)
        assert kind == "Disagreement", (rank, kind, msg)
        assert f"{method}_attention: call 4: ranks disagree on layer" in msg, (rank, msg)
        assert f"rank {rank}" in msg, (rank, msg)


# cp_loss's agreeing value vs F.cross_entropy on the whole batch, fp32: both sum the same
# per-token terms in other orders (n <= 32 tokens: n u of the sum of terms, all positive) and
# each term's log-sum-exp over V = 64 logits may be summed in another order (64 u absolute, on
# terms >= log(64) / 2 > 2): (32 + 32) u < 128 u. cp_gather_logits moves bytes: exact.
LOSS_TOL = 128 * 2.0 ** -24


def _loss_job():
    import torch.nn.functional as F

    from overlap.cp import CPComm, ring_attention
    from overlap.cp.hf import cp_gather_logits, cp_loss
    from overlap.cp.zigzag import zigzag_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(3)
    full = torch.randn(BATCH, 4 * world, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, 4 * world), generator=g)
    labels[0, ::3] = -100
    mine, my_labels = (zigzag_shard(t, 1, cp=world, rank=rank) for t in (full, labels))
    want = F.cross_entropy(full.flatten(0, 1), labels.flatten(), ignore_index=-100)
    out = {}

    def fresh(timeout=20):
        return CPComm(dist.group.WORLD, timeout=timeout)

    comm = fresh()
    got = cp_loss(mine, my_labels, comm=comm)
    out["agree"] = ((got - want).abs() / want).item()
    kept = my_labels.clamp(min=0)  # valid under any ignore_index: no local error
    out["ignore_index"] = _outcome(lambda: cp_loss(mine, kept, comm=comm,
                                                   ignore_index=0 if rank == 1 else -100))
    out["later"] = _outcome(lambda: cp_loss(mine, kept, comm=comm))
    comm.close()
    # Rank 1 fails alone before the reduction (-100 labels, ignore_index -1). The others raise
    # at once from the store, but on plain gloo closing a communicator waits for its abandoned
    # all-reduce to time out: a short timeout keeps the test short.
    comm = fresh(timeout=4)
    cp_loss(mine, my_labels, comm=comm)
    out["local error"] = _outcome(lambda: cp_loss(mine, my_labels, comm=comm,
                                                  ignore_index=-1 if rank == 1 else -100))
    comm.close()
    comm = fresh()
    cp_loss(mine, my_labels, comm=comm)
    wide = torch.randn(*mine.shape[:2], VOCAB + (rank == 1))
    out["V"] = _outcome(lambda: cp_loss(wide, my_labels, comm=comm))
    comm.close()
    comm = fresh()  # rank 1 calls cp_loss twice; the others go on to the next attention
    cp_loss(mine, my_labels, comm=comm)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    out["twice"] = _outcome(lambda: cp_loss(mine, my_labels, comm=comm) if rank == 1
                            else ring_attention(q, k, v, comm=comm, causal=True))
    comm.close()
    comm = fresh()
    out["gathered"] = torch.equal(cp_gather_logits(mine, comm=comm), full)
    out["gather V"] = _outcome(lambda: cp_gather_logits(wide, comm=comm))
    comm.close()
    return out


@pytest.mark.parametrize("backend", [None, "gloo"])
@pytest.mark.parametrize("world", [2, 4])
def test_cp_loss_and_gather_disagreements_raise_on_every_rank(world, backend):
    # Before: cp_loss was a bare 2-value all-reduce (another ignore_index or V, or an extra
    # call, paired silently; the extra one hung) and cp_gather_logits a bare all-gather (other
    # V: a size error, or a process aborted on plain gloo). Now both carry the call's stamp.
    for rank, out in enumerate(run_ranks(_loss_job, world, timeout=90, backend=backend)):
        assert out["agree"] <= LOSS_TOL, (rank, out["agree"])
        assert out["gathered"], rank
        for case, needle in (("ignore_index", "cp_loss: call 2: ranks disagree on ignore_index"),
                             ("V", "cp_loss: call 2: ranks disagree on q shape"),
                             ("twice", "call 2: ranks disagree on op"),
                             ("gather V", "cp_gather_logits: call 2: ranks disagree on q shape")):
            kind, msg = out[case]
            assert kind == "Disagreement", (rank, case, kind, msg)
            assert needle in msg and f"rank {rank}" in msg, (rank, case, msg)
        kind, msg = out["later"]
        assert kind == "CPCommFailed" and "disagree on ignore_index" in msg, (rank, kind, msg)
        kind, msg = out["local error"]  # rank 1's own error; the others read it in the store
        assert "Target -100 is out of bounds" in msg, (rank, kind, msg)
        assert kind == ("IndexError" if rank == 1 else "RuntimeError"), (rank, kind, msg)
        assert rank == 1 or "cp rank 1 (global rank 1) failed" in msg, (rank, msg)
        assert "cp_loss" in out["twice"][1] and "ring_attention" in out["twice"][1], out["twice"]
