"""overlap-plan's activation offloading, pinned by hand: the copy timelines (copies to host under
the later blocks' forward, reloads one block ahead), the exposed seconds per step against the
model's layer times, device memory = the kept blocks of every live pair + one block of pending
copies + the reload in flight, pinned host memory per GPU and per node, --search finding layouts
that fit only with offloading (and never choosing it over a slow host link), and the CLI's
fields and errors."""

import dataclasses
import json

import pytest

from overlap.plan import ClusterSpec, Layout, LinkSpec, get_model, get_profile, search
from overlap.plan.bubble import live_pairs, peak_live
from overlap.plan.cli import main
from overlap.plan.compute import LayerContext
from overlap.plan.estimate import GIB, estimate
from overlap.plan.memory import layer_activation_bytes, memory_per_rank
from overlap.plan.offload import chunk_offload, layer_offload_bytes, node_host_bytes
from overlap.plan.profiles import PCIE_GEN4_X16, PCIE_GEN5_X16
from overlap.plan.search import Constraints
from overlap.pp import build_schedule

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

H100 = get_profile("h100-sxm")
S = 131072
# Llama-3-8B, selective recomputation, sequence-parallel tp 8: a block saves 139264 bytes per
# token at tp 1 (test_plan_cp.py derives it), 1/8 of them here: 2.125 GiB at 128K tokens. With
# full recomputation it saves its input, 2 bytes x h per token over tp.
A_SEL = 139264 * S // 8
A_FULL = 2 * 4096 * S // 8


def llama8b(seq: int = S):
    return dataclasses.replace(get_model("llama3-8b"), seq_len=seq)


def host(bandwidth: float):
    """An H100 whose host link moves ``bandwidth`` bytes/s each way."""
    return H100.replace(host_link=LinkSpec(bandwidth=bandwidth, latency_s=0.0))


def tp8(**kw) -> Layout:
    return Layout(tp=8, sequence_parallel=True, **{"global_batch": 8, **kw})


def test_timelines_by_hand():
    # Four blocks of 1 byte, forward 1 s and backward 2 s each, copies of 0.5 s: each copy hides
    # under the next block's forward, the last one under the backward that follows; with every
    # block offloaded the first reload has nothing to hide under.
    o = chunk_offload(4, [1.0] * 4, [1.0] * 4, [2.0] * 4, bandwidth=2.0, after=8.0)
    assert (o.copy_s, o.exposed_f, o.exposed_b) == (2.0, 0.0, 0.5)
    assert (o.kept_bytes, o.host_bytes, o.staging_bytes, o.inflight_bytes) == (0, 4, 1, 2)
    o = chunk_offload(3, [1.0] * 4, [1.0] * 4, [2.0] * 4, bandwidth=2.0, after=8.0)
    assert (o.exposed_f, o.exposed_b, o.kept_bytes, o.inflight_bytes) == (0.0, 0.0, 1, 1)
    # Copies of 3 s: they queue on the one d2h stream, D = 4, 7, 10, 13 against a forward that
    # ends at 4; the backward (8 s) hides 8 of the 9 s tail. Three copies are pending at the
    # ends of blocks 2 and 3. Reloads: 3 s under 2 s of backward, the first under nothing.
    o = chunk_offload(4, [1.0] * 4, [1.0] * 4, [2.0] * 4, bandwidth=1 / 3, after=8.0)
    assert o.exposed_f == pytest.approx(1.0) and o.exposed_b == pytest.approx(3 + 3 * 1)
    assert o.staging_bytes == 3
    assert chunk_offload(0, [1.0] * 4, [1.0] * 4, [2.0] * 4, 2.0, 8.0).copy_s == 0.0


def _layer_times(model, cluster, layout):
    dense, _ = LayerContext(model, cluster, layout, None).layers("ring")
    return dense.fwd, dense.dgrad + dense.recompute + dense.wgrad


@pytest.mark.parametrize("bandwidth", [PCIE_GEN4_X16 * 0.8, 10e9])
def test_exposed_seconds_against_the_layer_times(bandwidth):
    # One pipeline stage of 32 blocks, 8 micro-batches, every copy slower than a block's
    # forward, so the copies queue: the last of n ends at f + n c, against 32 f of forward.
    model = llama8b()
    cluster = ClusterSpec(device=host(bandwidth), num_gpus=8)
    assert layer_offload_bytes(model, tp8()) == A_SEL
    f, b = _layer_times(model, cluster, tp8())
    c = A_SEL / bandwidth
    assert f < c  # ~60 ms of forward, 91 ms (PCIe Gen4) or 228 ms (10 GB/s) of copy
    none = estimate(model, cluster, tp8())
    for mode, n in (("all", 32), ("31", 31)):
        e = estimate(model, cluster, tp8(offload=mode))
        exp_f = max(0.0, f + n * c - 32 * f - 32 * b)
        exp_b = (c if n == 32 else max(0.0, c - b)) + (n - 1) * max(0.0, c - b)
        assert e.comm_s["offload"] == pytest.approx(8 * 2 * n * c)
        assert e.exposed_s["offload"] == pytest.approx(8 * (exp_f + exp_b))
        # A single stage replays its micro-batches back to back: the step grows by exactly that.
        assert e.step_time_s - none.step_time_s == pytest.approx(8 * (exp_f + exp_b), rel=1e-6)
        assert e.offload_bytes_per_step == 8 * n * A_SEL
    if bandwidth < 20e9:
        assert exp_f > 0 and c > b
    else:  # PCIe Gen4: the reloads hide under the backward, only "all"'s first one shows
        assert c < b
        assert estimate(model, cluster, tp8(offload="31")).step_time_s == none.step_time_s


def test_device_memory_is_the_kept_fraction_plus_one_block_in_flight():
    # A host link fast enough (GH200's NVLink-C2C, 450 GB/s) that every copy keeps pace with the
    # forward: one block is pending at a time.
    model = llama8b()
    cluster = ClusterSpec(device=host(450e9), num_gpus=16)
    for pp, sched in ((1, "1f1b"), (2, "1f1b"), (2, "zb-h1")):
        lay = tp8(pp=pp, schedule=sched)
        base = memory_per_rank(model, lay, cluster)
        live = peak_live(sched, pp, 8 // (16 // (8 * pp)))[0]
        blocks = 32 // pp
        assert live == pp
        for n in (blocks, blocks - 1, blocks // 4):
            mem = memory_per_rank(model, dataclasses.replace(lay, offload=str(n)), cluster)[0]
            k = blocks - n
            inflight = 2 if k == 0 else 1
            if sched == "zb-h1":  # one pair between its I and W holds all its blocks again
                kept = max(live * k, (live - 1) * k + blocks)
            else:
                kept = live * k
            want = base[0].activations - live * blocks * A_SEL + (kept + 1 + inflight) * A_SEL
            assert mem.activations == want, (pp, sched, n)
            assert mem.host_bytes == live * n * A_SEL
            assert (mem.weights, mem.optimizer) == (base[0].weights, base[0].optimizer)
    # Full recomputation offloads each block's input; the block being recomputed stays.
    lay = tp8(recompute="full")
    assert layer_offload_bytes(model, lay) == A_FULL == layer_activation_bytes(model, lay)
    full = memory_per_rank(model, lay, cluster)[0]
    off = memory_per_rank(model, dataclasses.replace(lay, offload="all"), cluster)[0]
    assert full.activations - off.activations == (32 - 1 - 2) * A_FULL
    assert off.host_bytes == 32 * A_FULL


def test_live_pairs_and_the_gpipe_peak():
    for name, p, m, v in (("gpipe", 2, 12, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2),
                          ("zb-h1", 4, 8, 1), ("zb-h1", 3, 20, 1)):
        sched = build_schedule({"gpipe": "gpipe", "1f1b": "1f1b", "interleaved":
                                "interleaved_1f1b", "zb-h1": "zb_h1"}[name], pp_size=p,
                               num_microbatches=m, num_virtual=v)
        peaks = list(sched.peak_live_activations)
        assert peak_live(name, p, m, v) == peaks
        assert [max(a + b for a, b in r) for r in live_pairs(name, p, m, v)] == peaks
    # GPipe runs every forward first: its peak is m, past the 4p warm-up the others need.
    assert peak_live("gpipe", 2, 12) == [12, 12]
    # ZB-H1: a rank passes through states with one pair past its I pass.
    assert live_pairs("zb-h1", 4, 8)[0] == ((3, 1), (4, 0))


def test_pinned_host_memory_per_node():
    cluster = ClusterSpec(device=H100, num_gpus=64)
    per_rank = [8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # tp 1 x pp 8: a node of 8 GPUs holds one GPU of every pp rank.
    assert node_host_bytes(Layout(pp=8, global_batch=64), cluster, per_rank) == 19.0
    # tp 8: a node is one pp rank's tensor-parallel group; the first is the fullest.
    assert node_host_bytes(Layout(tp=8, pp=8, global_batch=64), cluster, per_rank) == 64.0
    assert node_host_bytes(Layout(tp=4, pp=2, global_batch=64), cluster, [3.0, 1.0]) == 16.0
    e = estimate(llama8b(), ClusterSpec(device=H100, num_gpus=16), tp8(pp=2, offload="all"))
    assert e.host_node_bytes == 8 * max(s.host_bytes for s in e.memory)
    assert e.host_capacity == 2e12 and e.host_fits()
    tiny = H100.replace(host_bytes_per_gpu=1e9)
    e = estimate(llama8b(), ClusterSpec(device=tiny, num_gpus=16), tp8(pp=2, offload="all"))
    assert not e.host_fits() and not e.fits()


def test_search_finds_layouts_that_fit_only_with_offloading():
    # 640K tokens of Llama-3-8B on one node without CP: even full recomputation keeps 20 GiB of
    # block inputs next to 40 GiB of fp32 logits; offloading the inputs is the only fit.
    model, cluster = llama8b(655360), ClusterSpec(device=H100, num_gpus=8)
    assert not search(model, cluster, 8, Constraints(cp=(1,))).ranked
    res = search(model, cluster, 8, Constraints(cp=(1,), offload=None))
    assert res.ranked and all(e.layout.offload != "none" for e in res.ranked)
    assert all(e.layout.recompute == "full" and e.fits() for e in res.ranked)
    # 128K on 16 GPUs: without offloading only full recomputation fits; selective
    # recomputation with offloading fits too and is faster, since its copies hide.
    model, cluster = llama8b(), ClusterSpec(device=H100, num_gpus=16)
    plain = search(model, cluster, 16, Constraints(cp=(1,)))
    assert {e.layout.recompute for e in plain.ranked} == {"full"}
    res = search(model, cluster, 16, Constraints(cp=(1,), offload=None))
    best = res.ranked[0]
    assert best.layout.recompute == "selective" and best.layout.offload != "none"
    assert best.step_time_s < 0.9 * plain.ranked[0].step_time_s
    assert best.exposed_s["offload"] < 0.01 * best.comm_s["offload"]
    # The same layouts over a 1 MB/s host link: offloading is never chosen.
    slow = search(model, ClusterSpec(device=host(1e6), num_gpus=16), 16,
                  Constraints(cp=(1,), offload=None))
    assert slow.ranked[0].layout.offload == "none"
    assert slow.ranked[0].step_time_s == plain.ranked[0].step_time_s
    assert all(e.step_time_s > 10 * plain.ranked[0].step_time_s for e in slow.ranked
               if e.layout.offload != "none")


ARGS = ["--model", "llama3-8b", "--seq", str(S), "--gpus", "8", "--gpu", "h100-sxm",
        "--global-batch", "8", "--tp", "8", "--sequence-parallel"]


def test_cli_json_text_and_explain(capsys):
    assert main(ARGS + ["--offload-activations", "31", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    o = d["offload"]
    assert d["layout"]["offload"] == o["mode"] == "31" and d["fits"] is True
    assert (o["blocks_per_chunk"], o["layers_per_chunk"]) == ([31], [32])
    assert o["host_link_gb_s"] == pytest.approx(PCIE_GEN5_X16 * 0.8 / 1e9)
    assert o["bytes_to_host_per_step"] == 8 * 31 * A_SEL
    assert o["host_gib_per_gpu"] == d["memory_gib"]["host_pinned"] == 31 * A_SEL / GIB
    assert o["host_gib_per_node"] == 8 * o["host_gib_per_gpu"]
    assert o["host_capacity_gib_per_node"] == pytest.approx(2e12 / GIB)
    assert (o["copy_s"], o["exposed_s"]) == (d["comm_s"]["offload"], d["exposed_s"]["offload"])
    assert o["hidden_fraction"] == 1.0
    assert main(ARGS + ["--offload-activations", "31", "--json", "--host-bandwidth", "10"]) == 0
    slow = json.loads(capsys.readouterr().out)["offload"]
    assert slow["host_link_gb_s"] == 10.0 and slow["exposed_s"] > 0
    assert slow["hidden_fraction"] == pytest.approx(1 - slow["exposed_s"] / slow["copy_s"])
    assert main(ARGS + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "offload" not in d and d["layout"]["offload"] == "none"
    assert main(ARGS + ["--offload-activations", "all"]) == 0
    text = capsys.readouterr().out
    assert "off-all" in text and "offload   all: 32 of 32 blocks per pipeline chunk" in text
    assert main(ARGS + ["--offload-activations", "all", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "## activation offloading (--offload-activations all)" in text
    assert "the first reload hides under nothing" in text


def test_cli_search_and_errors(capsys):
    argv = ["--model", "llama3-8b", "--seq", "655360", "--gpus", "8", "--gpu", "h100-sxm",
            "--global-batch", "8", "--search", "--cp", "1"]
    assert main(argv + ["--json", "--top", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ranked"] and all(r["layout"]["offload"] != "none" for r in d["ranked"])
    assert all("offload" in r and "reason" in r for r in d["rejected"])
    assert main(argv + ["--no-search-offload", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranked"] == []
    assert main(argv + ["--top", "2"]) == 0
    head = next(ln for ln in capsys.readouterr().out.splitlines() if ln.lstrip().startswith("#"))
    assert "offload" in head and "host GiB" in head and "off exp" in head
    for flag, needle in ((["--offload-activations", "0"], "must be none, all or a positive"),
                         (["--offload-activations", "33"], "is more than the 32 layers"),
                         (["--host-bandwidth", "-1", "--offload-activations", "all"],
                          "--host-bandwidth must be > 0")):
        with pytest.raises(SystemExit) as exc:
            main(ARGS + flag)
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    # A profile without a host link (a CPU calibration) cannot offload.
    no_link = ClusterSpec(device=H100.replace(host_link=None), num_gpus=8)
    with pytest.raises(ValueError, match="needs the GPU's host link"):
        estimate(llama8b(), no_link, tp8(offload="all"))
