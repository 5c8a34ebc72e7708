"""The main job under torchrun with --max-restarts, as clusters run it: a rank killed after a
checkpoint makes torchrun restart every worker, the job resumes from the latest complete
checkpoint and ends with exactly the uninterrupted run's final loss and parameters (fp32, the
same layout: a resumed run is bit-identical, tests/test_train_checkpoint.py). Without the
attempt-prefixed store (overlap.dist.envinit) the restarted workers connect to the dead
attempt's addresses and fail."""

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from train_cli import read_checkpoint, run_train, step_losses

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")

TINY = ["--tp", "1", "--pp", "2", "--dp", "1", "--n-layer", "2", "--d-model", "32", "--n-head",
        "2", "--seq-len", "16", "--micro-batch-size", "2", "--micro-batches", "2", "--steps",
        "6", "--timeout", "60", "--save-every", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(tmp_path) -> dict:
    """The environment for a torchrun under test: its log directory (torchrun makes a
    ``torchelastic_*`` directory in the temp dir and leaves it) goes under ``tmp_path``."""
    return dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))


def _torchrun(args, tmp_path, timeout=240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port",
           str(_free_port()), "-m", "overlap.train", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=torchrun_env(tmp_path))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: nothing outlives us
        out, err = proc.communicate()
        raise AssertionError(f"torchrun timed out:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_killed_rank_restarts_and_resumes_to_the_same_final_loss(tmp_path):
    plain = run_train([*TINY, "--save", str(tmp_path / "plain")])
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    res = _torchrun([*TINY, "--save", str(tmp_path / "run"), "--kill-rank", "1",
                     "--kill-at-step", "3"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "training resumed" in res.stdout and "(attempt 1)" in res.stdout, res.stdout
    # rank 1 died at step 3 (index), after the step-2 checkpoint: steps 3..6 ran again
    assert step_losses(res.stdout)[6] == step_losses(plain.stdout)[6]
    a = read_checkpoint(str(tmp_path / "plain" / "step_6"))
    b = read_checkpoint(str(tmp_path / "run" / "step_6"))
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
