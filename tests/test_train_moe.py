"""The main job with MoE blocks on 8 local processes: tp2 x pp2 x dp2 with ep2 (4 axes), every
schedule, dropless and capacity mode, checked against one process (the same seed, data and
optimizer) on the NCCL-ordering twin; the dispatch/combine ranges in --profile; bad MoE flags
refused before any process starts. Tolerance: --check's per-step loss tolerance (2e-3; the
runs differ in summation order only and measure ~1e-6)."""

import json

import pytest

from train_cli import check_diffs, run_train

pytestmark = [
    pytest.mark.no_delay_pass("end to end; component files run its async paths delayed"),
    pytest.mark.no_numerics_pass("end to end; the model and op files run its numerics"),
]

TINY = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "2", "--timeout", "240",
        "--ep", "2", "--moe-experts", "4"]


_run, _diffs = run_train, check_diffs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
@pytest.mark.parametrize("mode", [[], ["--capacity-factor", "1.0"]])
def test_four_axes_check_passes_for_every_schedule(schedule, mode):
    args = [*TINY, "--check", "--schedule", schedule, *mode]
    if schedule == "interleaved":
        args[args.index("--n-layer") + 1] = "4"  # pp x virtual stages = 4 chunks
    res = _run(args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    diffs = _diffs(res.stdout)
    assert len(diffs) == 3 and max(diffs) <= 2e-3, res.stdout
    assert "tp=2 x pp=2 x dp=2 (8 ranks)" in res.stdout
    assert "4 per MoE block" in res.stdout and "ep=2 (chunked" in res.stdout
    assert ("capacity factor 1" if mode else "dropless") in res.stdout


def test_symmetric_exchange_shared_experts_and_profile(tmp_path):
    """The symmetric backend with a shared expert and every other block MoE; --profile shows
    the exchange's ranges in every rank's trace."""
    prof = tmp_path / "prof"
    res = _run([*TINY, "--check", "--ep-backend", "symmetric", "--moe-shared-experts", "1",
                "--moe-every", "2", "--n-layer", "4", "--profile", str(prof)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert max(_diffs(res.stdout)) <= 2e-3, res.stdout
    names = set()
    for r in range(8):
        trace = json.loads((prof / f"trace_rank{r}.json").read_text())
        names |= {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("moe.symmetric.gemm[") for n in names), sorted(names)[:50]
    assert any(n.startswith("moe.symmetric.comm[moe_dispatch.send") for n in names)


@pytest.mark.parametrize("args, message", [
    (["--ep", "2"], "--ep 2 shards the experts of MoE blocks: pass --moe-experts N too"),
    (["--ep", "2", "--moe-experts", "3"], "--moe-experts 3 is not divisible by --ep 2"),
    (["--ep", "4", "--moe-experts", "4"], "ep=4 must divide dp*cp = 2*1 = 2"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5 is larger than --moe-experts 4"),
    (["--moe-experts", "4", "--capacity-factor", "-1"], "--capacity-factor must be a finite"),
    (["--moe-experts", "4", "--dtype", "bf16"], "--moe-experts with --dtype bf16 is not built"),
])
def test_bad_moe_flags_fail_fast_with_one_line(args, message):
    res = _run(args, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("overlap-train: error: "), res.stderr
    assert message in lines[0], lines[0]
    assert "step" not in res.stdout


CLIP_RUNS = {
    "ep2 sharded": ["--clip-grad", "0.5"],
    "edp2 unsharded": ["--clip-grad", "0.5", "--dp", "4", "--pp", "1",
                       "--no-sharded-optimizer", "--capacity-factor", "1.0"],
}


def _train_each(runs):
    from overlap.train.config import parse_args
    from overlap.train.loop import train_rank

    return [train_rank(parse_args(TINY + args), progress=False)["records"] for args in runs]


def test_clip_grad_counts_every_expert_once():
    """The global gradient norm with experts sharded over EP (and, at dp 4, replicated over
    the expert-DP group) equals torch.nn.utils.clip_grad_norm_'s on one process, and so do the
    losses after clipping on every step."""
    import torch

    from harness import run_ranks
    from overlap.train.config import parse_args
    from overlap.train.loop import reference_model

    got = run_ranks(_train_each, 8, list(CLIP_RUNS.values()), timeout=400)[0]
    for name, recs in zip(CLIP_RUNS, got):
        cfg = parse_args(TINY + CLIP_RUNS[name])
        ref_norms: list[float] = []
        _, ref_losses = reference_model(cfg, norms=ref_norms)
        assert all(n > 0.5 for n in ref_norms), (name, ref_norms)  # clipping active
        assert max(abs(r["loss"] - x) for r, x in zip(recs, ref_losses)) <= 2e-3, name
        torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in recs]),
                                   torch.tensor(ref_norms), rtol=1e-5, atol=0, msg=name)
