"""Main-job training features on 8 local processes (tp2 x pp2 x dp2), against references:
global-norm clipping vs torch.nn.utils.clip_grad_norm_ on one process, activation
recomputation vs the no-recompute run (bitwise: recomputation replays the same ops), dropout
with tp > 1. Plus the RNG tracker's contract on one process."""

import os
import re
import subprocess
import sys

import pytest
import torch

from overlap.train.config import parse_args

TINY = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "2", "--timeout", "240"]


def _run(args):
    res = subprocess.run([sys.executable, "-m", "overlap.train", *TINY, *args],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _rows(out):
    return re.findall(r"^step +\d+/\d+ .* loss +([\d.]+) .*?(?:grad norm ([\d.e+-]+))?$", out,
                      re.M)


@pytest.mark.parametrize("sharded", ["--sharded-optimizer", "--no-sharded-optimizer"])
def test_clip_grad_equals_single_process(sharded):
    from overlap.train.loop import reference_model

    args = ["--clip-grad", "0.5", "--weight-decay", "0.1", "--lr-schedule", "cosine", sharded]
    out = _run([*args, "--check"])
    assert "PASS" in out
    norms = [float(n) for _, n in _rows(out)]
    ref_norms: list[float] = []
    reference_model(parse_args(TINY + args), norms=ref_norms)
    assert all(n > 0.5 for n in ref_norms)  # clipping active on every step
    # the global norm over every TP/PP/DP shard, each element once, as clip_grad_norm_'s
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)


def test_recompute_equals_no_recompute():
    base = [loss for loss, _ in _rows(_run(["--schedule", "zb-h1"]))]
    for extra in (["--recompute", "full", "--schedule", "zb-h1"],
                  ["--recompute", "selective", "--schedule", "zb-h1"],
                  ["--recompute", "full", "--schedule", "zb-h1", "--no-sequence-parallel"]):
        got = [loss for loss, _ in _rows(_run(extra))]
        assert got == base, extra


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
