"""overlap-plan: --json keys and values, --search (GPT-3 175B on 512 A100-80GB: only layouts
that fit), --explain, errors that name the flag, the console script, profiles and sources."""

import json
import tomllib
from pathlib import Path

import pytest

from overlap.plan import ClusterSpec, Layout, get_model, get_profile, search
from overlap.plan.cli import main
from overlap.plan.estimate import GIB, estimate
from overlap.plan.profiles import PROFILES

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

EXAMPLE = ["--model", "gpt3-175b", "--gpus", "512", "--gpu", "a100-80g", "--tp", "8", "--pp",
           "8", "--global-batch", "1536", "--micro-batch", "1"]
ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_keys_and_values(capsys):
    code, out, _ = run_cli(capsys, EXAMPLE + ["--json"])
    assert code == 0
    d = json.loads(out)
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "hfu",
                "bubble_fraction", "exposed_comm_s"):
        assert isinstance(d[key], float) and d[key] > 0
    assert set(d["memory_gib"]) >= {"weights", "grads", "optimizer", "activations", "total"}
    assert set(d["comm_s"]) == {"tp", "pp", "dp"}
    est = estimate(get_model("gpt3-175b"), ClusterSpec(device=get_profile("a100-80g"),
                                                       num_gpus=512),
                   Layout(tp=8, pp=8, global_batch=1536, micro_batch=1))
    assert d["step_time_s"] == pytest.approx(est.step_time_s)
    # The derived numbers agree with each other.
    assert d["tokens_per_s"] == pytest.approx(1536 * 2048 / d["step_time_s"])
    flops = 1536 * get_model("gpt3-175b").model_flops_per_sequence()
    assert d["model_tflops_per_gpu"] == pytest.approx(flops / d["step_time_s"] / 512 / 1e12)
    assert d["mfu"] == pytest.approx(d["model_tflops_per_gpu"] / 312)
    mem = d["memory_gib"]
    assert mem["total"] == pytest.approx(mem["weights"] + mem["grads"] + mem["optimizer"]
                                         + mem["activations"])
    # First pp rank (the fullest): 12 layers + the embedding in bf16.
    assert mem["weights"] * GIB / 1e9 == pytest.approx(5.65, abs=0.01)
    assert d["layout"]["dp"] == 8 and d["layout"]["num_microbatches"] == 192
    assert d["fits"] is True


def test_overlap_beats_no_overlap(capsys):
    on = json.loads(run_cli(capsys, EXAMPLE + ["--json"])[1])
    off = json.loads(run_cli(capsys, EXAMPLE + ["--json", "--no-overlap"])[1])
    assert on["exposed_comm_s"] < off["exposed_comm_s"]
    assert on["step_time_s"] < off["step_time_s"]
    assert off["exposed_s"]["tp"] == pytest.approx(off["comm_s"]["tp"])


def test_search_returns_only_layouts_that_fit():
    model = get_model("gpt3-175b")
    cluster = ClusterSpec(device=get_profile("a100-80g"), num_gpus=512)
    res = search(model, cluster, 1536)
    cap = 0.9 * cluster.device.hbm_bytes
    assert res.ranked, "some layout must fit"
    assert all(e.peak_memory.total <= cap for e in res.ranked)
    assert all(e.fits(0.9) for e in res.ranked)
    steps = [e.step_time_s for e in res.ranked]
    assert steps == sorted(steps)
    mem_rejects = [(lay, why) for lay, why in res.rejected if why.startswith("memory")]
    assert mem_rejects, "tp=1/pp=1 cannot hold 175B"
    for lay, why in mem_rejects[:20]:
        assert "GiB" in why
        assert estimate(model, cluster, lay).peak_memory.total > cap
    # tp1 x pp1 x dp512 needs the whole model per GPU: rejected.
    assert not any(e.layout.tp == 1 and e.layout.pp == 1 for e in res.ranked)
    # The search's best is no slower than the hand-picked example layout.
    example = estimate(model, cluster, Layout(tp=8, pp=8, global_batch=1536, micro_batch=1,
                                              sequence_parallel=True))
    assert res.ranked[0].step_time_s <= example.step_time_s


def test_search_cli_table(capsys):
    code, out, _ = run_cli(capsys, ["--model", "gpt3-175b", "--gpus", "512", "--global-batch",
                                    "1536", "--search", "--top", "5"])
    assert code == 0
    assert "layouts fit" in out and "rejected" in out
    assert len([ln for ln in out.splitlines() if ln.strip()[:2] in {"1 ", "2 ", "3 "}]) >= 3


def test_explain_substitutes_numbers(capsys):
    code, out, _ = run_cli(capsys, EXAMPLE + ["--explain"])
    assert code == 0
    assert "(p-1)/(m+p-1)" in out and "12 x P / 8" in out
    assert "m = B/(dp*b) = 1536/(8*1) = 192" in out
    est = estimate(get_model("gpt3-175b"), ClusterSpec(device=get_profile("a100-80g"),
                                                       num_gpus=512),
                   Layout(tp=8, pp=8, global_batch=1536, micro_batch=1))
    assert f"{100 * est.mfu:.1f}%" in out


@pytest.mark.parametrize("argv,needle", [
    (["--tp", "64"], "--tp 64 does not divide --heads 96"),
    (["--tp", "8", "--pp", "3"], "--gpus 512 is not divisible by --tp 8 x --pp 3"),
    (["--tp", "8", "--pp", "8", "--micro-batch", "5"], "--global-batch 1536 is not divisible"),
    (["--tp", "8", "--pp", "8", "--virtual", "2"], "--virtual 2 needs --schedule interleaved"),
])
def test_bad_flags_are_named(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "gpt3-175b", "--gpus", "512", "--global-batch", "1536", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_unknown_model_and_gpu(capsys):
    for argv in (["--model", "gpt5"], ["--model", "gpt3-175b", "--gpu", "b300"]):
        with pytest.raises(SystemExit) as exc:
            main(argv + ["--gpus", "8", "--global-batch", "8"])
        assert exc.value.code == 2
        assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--gpus", "8", "--global-batch", "8", "--layers", "2"])
    assert "missing --hidden --heads --vocab --seq" in capsys.readouterr().err


def test_console_script_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["overlap-plan"] == "overlap.plan.cli:main"


def test_profiles_cite_every_number():
    need = {"peak_flops", "hbm_bytes", "hbm_bandwidth", "mem_efficiency", "gemm",
            "intra.bandwidth", "inter.bandwidth", "intra.latency_s", "inter.latency_s",
            "base_latency_s", "intra.efficiency", "inter.efficiency"}
    assert set(PROFILES) == {"a100-40g", "a100-80g", "h100-sxm", "h200"}
    for name, p in PROFILES.items():
        assert need <= set(p.sources), name
        assert all(len(p.sources[k]) > 20 for k in need)
    assert PROFILES["a100-80g"].peak_flops == 312e12
    assert PROFILES["h100-sxm"].peak_flops == 989e12 == PROFILES["h200"].peak_flops
    assert PROFILES["h200"].hbm_bandwidth == 4.8e12
