"""overlap.plan memory: parameter counts, Korthikanti et al. activation formulas, ZeRO, and the
seeds' worked examples, each against numbers computed by hand here."""

import dataclasses

import pytest

from overlap.plan import ClusterSpec, Layout, ModelSpec, get_model, get_profile
from overlap.plan.memory import layer_activation_bytes, memory_per_rank, rank_params

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

A100_80 = get_profile("a100-80g")


def gpt(**kw) -> ModelSpec:
    base = dict(num_layers=24, hidden=2048, num_heads=16, vocab=51200, seq_len=2048)
    base.update(kw)
    return ModelSpec(**base)


def test_gpt3_175b_parameter_count():
    m = get_model("gpt3-175b")
    L, h, V, s = 96, 12288, 51200, 2048
    # 12h^2 + 13h per layer (qkv, out, fc1, fc2 with biases, two layernorms), word and
    # position embeddings, final layernorm; the head is tied.
    assert m.total_params() == L * (12 * h * h + 13 * h) + V * h + s * h + 2 * h
    assert m.total_params() == 174_615_846_912


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_korthikanti_per_layer(tp, sp, recompute):
    m = gpt()
    s, b, h, a = 2048, 2, 2048, 16
    lay = Layout(tp=tp, global_batch=64, micro_batch=b, recompute=recompute,
                 sequence_parallel=sp, flash_attention=False)
    sbh = s * b * h
    if recompute == "full":
        want = 2 * sbh / (tp if sp else 1)
    elif sp:
        want = sbh * (34 + (5 * a * s / h if recompute == "none" else 0)) / tp
    else:
        want = sbh * (10 + 24 / tp + (5 * a * s / (h * tp) if recompute == "none" else 0))
    assert layer_activation_bytes(m, lay) == pytest.approx(want, rel=1e-12)


def test_flash_attention_stores_no_scores():
    m = gpt()
    lay = Layout(tp=2, global_batch=64, recompute="none", sequence_parallel=True)
    assert lay.flash_attention
    assert layer_activation_bytes(m, lay) == pytest.approx(34 * 2048 * 2048 / 2)


def test_gqa_swiglu_no_dropout_by_hand():
    # Llama-3-70B-like layer, tp=8, SP, selective: Q 2sbh, K and V 2*sb*kv each, out-proj input
    # 2sbh, gate and up outputs 2sbF each, fc2 input 2sbF, two norm inputs 2sbh each, the
    # qkv and fc1 inputs 2sbh each; no dropout masks.
    m = get_model("llama3-70b")
    s, b, h, kv, f, t = 8192, 1, 8192, 1024, 28672, 8
    lay = Layout(tp=t, global_batch=64, recompute="selective", sequence_parallel=True)
    by_hand = s * b * (2 * h + 4 * kv + 2 * h + 6 * f + 8 * h) / t
    assert layer_activation_bytes(m, lay) == pytest.approx(by_hand)


def _cluster(gpus=512):
    return ClusterSpec(device=A100_80, num_gpus=gpus)


def test_seed_example_gpt3_175b_tp8_pp8_dp8_zero1():
    """The seeds: 'parameters ~ 5.4 GB fp16 per GPU'. That is 174.6e9 x 2 B / 64 = 5.46 GB on
    average; the planner puts the embedding on the first stage (vocab-parallel, plus the
    replicated position table) and a copy of the tied head on the last, so the middle stages
    hold 12 layers of 12h^2/8 + the replicated norms and biases = 5.44 GB and the first 5.65 GB."""
    m = get_model("gpt3-175b")
    lay = Layout(tp=8, pp=8, global_batch=1536, micro_batch=1, zero=1)
    mem = memory_per_rank(m, lay, _cluster())
    h = 12288
    middle = 12 * ((12 * h * h + 7 * h) / 8 + 6 * h)
    assert rank_params(m, lay, 3) == pytest.approx(middle)
    assert mem[3].weights / 1e9 == pytest.approx(5.4, abs=0.05)
    assert m.total_params() * 2 / 64 / 1e9 == pytest.approx(5.46, abs=0.01)
    first = middle + 51200 * h / 8 + 2048 * h
    assert mem[0].weights == pytest.approx(2 * first)
    # fp32 main grads (4 B/param, not sharded by ZeRO-1); Adam state 12 B/param over dp = 8.
    assert mem[3].grads == pytest.approx(4 * middle)
    assert mem[3].optimizer == pytest.approx(12 * middle / 8)


def test_seed_example_100b():
    """The seeds' 100B example on TP=PP=DP=8 with ZeRO-1: 3.1 GB weights and 2.3 GB optimizer.
    A 100B GPT (L=80, h=10240: 12Lh^2 = 100.7e9) gives 3.15 GB and 2.36 GB per middle GPU:
    2 B x P/64 and 12 B x P/64/8; the seeds round 2.36 down to 2.3."""
    m = gpt(num_layers=80, hidden=10240, num_heads=80)
    lay = Layout(tp=8, pp=8, global_batch=1536, zero=1)
    mem = memory_per_rank(m, lay, _cluster())
    assert mem[3].weights / 1e9 == pytest.approx(3.1, abs=0.06)
    assert mem[3].optimizer / 1e9 == pytest.approx(2.3, abs=0.07)
    p = rank_params(m, lay, 3)
    assert mem[3].weights == pytest.approx(2 * p) and mem[3].optimizer == pytest.approx(12 * p / 8)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages(zero):
    m = gpt()
    lay = Layout(tp=2, pp=2, global_batch=256, zero=zero)
    mem = memory_per_rank(m, lay, _cluster(64))[1]
    p = rank_params(m, lay, 1)
    d = 16  # 64 / (2 * 2)
    assert mem.optimizer == pytest.approx(12 * p / (d if zero >= 1 else 1))
    assert mem.grads == pytest.approx(4 * p / (d if zero >= 2 else 1))
    if zero < 3:
        assert mem.weights == pytest.approx(2 * p)
    else:
        sharded, repl = m.layer_params()
        assert mem.weights == pytest.approx(2 * p / d + 2 * 2 * (sharded / 2 + repl))


@pytest.mark.parametrize("pp,v", [(4, 2), (8, 2), (4, 3)])
def test_interleaving_penalty(pp, v):
    """Korthikanti et al.: the first stage of interleaved 1F1B holds L(1 + (p-1)/(pv)) layers of
    activations; 1F1B holds L. The planner takes the count from the schedule."""
    m = gpt(num_layers=pp * v * 2)
    base = dict(pp=pp, global_batch=32 * pp, recompute="selective", sequence_parallel=False)
    plain = memory_per_rank(m, Layout(schedule="1f1b", **base), _cluster(8 * pp))[0]
    inter = memory_per_rank(m, Layout(schedule="interleaved", virtual=v, **base),
                            _cluster(8 * pp))[0]
    per_layer = layer_activation_bytes(m, Layout(**base))
    extra = 2048 * 2048  # embedding dropout mask per live micro-batch (s*b*h/t, t = 1)
    assert plain.activations == pytest.approx(m.num_layers * per_layer + pp * extra)
    live_inter = 2 * (pp - 1) + (v - 1) * pp + 1
    assert inter.activations == pytest.approx(live_inter * 2 * per_layer + live_inter * extra)
    assert (inter.activations - live_inter * extra) / (plain.activations - pp * extra) == \
        pytest.approx(1 + (pp - 1) / (pp * v))


def test_last_stage_output_layer():
    m = gpt()
    lay = Layout(tp=4, pp=2, global_batch=64, sequence_parallel=True)
    mem = memory_per_rank(m, lay, _cluster(64))
    per_layer = layer_activation_bytes(m, lay)
    sbh = 2048 * 2048
    # 1F1B: the last rank holds 1 live micro-batch of its 12 layers, plus 4sbh/t(1 + V/h).
    assert mem[1].activations == pytest.approx(12 * per_layer + 4 * sbh / 4 * (1 + 51200 / 2048))


def test_model_shape_errors_name_the_flag():
    with pytest.raises(ValueError, match="--hidden 100 is not divisible by --heads 3"):
        ModelSpec(num_layers=2, hidden=100, num_heads=3, vocab=10, seq_len=8)
    with pytest.raises(ValueError, match="--kv-heads 5"):
        dataclasses.replace(gpt(), num_kv_heads=5)
