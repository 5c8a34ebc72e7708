"""The main job end to end: `python -m overlap.train` on 8 local processes (tp2 x pp2 x dp2)."""

import json
import re

import pytest

from train_cli import check_diffs, run_train

pytestmark = pytest.mark.no_numerics_pass("end to end; the model and op files run its numerics")

TINY = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "2", "--timeout", "240"]


_run = run_train


@pytest.fixture(scope="module")
def checked_and_profiled(tmp_path_factory):
    prof = tmp_path_factory.mktemp("train") / "prof"
    res = _run([*TINY, "--check", "--profile", str(prof)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return prof, res


def test_check_and_profile_on_8_processes(checked_and_profiled):
    prof, res = checked_and_profiled
    out = res.stdout
    # One progress row per step, from rank 0, with the measured exposed fraction.
    rows = re.findall(r"step +(\d)/3 .* loss +([\d.]+) .* comm wait +([\d.]+)%", out)
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    assert all(0.0 <= float(r[2]) <= 100.0 for r in rows)
    # --check: every step's loss equals the one-process run within the stated tolerance.
    diffs = check_diffs(out)
    assert len(diffs) == 3 and max(diffs) <= 2e-3, out
    assert "check: max |loss difference|" in out and "PASS" in out
    # --profile: a trace per rank, a PNG, and consistent overlap metrics.
    assert sorted(p.name for p in prof.glob("trace_rank*.json")) == \
        [f"trace_rank{r}.json" for r in range(8)]
    png = (prof / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    metrics = json.loads((prof / "overlap_metrics.json").read_text())["ranks"]
    assert len(metrics) == 8
    for m in metrics:
        assert m["step_s"] > 0 and m["comm_s"] > 0 and m["compute_s"] > 0
        assert 0 <= m["exposed_comm_s"] <= m["comm_s"] + 1e-9
        assert abs(m["exposed_comm_s"] + m["hidden_comm_s"] - m["comm_s"]) < 1e-9
        assert 0 <= m["exposed_fraction"] <= 1 and 0 <= m["hidden_fraction"] <= 1
        # exposed time is charged to named axes: the twin's workers name their ops after their
        # group (tp, pp, dp), so "other" never has the most exposed time. (Its raw comm can be
        # large on this tiny model: ops torch hands to the twin's plain gloo backend, on gloo's
        # own threads, are named by no range; they run hidden or under a named wait.)
        kinds = m["by_kind"]
        named = max(v["exposed_s"] for k, v in kinds.items() if k != "other")
        assert kinds.get("other", {"exposed_s": 0.0})["exposed_s"] < named, kinds
        assert {"tp", "pp", "dp"} <= set(kinds), kinds
    # One exposed-communication number: the summary's is the profile table's "all" row and
    # the JSON's (and overlap-analyze's, tests/test_exposed_metric.py), recomputed here from
    # the per-rank sums.
    want = 100 * sum(m["exposed_comm_s"] for m in metrics) / sum(m["step_s"] for m in metrics)
    summary = float(re.search(r"^exposed comm +([\d.]+)% of the step", out, re.M)[1])
    table = float(re.search(r"^ +all +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)", out, re.M)[1])
    assert summary == table == round(want, 1), (summary, table, want)
    doc = json.loads((prof / "overlap_metrics.json").read_text())
    assert doc["exposed_percent"] == pytest.approx(want, rel=1e-12)


def test_progress_lines_come_in_order(checked_and_profiled):
    """Every long phase says what it is doing before it does it: the start, the build, the
    steps, the trace writing and reading, the summary, the reference of --check."""
    out, err = checked_and_profiled[1].stdout, checked_and_profiled[1].stderr
    marks = ["overlap-train: starting 8 local ranks, tp2 x pp2 x dp2",
             "overlap-train: 8 ranks up, job built in",
             "step    1/3 ", "step    3/3 ",
             "profile: writing each rank's trace of the last 3 steps",
             "profile: reading 8 traces", "\nsummary\n", "\nexposed comm ",
             "check: training the one-process reference (3 steps, 4 micro-batches each)",
             "check: one-process reference: 100%",
             "check: the job (tp2 x pp2 x dp2 (8 ranks, 2 micro-batches of 2)) against",
             " step   job loss  1-proc loss", "PASS"]
    at = [out.find(m) for m in marks]
    assert all(i >= 0 for i in at), [m for m, i in zip(marks, at) if i < 0]
    assert at == sorted(at), [m for m, _ in sorted(zip(marks, at), key=lambda p: p[1])]
    # no third-party log lines (torch's profiler prints "USDT:... profiler_start" at every
    # start and stop) anywhere in the output
    assert "USDT:" not in out + err and "SyncActivityProfilerHandler" not in err


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved", "zb-h1"])
def test_check_passes_for_every_schedule_under_nccl_order(schedule):
    # The default transport is the NCCL-ordering twin: an order that would hang on GPUs
    # fails here. (1F1B, the default, runs in the test above.)
    args = [*TINY, "--check", "--schedule", schedule]
    if schedule == "interleaved":
        args[args.index("--n-layer") + 1] = "4"  # pp x virtual stages = 4 chunks
    res = _run(args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    diffs = check_diffs(res.stdout)
    assert len(diffs) == 3 and max(diffs) <= 2e-3, res.stdout
    assert f"schedule {schedule}, 2 micro-batches" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--tp", "2", "--pp", "2", "--dp", "2", "--n-head", "3", "--d-model", "48"],
     "--n-head 3 is not divisible by --tp 2"),
    (["--pp", "4", "--n-layer", "2", "--dp", "1"], "--n-layer 2 is less than the 4 pipeline stages"),
    (["--micro-batches", "1"], "--micro-batches 1 must be >= --pp 2"),
    (["--steps", "0"], "--steps must be a positive integer, got 0"),
    (["--schedule", "zb-h1", "--micro-batches", "1"], "--micro-batches 1 must be >= --pp 2"),
    (["--schedule", "interleaved", "--micro-batches", "3", "--n-layer", "4"],
     "needs --micro-batches (3) to be a multiple of --pp (2)"),
])
def test_bad_flags_fail_fast_with_one_line(args, message):
    res = _run(args, timeout=60)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("overlap-train: error: "), res.stderr
    assert message in lines[0]
    assert "step" not in res.stdout  # no process was started
