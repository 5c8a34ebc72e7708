"""Main-job training features on 8 local processes (tp2 x pp2 x dp2), against references:
global-norm clipping vs torch.nn.utils.clip_grad_norm_ on one process, activation
recomputation vs the no-recompute run (bitwise: recomputation replays the same ops), dropout
with tp > 1. Plus the RNG tracker's contract on one process. The clipping and recomputation
runs share one launch of the 8 ranks (``train_rank`` per configuration); the dropout run goes
through the CLI and its ``--check``."""

import os
import subprocess
import sys

import pytest
import torch

from harness import run_ranks
from overlap.train.config import parse_args

pytestmark = [
    pytest.mark.no_delay_pass("end to end; component files run its async paths delayed"),
    pytest.mark.no_numerics_pass("end to end; the model and op files run its numerics"),
]

TINY = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "2", "--timeout", "240"]


def _run(args):
    res = subprocess.run([sys.executable, "-m", "overlap.train", *TINY, *args],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _train_each(runs):
    """``train_rank`` of each argument list in turn on the same 8 ranks (one launch, not one
    per run: the rank start-up costs more than 3 tiny steps); the per-step records."""
    from overlap.train.loop import train_rank

    return [train_rank(parse_args(TINY + args), progress=False)["records"] for args in runs]


CLIP = ["--clip-grad", "0.5", "--weight-decay", "0.1", "--lr-schedule", "cosine"]
RUNS = {
    "clip/sharded": [*CLIP, "--sharded-optimizer"],
    "clip/unsharded": [*CLIP, "--no-sharded-optimizer"],
    "zb-h1": ["--schedule", "zb-h1"],
    "zb-h1/full": ["--recompute", "full", "--schedule", "zb-h1"],
    "zb-h1/selective": ["--recompute", "selective", "--schedule", "zb-h1"],
    "zb-h1/full/no-sp": ["--recompute", "full", "--schedule", "zb-h1", "--no-sequence-parallel"],
}


@pytest.fixture(scope="module")
def records():
    runs = list(RUNS.values())
    return dict(zip(RUNS, run_ranks(_train_each, 8, runs, timeout=400)[0]))


@pytest.mark.parametrize("name", ["clip/sharded", "clip/unsharded"])
def test_clip_grad_equals_single_process(records, name):
    from overlap.train.loop import reference_model

    cfg = parse_args(TINY + RUNS[name])
    ref_norms: list[float] = []
    _, ref_losses = reference_model(cfg, norms=ref_norms)
    recs = records[name]
    # the losses, as --check compares them
    assert max(abs(r["loss"] - x) for r, x in zip(recs, ref_losses)) <= cfg.check_tolerance
    assert all(n > 0.5 for n in ref_norms)  # clipping active on every step
    # the global norm over every TP/PP/DP shard, each element once, as clip_grad_norm_'s
    norms = [r["grad_norm"] for r in recs]
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)


def test_recompute_equals_no_recompute(records):
    base = [r["loss"] for r in records["zb-h1"]]
    assert len(base) == 3
    for name in ("zb-h1/full", "zb-h1/selective", "zb-h1/full/no-sp"):
        assert [r["loss"] for r in records[name]] == base, name  # bitwise


def test_dropout_with_tp_and_check():
    out = _run(["--dropout", "0.1", "--recompute", "full", "--check"])
    assert "with dropout 0.1 (its own masks)" in out and "PASS" in out


def test_rng_tracker_regions_and_state():
    from overlap.train.rng import RNGTracker, TrackedDropout

    x = torch.ones(64, 64)
    masks = {}
    for tp_rank in (0, 1):
        tr = RNGTracker(seed=3, tp_rank=tp_rank, pp_rank=0, dp_rank=0)
        rep = TrackedDropout(0.5, tr, sharded=False)
        shard = TrackedDropout(0.5, tr, sharded=True)
        masks[tp_rank] = (rep(x), shard(x))
        blob = tr.state()
        after = (rep(x), shard(x))
        tr.load_state(blob)  # a resume draws the same masks again
        again = (rep(x), shard(x))
        assert all(torch.equal(a, b) for a, b in zip(after, again))
    # replicated regions: the same mask on every TP rank; TP-sharded regions: different
    assert torch.equal(masks[0][0], masks[1][0])
    assert not torch.equal(masks[0][1], masks[1][1])
    # other pipeline / data-parallel ranks draw other replicated masks
    other = RNGTracker(seed=3, tp_rank=0, pp_rank=0, dp_rank=1)
    assert not torch.equal(TrackedDropout(0.5, other, sharded=False)(x), masks[0][0])
