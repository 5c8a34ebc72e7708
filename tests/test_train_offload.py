"""--offload-activations in the main job, run as users run it: the training with offload equals
the training without, bit for bit (fp32: every printed loss, and every tensor of the final
checkpoint: parameters, fp32 masters, AdamW moments), for every pipeline schedule, with
selective and full recomputation, TP with sequence parallelism, and the MoE and CP layers,
on the NCCL-ordering twin with injected stream delays (the copies run late); bad values
refused before any process starts.
"""

import re

import pytest
import torch

from train_cli import read_checkpoint, run_train, step_losses

pytestmark = pytest.mark.own_delays  # CI's delay pass skips it (it injects delays itself)

TINY = ["--steps", "2", "--n-layer", "4", "--d-model", "32", "--n-head", "4", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "4", "--timeout", "240"]
DELAY = {"OVERLAP_STREAM_DELAY_MS": "2"}


def _trained(args, tmp_path, name, env=None):
    res = run_train([*TINY, *args, "--save", str(tmp_path / name)], env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    losses = step_losses(res.stdout)
    assert sorted(losses) == [1, 2], res.stdout
    return res.stdout, losses, read_checkpoint(str(tmp_path / name / "step_2"))


def _same_training(tmp_path, base, offloads, env=DELAY):
    """The run with ``base`` flags vs each ``base + offload`` run (recomputation in fp32
    recomputes the same values, so one baseline serves the recomputing runs too)."""
    _, l0, ck0 = _trained(base, tmp_path, "plain", env)
    for i, offload in enumerate(offloads):
        out, l1, ck1 = _trained([*base, *offload], tmp_path, f"offload{i}", env)
        assert l1 == l0, (offload, l0, l1)
        assert sorted(ck0) == sorted(ck1)
        assert [k for k in ck0 if not torch.equal(ck0[k], ck1[k])] == [], offload
        assert "MiB per step to host" in out, out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_offload_is_bit_identical_for_every_schedule(tmp_path, schedule):
    """pp 2 with micro-batches in flight; the first block of each chunk offloads (interleaved:
    2 chunks of 1 block per rank, so every block)."""
    _same_training(tmp_path, ["--tp", "1", "--pp", "2", "--dp", "1", "--schedule", schedule],
                   [["--offload-activations", "1"]])


def test_offload_with_recompute_tp_sp_and_dp(tmp_path):
    """tp2 x pp2 x dp2 with sequence parallelism: every block offloads, around selective
    and full recomputation's checkpoints (a fully recomputed block offloads its input)."""
    _same_training(tmp_path, [], [["--offload-activations", "all", "--recompute", r]
                                  for r in ("selective", "full")])


def test_offload_with_moe_experts_and_context_parallelism(tmp_path):
    """Five axes' layers: cp 2 ring attention and MoE blocks with experts over ep 2, pp 2."""
    _same_training(tmp_path, ["--tp", "1", "--cp", "2", "--pp", "2", "--dp", "1",
                              "--moe-experts", "4", "--ep", "2"],
                   [["--offload-activations", "all"]])


@pytest.mark.parametrize("value, message", [
    ("some", r"--offload-activations must be none, all or a positive number of blocks per "
             r"pipeline chunk, got 'some'"),
    ("0", r"got '0'"),
    ("9", r"--offload-activations 9 is more than the 4 blocks \(--n-layer\)"),
])
def test_bad_offload_values_fail_fast(value, message):
    res = run_train([*TINY, "--offload-activations", value], timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert re.search(message, res.stderr), res.stderr
