"""overlap.plan: alpha-beta collectives and placement by hand, the CPU twin's cores floor, the
mapping of the main job's TrainConfig, and device-profile JSON."""

import dataclasses
import math

import pytest

from overlap.plan import (ClusterSpec, DeviceProfile, GemmCurve, Layout, LinkSpec, ModelSpec,
                          get_profile)
from overlap.plan.comm import axis_placement, collective_time, p2p_time, placement
from overlap.plan.estimate import estimate
from overlap.plan.selfpredict import CONFIGS, plan_inputs

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

A100 = get_profile("a100-80g")


def test_ring_all_reduce_inside_a_node_by_hand():
    c = ClusterSpec(device=A100, num_gpus=8)
    place = placement(c, 8, 1)
    nbytes = 64e6
    t, algo = collective_time("all_reduce", nbytes, place, A100)
    bw = A100.intra.bandwidth * A100.intra.efficiency
    want = A100.base_latency_s + 14 * A100.intra.latency_s + 2 * 7 / 8 * nbytes / bw
    assert algo == "ring" and t == pytest.approx(want)
    t_ag, _ = collective_time("all_gather", nbytes, place, A100)
    assert t_ag == pytest.approx(A100.base_latency_s + 7 * A100.intra.latency_s
                                 + 7 / 8 * nbytes / bw)


def test_placement_follows_parallel_dims():
    """TP innermost: tp groups stay in a node; with tp=8 a dp group has one GPU per node and
    crosses InfiniBand through one NIC each."""
    c = ClusterSpec(device=A100, num_gpus=512)
    kw = dict(tp=8, cp=1, pp=8, dp=8)
    assert axis_placement(c, "tp", **kw) == placement(c, 8, 1)
    assert axis_placement(c, "tp", **kw).nodes == 1
    dp = axis_placement(c, "dp", **kw)
    assert (dp.size, dp.per_node, dp.nodes) == (8, 1, 8)
    kw2 = dict(tp=2, cp=1, pp=1, dp=256)
    dp2 = axis_placement(c, "dp", **kw2)
    assert (dp2.per_node, dp2.nodes) == (4, 64)


def test_tree_wins_for_small_messages_across_nodes():
    c = ClusterSpec(device=A100, num_gpus=512)
    place = placement(c, 64, 8)
    small, algo_small = collective_time("all_reduce", 4096, place, A100)
    big, algo_big = collective_time("all_reduce", 1e9, place, A100)
    assert algo_small == "tree" and algo_big == "ring"
    n = 64
    ring_small = A100.base_latency_s + 2 * (n - 1) * A100.inter.latency_s + \
        2 * (n - 1) / n * 4096 / (A100.inter.bandwidth * A100.inter.efficiency)
    assert small < ring_small
    tree_small = A100.base_latency_s + 2 * math.ceil(math.log2(64)) * A100.inter.latency_s + \
        4096 / (0.45 * A100.inter.bandwidth * A100.inter.efficiency)
    assert small == pytest.approx(tree_small)


def test_p2p_by_hand():
    t = p2p_time(8e6, True, A100)
    assert t == pytest.approx(A100.base_latency_s + A100.inter.latency_s
                              + 8e6 / (A100.inter.bandwidth * A100.inter.efficiency))


def _cpu_profile(cores: float) -> DeviceProfile:
    link = LinkSpec(bandwidth=1e9, latency_s=50e-6)
    return DeviceProfile(name="cpu-test", peak_flops=50e9, hbm_bytes=16e9, hbm_bandwidth=10e9,
                         mem_efficiency=1.0, gemm=GemmCurve(e_max=1.0, d_half=4.0,
                                                            overhead_s=2e-6),
                         intra=link, inter=link, base_latency_s=100e-6,
                         host_layer_s=(0.5e-3, 1e-3), host_tp_layer_s=(2e-3, 4e-3),
                         host_action_s=0.3e-3, host_tp_action_s=0.6e-3, comm_cpu_s=200e-6,
                         p2p_cpu_s=150e-6, host_cores=cores)


def test_cpu_twin_floor_is_cpu_work_over_cores():
    from overlap.train.config import parse_args

    model, layout = plan_inputs(parse_args([]))
    roomy = estimate(model, ClusterSpec.local(_cpu_profile(8.0), 8), layout)
    tight = estimate(model, ClusterSpec.local(_cpu_profile(1.0), 8), layout)
    assert tight.cpu_work_s == pytest.approx(roomy.cpu_work_s)
    assert tight.cpu_bound and tight.step_time_s == pytest.approx(tight.cpu_work_s / 1.0)
    assert roomy.step_time_s >= roomy.cpu_work_s / 8.0
    # Node CPU work = 8 ranks x mean over pp ranks of (m x stage work + 2 P2P sides per
    # transfer x 2 transfers x m + DP collectives + optimizer + step); each pp rank holds one
    # stage here, and its stage work is F + B less the exposed communication.
    m = layout.num_microbatches(ClusterSpec.local(_cpu_profile(1.0), 8))
    work = sum(m * c.work for c in tight.stage_costs) / 2
    p2p = sum(m * c.p2p_ops for c in tight.stage_costs) / 2 * 150e-6
    from overlap.plan.memory import rank_params

    buckets = max(math.ceil(4 * rank_params(model, layout, r) / layout.bucket_bytes)
                  for r in range(2))
    dp_ops = buckets * 2  # reduce-scatter + all-gather per bucket (ZeRO-1), dp = 2: one step
    want = 8 * (work + p2p + dp_ops * 1 * 200e-6 + tight.optimizer_s)
    assert tight.cpu_work_s == pytest.approx(want)


def test_train_config_mapping():
    from overlap.train.config import parse_args

    model, layout = plan_inputs(parse_args([]))
    assert (model.num_layers, model.hidden, model.num_heads, model.vocab, model.seq_len) == \
        (4, 64, 4, 256, 64)
    assert not model.tied_embeddings and not model.dropout
    assert (layout.tp, layout.pp, layout.global_batch, layout.micro_batch) == (2, 2, 32, 4)
    assert layout.sequence_parallel and layout.zero == 1 and layout.dtype_bytes == 4
    for conf in CONFIGS:
        cfg = parse_args(list(conf))
        _, lay = plan_inputs(cfg)
        assert lay.tp * lay.pp * (cfg.world_size // (lay.tp * lay.pp)) == 8


def test_profile_json_roundtrip(tmp_path):
    p = _cpu_profile(1.5)
    path = tmp_path / "p.json"
    path.write_text(p.to_json())
    back = DeviceProfile.load(str(path))
    assert back == p
    a100 = DeviceProfile.from_dict(dataclasses.asdict(A100))
    assert a100 == A100
    with pytest.raises(ValueError, match="--profile"):
        DeviceProfile.load(str(tmp_path / "missing.json"))


def test_layout_errors_name_flags():
    c = ClusterSpec(device=A100, num_gpus=64)
    m = ModelSpec(num_layers=8, hidden=512, num_heads=8, vocab=1024, seq_len=128)
    with pytest.raises(ValueError, match="--cp 3 does not divide --seq 128"):
        Layout(cp=3, tp=1, global_batch=64).check(m, ClusterSpec(device=A100, num_gpus=3))
    with pytest.raises(ValueError, match="fewer than --pp 8"):
        Layout(pp=8, global_batch=8).check(m, c)


def test_interleaved_with_uneven_chunks():
    """Layers that do not split into pp x virtual equal chunks (Llama 3 405B: 126 layers, pp 16)
    are spread as evenly as possible, the earlier chunks one layer more (the last holds the
    head); the work is the same as 1F1B's, only redistributed, and the bubble shrinks."""
    c = ClusterSpec(device=A100, num_gpus=16)
    m = ModelSpec(num_layers=10, hidden=1024, num_heads=16, vocab=4096, seq_len=1024)
    inter = Layout(pp=2, tp=2, schedule="interleaved", virtual=3, global_batch=32,
                   sequence_parallel=True)
    assert inter.chunk_layers(m) == [2, 2, 2, 2, 1, 1]
    one = dataclasses.replace(inter, schedule="1f1b", virtual=1)
    a, b = estimate(m, c, inter), estimate(m, c, one)
    assert len(a.stage_costs) == 6 and len(b.stage_costs) == 2
    total = sum(s.fwd_flops for s in b.stage_costs)
    assert sum(s.fwd_flops for s in a.stage_costs) == pytest.approx(total, rel=1e-12)
    # Chunks 1-3 hold two layers and chunk 4 one, none the embedding or the head: the
    # difference is one layer's forward FLOPs.
    per_layer = (a.stage_costs[1].fwd_flops - a.stage_costs[4].fwd_flops)
    assert per_layer == pytest.approx(a.stage_costs[4].fwd_flops, rel=1e-12)
    assert a.bubble_fraction < b.bubble_fraction
