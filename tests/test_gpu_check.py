"""tools/gpu_check.py: its plan on one GPU (ranks share it), its bound on a hung step (every
process's Python stack, then nothing left running), its results file and its refusals. The
CPU-possible steps run whole in CI (.ci/run, `--device cpu`)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import gpu_check  # noqa: E402
from harness import without_gpus  # noqa: E402

pytestmark = pytest.mark.no_delay_pass("a tool's own processes: no stream or twin op")


def test_on_one_gpu_every_step_shares_it_and_the_jobs_run_under_torchrun(tmp_path):
    steps = gpu_check.plan("cuda", 1, str(tmp_path))
    names = [s.name for s in steps]
    assert names == ["build", "selftest, 2 ranks", "selftest, 4 ranks", "requires_gpu tests",
                     "main job, defaults, --check", "main job, --ep 2 --moe-experts 8",
                     "main job, --cp 2", "main job, --offload-activations all", "kernel benches"]
    by = {s.name: s for s in steps}
    assert by["selftest, 4 ranks"].argv[-2:] == ["--world-size", "4"]
    job = by["main job, --ep 2 --moe-experts 8"].argv
    assert job[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8"]
    assert job[-4:] == ["--ep", "2", "--moe-experts", "8"]
    assert "--check" in by["main job, defaults, --check"].argv
    assert by["kernel benches"].argv[-4:] == ["--device", "cuda", "--out",
                                              str(tmp_path / "kernels")]
    assert all(s.argv[0] == sys.executable for s in steps)  # as users run it, not by PATH
    assert sum(s.timeout for s in steps) > 600  # bounded each; the budget bounds the whole
    # On CPU the selection of GPU tests is only collected (the suite ran their twins).
    cpu = {s.name: s for s in gpu_check.plan("cpu", 1, str(tmp_path))}
    assert "--collect-only" in cpu["requires_gpu tests"].argv
    assert "--only" in cpu["selftest, 2 ranks"].argv


_HANGS = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time
    sys.path.insert(0, {root!r})
    import overlap  # registers the SIGUSR2 stack dump (OVERLAP_STACKS_ON_SIGUSR2=1)

    def child_waits_forever():
        time.sleep(600)

    def parent_waits_forever():
        time.sleep(600)

    if __name__ == "__main__":
        mp.get_context("fork").Process(target=child_waits_forever).start()
        print("started", flush=True)
        parent_waits_forever()
""")


def test_a_hung_step_prints_every_process_stack_then_nothing_is_left(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(_HANGS.format(root=gpu_check.ROOT))
    step = gpu_check.Step("hangs", [sys.executable, str(script)], 60)
    env = dict(os.environ, OVERLAP_STACKS_ON_SIGUSR2="1", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    gpu_check.run_step(step, env, str(tmp_path / "hangs.log"), limit=4.0)
    assert time.monotonic() - t0 < 4.0 + gpu_check.STACK_GRACE_S + 5
    log = (tmp_path / "hangs.log").read_text()
    assert step.status == "FAIL" and "hung: still running after 4 s" in step.detail
    assert "2 processes" in step.detail
    assert "child_waits_forever" in log and "parent_waits_forever" in log, log
    out = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert out.stdout.strip() == ""  # the whole session was killed


def test_a_failing_step_fails_the_check_and_its_log_tail_is_in_the_results(tmp_path):
    ok = gpu_check.Step("fine", [sys.executable, "-c", "print('all good')"], 30)
    bad = gpu_check.Step("broken", [sys.executable, "-c",
                                    "import sys; print('the reason'); sys.exit(3)"], 30)
    for i, s in enumerate((ok, bad)):
        gpu_check.run_step(s, dict(os.environ), str(tmp_path / f"{i}.log"), 30)
    assert (ok.status, bad.status, bad.detail) == ("pass", "FAIL", "exit status 3")
    out = tmp_path / "r.md"
    gpu_check.write_results(str(out), [ok, bad], {"gpu": "X"}, "cuda", 1.0, "")
    text = out.read_text()
    assert "1 of 2 steps passed" in text and "| broken | FAIL |" in text
    assert "the reason" in text and "all good" not in text  # only the failing step's tail
    table = gpu_check.table([ok, bad]).splitlines()
    assert table[0].split()[:2] == ["step", "result"] and table[-1].split()[:2] == ["broken",
                                                                                   "FAIL"]


@pytest.mark.parametrize("args,message", [
    (["--device", "cuda"], "--device cuda, but this machine has no CUDA GPU"),
    (["--device", "cpu", "--only", "nothing"], "matches no step; the steps: build;"),
    (["--device", "cpu", "--budget", "0"], "--budget must be > 0"),
])
def test_it_refuses_what_cannot_run_in_one_line(args, message):
    res = subprocess.run([sys.executable, os.path.join(gpu_check.ROOT, "tools", "gpu_check.py"),
                          *args], capture_output=True, text=True, timeout=60,
                         env=without_gpus())  # "no CUDA GPU" on a GPU machine too
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_only_runs_the_named_steps_and_the_budget_bounds_the_rest(tmp_path):
    out = tmp_path / "r.md"
    res = subprocess.run([sys.executable, os.path.join(gpu_check.ROOT, "tools", "gpu_check.py"),
                          "--device", "cpu", "--only", "build", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    text = out.read_text()
    assert "1 of 1 steps passed" in text and "| build | pass |" in text
    assert "Machine: gpu: " in text and "torch: " in text and "triton: " in text
    assert res.stdout.rstrip().splitlines()[-1].startswith("1 of 1 steps passed")
