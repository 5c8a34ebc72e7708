"""DCP checkpoints of the main job (8 local processes, tp2 x pp2 x dp2): bit-identical resume on
the same layout, resharded resume on other layouts (one with context parallelism), and export
to a plain state dict.

References: the uninterrupted run (bit-identical, fp32), the single-process model trained the
same steps (``reference_model``: same init, data, param groups, schedule and clipping).
Tolerances: resharded runs sum in another order (and the order depends on the CPU's vector
width), so parameters match the reference within PARAM_ATOL, derived below, and the next-step
loss within 1e-5."""

import os

import pytest
import torch

from overlap.train.config import parse_args
from train_cli import read_checkpoint, run_train, step_losses

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")

TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--timeout", "240", "--clip-grad", "0.5", "--weight-decay", "0.1",
        "--lr-schedule", "cosine", "--warmup-steps", "1", "--adam-eps", "1e-3"]
LAYOUT_A = ["--tp", "2", "--pp", "2", "--dp", "2", "--micro-batches", "2",
            "--micro-batch-size", "2"]
# the same global batch (8 sequences of 16 tokens) on other layouts
RESHARDED = {"tp1xpp2xdp4": ["--tp", "1", "--pp", "2", "--dp", "4", "--micro-batches", "2",
                             "--micro-batch-size", "1"],
             "tp2xpp1xdp1": ["--tp", "2", "--pp", "1", "--dp", "1", "--micro-batches", "4",
                             "--micro-batch-size", "2"],
             # context parallelism: the ZeRO shards over dp x cp, each sequence in cp pieces
             "tp2xcp2xpp1xdp1": ["--tp", "2", "--cp", "2", "--pp", "1", "--dp", "1",
                                 "--micro-batches", "4", "--micro-batch-size", "2"]}
# Why PARAM_ATOL holds on any CPU. Two runs see gradients g and g + d, d the rounding noise of a
# different summation order. With AdamW's default eps (1e-8) a gradient that is 0 in exact
# arithmetic (the key bias: softmax ignores it) or merely tiny is all noise, and the update
# lr * m/(sqrt(v) + eps) is then +-lr whatever the noise: a summation order alone moves such a
# parameter by up to 2 lr per step (5e-6 seen on an AVX2 machine against 4e-9 here). So the
# test trains with eps = 1e-3, which makes the update Lipschitz in g: per step and element
# |change| <= lr * 2|d| / eps (the m term contributes |d|/eps, the v term at most as much, with
# |m|/sqrt(v) <= 1.01 in the first three bias-corrected steps). The gradients are clipped to a
# global norm of 0.5, so |g| <= 0.5, and fp32 summation of the few hundred terms of each element
# keeps |d| <= 1e-5 * 0.5 (a relative error of ~n * 2^-24 for n <= 160 terms).
# Over 3 steps at lr <= 3e-3: |change| <= 3 * 3e-3 * 2 * 5e-6 / 1e-3 = 9e-8; PARAM_ATOL leaves
# a factor 10 for the weight decay and the rare longer sum.
PARAM_ATOL = 1e-6


def _run(args, timeout=300):
    res = run_train(args, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


_losses, _read = step_losses, read_checkpoint


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = _run([*TINY, *LAYOUT_A, "--steps", "4", "--save", str(root / "a"),
                "--save-every", "2"])
    return root, out


def test_resume_is_bit_identical(run_a):
    root, out_a = run_a
    assert sorted(os.listdir(root / "a")) == ["step_2", "step_4"]
    out_b = _run([*TINY, *LAYOUT_A, "--steps", "4", "--resume", str(root / "a" / "step_2"),
                  "--save", str(root / "b")])
    assert "resumed at step 2" in out_b
    # the losses of steps 3 and 4 print identically (to the printed digits) ...
    la, lb = _losses(out_a), _losses(out_b)
    assert sorted(lb) == [3, 4] and all(lb[s] == la[s] for s in lb)
    # ... and every saved tensor is bitwise equal: parameters, fp32 masters, AdamW moments and
    # step count, as the uninterrupted run's at step 4
    a, b = _read(str(root / "a" / "step_4")), _read(str(root / "b" / "step_4"))
    assert sorted(a) == sorted(b)
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in a if k.startswith("optim.")} == \
        {"optim.master", "optim.exp_avg", "optim.exp_avg_sq", "optim.step"}
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.parametrize("layout", sorted(RESHARDED))
def test_resharded_resume_matches(run_a, layout):
    from overlap.train.loop import reference_model

    root, out_a = run_a
    out = _run([*TINY, *RESHARDED[layout], "--steps", "3",
                "--resume", str(root / "a" / "step_2"), "--save", str(root / layout)])
    # next-step loss vs the uninterrupted tp2xpp2xdp2 run's step 3
    assert abs(float(_losses(out)[3]) - float(_losses(out_a)[3])) <= 1e-5
    # parameters after step 3 vs the single-process model trained 3 steps
    cfg = parse_args([*TINY, *LAYOUT_A, "--steps", "3"])
    ref, _ = reference_model(cfg)
    got = _read(str(root / layout / "step_3"))
    for name, p in ref.named_parameters():  # every parameter: no noise-only exception
        torch.testing.assert_close(got[f"model.{name}"], p.detach(), rtol=0, atol=PARAM_ATOL,
                                   msg=name)
        # the fp32 masters were resharded too (over dp 4 or dp 1): equal to the parameters
        torch.testing.assert_close(got[f"optim.master.{name}"], got[f"model.{name}"], rtol=0,
                                   atol=0)


def test_export_loads_into_unsharded_gpt(run_a, tmp_path):
    from overlap.models.gpt import GPT
    from overlap.train.loop import model_config, reference_model

    root, _ = run_a
    out_file = tmp_path / "model.pt"
    res = run_train(["--export", str(out_file), "--resume", str(root / "a"), *TINY,
                     *LAYOUT_A], timeout=120)
    assert res.returncode == 0, res.stderr
    assert "step_4" in res.stdout
    cfg = parse_args([*TINY, *LAYOUT_A, "--steps", "4"])
    model = GPT(model_config(cfg))
    sd = torch.load(out_file, weights_only=True)
    model.load_state_dict(sd, strict=True)  # every key, every shape of the unsharded GPT
    ref, _ = reference_model(cfg)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=PARAM_ATOL, msg=name)
