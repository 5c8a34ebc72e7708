"""The benches' trace-measured overlap column (bench.runner.TraceOptions / Tracer):

- ``--profile DIR`` on a tiny bench_tp_block run writes per-rank torch.profiler traces and a
  ``trace_overlap%`` column whose every number lies in [0, 100] and equals what the
  ``overlap-analyze`` command line reports for the same traces (pooled over the row's steps);
- the nsys path (``python -m bench.runner fill OUT REPORT``) on a synthetic nsys export of two
  ranks gives the overlap worked out by hand, per row;
- ``--nsys`` on a machine without CUDA exits with status 2 and one line on stderr, in every
  bench script, before launching any rank.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import without_gpus
from overlap.profile.synthetic import Kernel, Range, write_nsys

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")

ROOT = Path(__file__).resolve().parents[1]
COL = "trace_overlap%"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
GEMM = "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n"


def _run(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_profile_column_matches_overlap_analyze(tmp_path):
    prof, out = tmp_path / "prof", tmp_path / "tp_block"
    res = _run("-m", "bench.bench_tp_block", "--batch", "1", "--seq-len", "8", "--d-model", "32",
               "--n-head", "2", "--backends", "chunked", "symmetric", "--warmup", "1",
               "--iters", "2", "--profile", str(prof), "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    table = json.loads(out.with_suffix(".json").read_text())
    assert COL in table["columns"]
    assert f"| {COL} |" in out.with_suffix(".md").read_text()
    region = prof / "measured"
    assert sorted(p.name for p in region.iterdir()) == ["trace_rank0.json", "trace_rank1.json"]

    # As a user without the venv on PATH runs it: by the interpreter, not the console script.
    cli = subprocess.run([sys.executable, "-m", "overlap.profile.analyze", str(region), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    report = json.loads(cli.stdout)
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    windows = {}
    for r in report["ranks"]:
        for s in r["steps"]:
            windows.setdefault(s["step"], []).append(s)

    numbers = 0
    for row in table["rows"]:
        steps = row["trace_steps"]
        assert len(steps) == 2 and row["trace_region"] == "measured"
        mine = [w for s in steps for w in windows[s]]
        assert len(mine) == 4  # 2 timed steps x 2 ranks, each one window of the analyzer
        comm = sum(w["comm_s"] for w in mine)
        hidden = sum(w["hidden_s"] for w in mine)
        if row["variant"] == "unsharded":
            assert comm == 0 and row[COL] == "-"  # no communication at all
            continue
        assert comm > 0, row
        assert isinstance(row[COL], float) and 0.0 <= row[COL] <= 100.0
        assert row[COL] == pytest.approx(100.0 * hidden / comm, rel=1e-12, abs=1e-12)
        numbers += 1
    assert numbers == 1 + 2 * 3  # dtensor; chunked x (sp, check) 4 + symmetric x sp 2 = 7

    # The fill command (the nsys path's second half) reads a --profile directory too and
    # gives the same numbers.
    expect = [row[COL] for row in table["rows"]]
    for row in table["rows"]:
        row[COL] = "pending"
    out.with_suffix(".json").write_text(json.dumps(table))
    res = _run("-m", "bench.runner", "fill", str(out), str(prof))
    assert res.returncode == 0, res.stderr
    refilled = json.loads(out.with_suffix(".json").read_text())
    assert [row[COL] for row in refilled["rows"]] == expect
    assert refilled["machine"] == table["machine"]


def _rank(pid, device):
    """Two steps of one rank (ns): step 0 hides 200 of 500 ns of NCCL under a GEMM; step 1
    runs its 400 ns of NCCL alone, then a GEMM."""
    return [Range("step:0", 0, 1000, pid=pid), Range("step:1", 2000, 3000, pid=pid),
            Kernel(GEMM, 100, 600, device=device, pid=pid, launch=(50, 100)),
            Kernel(NCCL, 400, 900, stream=9, device=device, pid=pid, launch=(60, 100)),
            Kernel(NCCL, 2100, 2500, stream=9, device=device, pid=pid, launch=(2050, 100)),
            Kernel(GEMM, 2600, 2900, device=device, pid=pid, launch=(2060, 100))]


def test_fill_from_nsys_export(tmp_path):
    from bench.runner import Table

    report = write_nsys(_rank(100, 0) + _rank(101, 1), tmp_path / "run.sqlite")
    stem = str(tmp_path / "table")
    table = Table("t", ["name", COL])
    for name, steps in (("first", [0]), ("second", [1]), ("both", [0, 1])):
        table.add(name=name, **{COL: "pending"}, trace_region=None, trace_steps=steps)
    table.write(stem)
    res = _run("-m", "bench.runner", "fill", stem, str(report))
    assert res.returncode == 0, res.stderr
    got = {r["name"]: r[COL] for r in json.loads(Path(stem + ".json").read_text())["rows"]}
    assert got["first"] == pytest.approx(40.0)            # 200 / 500 on each rank
    assert got["second"] == pytest.approx(0.0)
    assert got["both"] == pytest.approx(100 * 400 / 1800)  # (200 + 0) x 2 / (500 + 400) x 2
    assert "| first | 40.000 |" in Path(stem + ".md").read_text()


def test_fill_errors_are_one_line(tmp_path):
    res = _run("-m", "bench.runner", "fill", str(tmp_path / "missing"))
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "error" in res.stderr and "Traceback" not in res.stderr


# (module, extra argv): each bench's GPU flags, so the error is about CUDA, not the device.
BENCHES = [("bench.bench_tp_ops", []), ("bench.bench_tp_block", ["--device", "cuda"]),
           ("bench.bench_quant", ["--device", "cuda", "--world-sizes", "2"]),
           ("bench.bench_dp", ["--device", "cuda", "--world-sizes", "2"]),
           ("bench.bench_pp", ["--device", "cuda"]),
           ("bench.bench_host", ["--device", "cuda"])]


@pytest.mark.parametrize("module,argv", BENCHES, ids=[b[0].split(".")[-1] for b in BENCHES])
def test_nsys_without_cuda_is_one_clear_line(module, argv):
    res = _run("-m", module, "--nsys", *argv, timeout=120, env=without_gpus())
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "--nsys needs CUDA" in lines[0] and "Traceback" not in res.stderr
    assert lines[0].startswith(module.split(".")[-1] + ": error:")
