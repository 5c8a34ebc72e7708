"""Bad flags of the main job: one line naming the flag and the value, before any process."""

import os
import subprocess
import sys

import pytest

from overlap.train.config import parse_args

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")


def _one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("overlap-train: error: "), lines
    return lines[0]


@pytest.fixture
def data_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    small = tmp_path / "small.txt"
    small.write_bytes(b"0123456789")
    return {"missing": str(tmp_path / "nope.txt"), "empty": str(empty), "small": str(small),
            "dir": str(tmp_path)}


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "63"], "--seq-len 63 must be divisible by it"),
    (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0, got -0.1"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number >= 0, got nan"),
    (["--dropout", "1.0"], "--dropout must be a finite number >= 0 and < 1, got 1.0"),
    (["--save-every", "0"], "--save-every must be a positive integer, got 0"),
    (["--max-restarts", "2"], "--max-restarts 2 needs --save DIR"),
    (["--export", "/tmp/x.pt"], "--export /tmp/x.pt needs --resume DIR"),
    (["--resume", "/nonexistent/ckpt"], "--resume /nonexistent/ckpt: no such directory"),
])
def test_bad_values_one_line(argv, message, capsys):
    assert message in _one_line_error(argv, capsys)


@pytest.mark.parametrize("kind, message", [
    ("missing", "no such file"), ("empty", "is empty"),
    ("small", "has 10 bytes (tokens); --seq-len 64 needs at least seq_len + 2 = 66"),
    ("dir", "is a directory"),
])
def test_bad_data_one_line(kind, message, data_files, capsys):
    line = _one_line_error(["--data", data_files[kind]], capsys)
    assert f"--data {data_files[kind]}" in line and message in line


def test_resume_dir_without_checkpoint(tmp_path, capsys):
    line = _one_line_error(["--resume", str(tmp_path)], capsys)
    assert f"--resume {tmp_path}: no complete checkpoint" in line


def test_seq_len_63_fails_before_any_process():
    # the case that used to pass validation and fail inside 4 ranks with 181 lines of stderr
    res = subprocess.run([sys.executable, "-m", "overlap.train", "--seq-len", "63",
                          "--tp", "2", "--pp", "1", "--dp", "2"], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln]
    assert lines == ["overlap-train: error: sequence parallelism splits the 63 tokens of each "
                     "sequence over --tp 2: --seq-len 63 must be divisible by it (or pass "
                     "--no-sequence-parallel)"]
    assert res.stdout == ""


def _train_with_rank_settings(kind: str, root: str):
    """train_rank on every rank with one setting that differs on rank 1: the learning rate
    (as a per-node command line under torchrun would), or the checkpoint a rank's own listing
    of --resume finds (a node whose mount shows another latest step)."""
    import torch.distributed as dist

    from overlap.train.config import ConfigError, TrainConfig
    from overlap.train.loop import train_rank

    rank, n = dist.get_rank(), dist.get_world_size()
    kw = dict(tp=2, pp=1, dp=n // 2, cp=1, steps=1, n_layer=2, d_model=32, n_head=2,
              seq_len=16, micro_batches=1, micro_batch_size=1, tp_backend="unfused",
              sharded_optimizer=False)
    if kind == "lr":
        kw["lr"] = 1e-3 if rank == 1 else 3e-3
    else:
        mine = os.path.join(root, f"rank{rank}")
        step = os.path.join(mine, f"step_{20 if rank == 1 else 10}")
        os.makedirs(step, exist_ok=True)
        for name in (".metadata", "train_state.json"):
            open(os.path.join(step, name), "w").close()
        kw["resume"] = mine
    try:
        train_rank(TrainConfig(**kw), progress=False)
    except ConfigError as exc:
        return str(exc)
    return "trained"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["lr", "checkpoint"])
def test_ranks_that_hold_different_settings_refuse_on_every_rank(kind, world_size, tmp_path):
    from tests.harness import run_ranks

    msgs = run_ranks(_train_with_rank_settings, world_size, kind, str(tmp_path), timeout=120)
    want = ("'lr'", "0.003", "0.001") if kind == "lr" else ("step_10", "step_20",
                                                            "checkpoint to resume from")
    for rank, msg in enumerate(msgs):
        assert all(w in msg for w in want), (rank, msg)
