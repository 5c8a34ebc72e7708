"""The main job with context parallelism, run as users run it (``python -m overlap.train``):
cp x tp x dp, pp x cp x tp with every schedule, five axes with MoE experts over dp x cp, cp 4,
each checked against one process (the same seed, data and optimizer) on the NCCL-ordering
twin; bad CP flags refused before any process starts.

Tolerance: --check's per-step loss tolerance (2e-3, docs/design/training.md). A CP job differs
from one process in summation order only (ring attention merges per-block partial softmaxes by
log-sum-exp; dense gradients are averaged over dp x cp instead of summed in one process), so
the dense runs measure ~1e-6. The MoE run uses --check's MoE rule (1% of the loss): a router
near-tie may send a token to another expert.
"""

import re

import pytest

from train_cli import check_diffs, run_train, step_losses

pytestmark = [
    pytest.mark.no_delay_pass("end to end; component files run its async paths delayed"),
    pytest.mark.no_numerics_pass("end to end; the model and op files run its numerics"),
]

TINY = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "2", "--timeout", "240"]


def _passes(args, layout: str, steps: int = 3):
    res = run_train([*TINY, "--check", *args])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    diffs = check_diffs(res.stdout)
    assert len(diffs) == steps and max(diffs) <= 2e-3, res.stdout
    assert layout in res.stdout, res.stdout
    return res.stdout


def test_cp_tp_dp_check_with_clipping():
    """cp2 x tp2 x dp2 (the issue's command): positions, loss shares and the dense gradient
    reduction over dp x cp; clipping counts each element of the dp x cp replicas once (a norm
    counted on both CP ranks would be sqrt(2) too large and change every step)."""
    out = _passes(["--cp", "2", "--tp", "2", "--dp", "2", "--pp", "1", "--clip-grad", "0.05"],
                  "tp=2 x cp=2 x pp=1 x dp=2 (8 ranks)")
    assert "ring attention over cp" in out


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1"])
def test_pp_cp_tp_check_for_schedules(schedule):
    args = ["--cp", "2", "--tp", "2", "--pp", "2", "--dp", "1", "--schedule", schedule]
    if schedule == "interleaved":
        args = [*args, "--n-layer", "4"]  # pp x virtual stages = 4 chunks
    _passes(args, "tp=2 x cp=2 x pp=2 x dp=1 (8 ranks)")


def test_five_axes_moe_experts_over_dp_and_cp():
    """tp2 x cp2 x pp2 with ep2: the experts split over the CP ranks (ep is carved out of
    dp x cp), the router sees each rank's zig-zag tokens in tp groups; one process routes the
    same groups (GPTConfig.moe_token_zigzag)."""
    _passes(["--cp", "2", "--tp", "2", "--pp", "2", "--dp", "1", "--ep", "2",
             "--moe-experts", "4"], "tp=2 x cp=2 x pp=2 x dp=1 (8 ranks)")


def test_cp4_without_sequence_parallelism_and_selective_recompute():
    """cp 4 on one TP rank: 8 zig-zag chunks of 2 tokens; the recomputed attention core runs
    the chosen method again in the backward; --cp-method auto measures the three methods on
    the first call and reports its choice."""
    out = _passes(["--cp", "4", "--tp", "1", "--pp", "1", "--dp", "1", "--no-sequence-parallel",
                   "--recompute", "selective", "--cp-method", "auto"],
                  "tp=1 x cp=4 x pp=1 x dp=1 (4 ranks)")
    chose = re.search(r"auto chose (\w+) for \(b, h, h_kv, s_local, d\) = \(2, 4, 4, 4, 8\) .*"
                      r"ring [\d.]+ ms, allgather [\d.]+ ms, ulysses [\d.]+ ms", out)
    assert chose and chose.group(1) in ("ring", "allgather", "ulysses"), out


@pytest.mark.parametrize("args, message", [
    (["--cp", "3", "--tp", "1", "--pp", "1", "--dp", "1", "--seq-len", "16"],
     r"--cp 3 splits each sequence into 2 x cp = 6 zig-zag chunks: --seq-len 16 must be "
     r"divisible by it"),
    (["--cp", "2", "--tp", "1", "--pp", "1", "--dp", "1", "--dropout", "0.1"],
     r"--dropout 0.1 with --cp 2: context-parallel attention has no attention dropout"),
    (["--cp", "4", "--tp", "2", "--pp", "1", "--dp", "1", "--cp-method", "ulysses"],
     r"the 2 heads per tensor-parallel rank \(--n-head 4 / --tp 2\) must be divisible by cp"),
    (["--cp", "2", "--tp", "4", "--pp", "1", "--dp", "1", "--seq-len", "12"],
     r"must be divisible by cp x tp = 8"),
    (["--cp", "0"], r"--cp must be a positive integer, got 0"),
])
def test_bad_cp_flags_fail_fast_with_one_line(args, message):
    res = run_train([*TINY, *args], timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert re.search(message, res.stderr), res.stderr
    assert "Traceback" not in res.stderr


def test_cp_checkpoint_resumes_without_cp(tmp_path):
    """A cp2 run's checkpoint (ZeRO shards over dp x cp) resumes on one process: the next
    steps' losses equal the uninterrupted cp2 run's (the printed 4 decimals; the runs differ
    in summation order only)."""
    one = ["--tp", "1", "--pp", "1", "--dp", "1"]
    a = run_train([*TINY, *one, "--cp", "2", "--steps", "4", "--save", str(tmp_path / "a"),
              "--save-every", "2"])
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    b = run_train([*TINY, *one, "--cp", "1", "--steps", "4", "--resume",
              str(tmp_path / "a" / "step_2")])
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    la, lb = step_losses(a.stdout), step_losses(b.stdout)
    assert sorted(lb) == [3, 4], b.stdout
    assert all(abs(float(lb[s]) - float(la[s])) <= 1e-4 for s in lb), (la, lb)
