"""Checkpoints of the MoE main job: the experts are saved at their place among all of a
layer's experts, so a checkpoint written with one EP size loads into another. Runs: tp2 x pp2
x dp2 with ep2 (saved every 2 steps), resumed on the same layout (bit-identical), with ep 1,
and on tp2 x pp1 x dp4 with ep4; and one saved with ep1 resumed with ep2.

Tolerances as in test_train_checkpoint.py (PARAM_ATOL derived there: AdamW eps 1e-3, clipped
gradients, fp32 summation-order noise), with the same global batch on every layout. tp and the
micro-batch size stay 2: a MoE block routes each micro-batch in tp groups, and its capacity
and load-balancing loss are functions of those groups (not sums over tokens), so both are part
of the model's math; every layout here forms the same groups of sequences."""

import os

import pytest
import torch

from test_train_checkpoint import PARAM_ATOL, _losses, _read, _run
from overlap.train.config import parse_args

pytestmark = [
    pytest.mark.no_delay_pass("end to end; component files run its async paths delayed"),
    pytest.mark.no_numerics_pass("end to end; the model and op files run its numerics"),
]

TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--timeout", "240", "--clip-grad", "0.5", "--weight-decay", "0.1",
        "--lr-schedule", "cosine", "--warmup-steps", "1", "--adam-eps", "1e-3",
        "--moe-experts", "4", "--moe-shared-experts", "1"]
LAYOUT_A = ["--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--micro-batches", "2",
            "--micro-batch-size", "2"]
RESHARDED = {"ep1": ["--tp", "2", "--pp", "2", "--dp", "2", "--ep", "1",
                     "--micro-batches", "2", "--micro-batch-size", "2"],
             "tp2xpp1xdp4 ep4": ["--tp", "2", "--pp", "1", "--dp", "4", "--ep", "4",
                                 "--micro-batches", "1", "--micro-batch-size", "2"]}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ckpt")
    out = _run([*TINY, *LAYOUT_A, "--steps", "4", "--save", str(root / "a"),
                "--save-every", "2"])
    return root, out


def test_moe_resume_is_bit_identical(run_a):
    root, out_a = run_a
    out_b = _run([*TINY, *LAYOUT_A, "--steps", "4", "--resume", str(root / "a" / "step_2"),
                  "--save", str(root / "b")])
    la, lb = _losses(out_a), _losses(out_b)
    assert sorted(lb) == [3, 4] and all(lb[s] == la[s] for s in lb)
    a, b = _read(str(root / "a" / "step_4")), _read(str(root / "b" / "step_4"))
    assert sorted(a) == sorted(b)
    # the experts are saved whole (4 of them), not as one rank's shard
    assert a["model.blocks.0.mlp.moe.experts.w_gate_up"].shape[0] == 4
    assert a["optim.exp_avg.blocks.1.mlp.moe.experts.w_down"].shape[0] == 4
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def _check_params(path: str) -> None:
    from overlap.train.loop import reference_model

    ref, _ = reference_model(parse_args([*TINY, *LAYOUT_A, "--steps", "3"]))
    got = _read(path)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[f"model.{name}"], p.detach(), rtol=0, atol=PARAM_ATOL,
                                   msg=name)
        torch.testing.assert_close(got[f"optim.master.{name}"], got[f"model.{name}"], rtol=0,
                                   atol=0)


@pytest.mark.parametrize("layout", sorted(RESHARDED))
def test_moe_resharded_resume_matches(run_a, layout):
    root, out_a = run_a
    out = _run([*TINY, *RESHARDED[layout], "--steps", "3",
                "--resume", str(root / "a" / "step_2"), "--save", str(root / layout)])
    assert abs(float(_losses(out)[3]) - float(_losses(out_a)[3])) <= 1e-5
    _check_params(str(root / layout / "step_3"))


def test_moe_ep1_checkpoint_resumes_with_ep2(run_a, tmp_path):
    root, out_a = run_a
    _run([*TINY, *RESHARDED["ep1"], "--steps", "2", "--save", str(tmp_path / "e1")])
    out = _run([*TINY, *LAYOUT_A, "--steps", "3", "--resume", str(tmp_path / "e1"),
                "--save", str(tmp_path / "e2")])
    assert abs(float(_losses(out)[3]) - float(_losses(out_a)[3])) <= 1e-5
    assert os.path.isdir(tmp_path / "e2" / "step_3")
    _check_params(str(tmp_path / "e2" / "step_3"))
