"""``--dtype bf16`` on the main job (8 local processes, tp2 x pp2 x dp2): bf16 parameters and
activations, fp32 main grads in the reducer, fp32 master weights in the optimizer.

References: the fp32 single-process model (``reference_model``, what ``--check`` prints), the
uninterrupted bf16 run (bitwise, for resume). Margins: every step's loss within
``BF16_CHECK_REL`` = 3% of the fp32 loss over 30 steps of the main job's configuration (with
warm-up, cosine decay and clipping; measured worst step 0.13%, on one process in bf16 1.9%),
the last step within 1%; grad norms of the unsharded path within 2% (bf16 activations; measured
under 0.5%)."""

import os
import re
import subprocess
import sys

import pytest
import torch

from overlap.train.__main__ import BF16_CHECK_REL
from overlap.train.config import parse_args
from test_train_checkpoint import _read

pytestmark = [
    pytest.mark.no_delay_pass("end to end; component files run its async paths delayed"),
    pytest.mark.no_numerics_pass("end to end; the model and op files run its numerics"),
]

# the main job's defaults (tp2 x pp2 x dp2, 1f1b, 4 x 4 sequences of 64 tokens, 4 layers of
# width 64) with a usual recipe around them
MAIN = ["--dtype", "bf16", "--warmup-steps", "5", "--lr-schedule", "cosine", "--clip-grad", "1.0",
        "--timeout", "240"]
TINY = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "2", "--timeout", "240"]


def _run(args):
    res = subprocess.run([sys.executable, "-m", "overlap.train", *args], capture_output=True,
                         text=True, timeout=400, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _check_table(out):
    """(step, 3D loss, one-process fp32 loss) rows printed by --check."""
    return [(int(s), float(a), float(b)) for s, a, b in
            re.findall(r"^ +(\d+) +([\d.]+) +([\d.]+) +[\d.e+-]+$", out, re.M)]


def _losses(out):
    return {int(s): loss for s, loss in re.findall(r"^step +(\d+)/\d+ .* loss +([\d.]+)", out,
                                                   re.M)}


@pytest.fixture(scope="module")
def run_30(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    out = _run([*MAIN, "--steps", "30", "--check", "--save", str(root / "a"),
                "--save-every", "28"])
    return root, out


def test_loss_curve_tracks_fp32(run_30):
    _, out = run_30
    assert "precision       bf16 parameters and activations" in out
    rows = _check_table(out)
    assert [s for s, _, _ in rows] == list(range(1, 31))
    rel = [abs(a - b) / b for _, a, b in rows]
    assert max(rel) <= BF16_CHECK_REL, max(rel)
    assert rel[-1] <= 0.01, rel[-1]
    assert rows[-1][1] < rows[0][1] - 2.0  # it trains (5.54 -> 2.75)
    # and it does run in bf16: the losses are not the fp32 ones
    assert max(abs(a - b) for _, a, b in rows) > 1e-4
    assert "PASS" in out


def test_resume_bf16_is_bit_identical(run_30):
    root, out_a = run_30
    assert sorted(os.listdir(root / "a")) == ["step_28", "step_30"]
    out_b = _run([*MAIN, "--steps", "30", "--resume", str(root / "a" / "step_28"),
                  "--save", str(root / "b"), "--save-every", "28"])
    assert "resumed at step 28" in out_b
    la, lb = _losses(out_a), _losses(out_b)
    assert sorted(lb) == [29, 30] and all(lb[s] == la[s] for s in lb)
    a, b = _read(str(root / "a" / "step_30")), _read(str(root / "b" / "step_30"))
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    # what the checkpoint holds: bf16 parameters, fp32 masters and moments; each parameter
    # is its master rounded to bf16
    names = [k[len("model."):] for k in a if k.startswith("model.")]
    assert names and all(a[f"model.{n}"].dtype == torch.bfloat16 for n in names)
    for n in names:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert a[f"optim.{kind}.{n}"].dtype == torch.float32
        assert torch.equal(a[f"optim.master.{n}"].to(torch.bfloat16), a[f"model.{n}"]), n
    # a bf16 checkpoint resumes in fp32 too: the parameters come from the fp32 masters
    out_c = _run([*MAIN[2:], "--dtype", "fp32", "--steps", "29", "--resume",
                  str(root / "a" / "step_28")])
    assert abs(float(_losses(out_c)[29]) - float(la[29])) <= 0.01 * float(la[29])


def test_bf16_without_sharded_optimizer_clips_main_grads():
    """fp32 masters for the plain AdamW path (MasterOptimizer), stepped from the reducer's fp32
    main grads; clipping reads and scales the main grads."""
    from overlap.train.loop import reference_model

    args = ["--dtype", "bf16", "--no-sharded-optimizer", "--clip-grad", "0.5",
            "--weight-decay", "0.1"]
    out = _run([*TINY, *args, "--check"])
    assert "PASS" in out
    norms = [float(n) for n in re.findall(r"grad norm ([\d.e+-]+)$", out, re.M)]
    ref_norms: list[float] = []
    reference_model(parse_args(TINY + args), norms=ref_norms)
    assert len(norms) == 3 and all(n > 0.5 for n in ref_norms)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=0.02, atol=0)
