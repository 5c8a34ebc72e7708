"""overlap-analyze end to end: the Kineto reader on a real CPU trace, both readers agreeing on
one timeline, and the command line (table, --json, --compare, --png, errors)."""

import json
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from overlap.profile import analyze, names, nvtx, timers
from overlap.profile.kineto import read_kineto
from overlap.profile.metrics import analyze_rank
from overlap.profile.nsys import read_nsys_sqlite
from overlap.profile.synthetic import Kernel, worked_example, write_chrome, write_nsys

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

US = 1e-6
GEMM = names.chunk("all_gather_matmul", "chunked", "gemm", 0)
HIDDEN = names.chunk("all_gather_matmul", "chunked", "comm", 1)
EXPOSED = names.chunk("all_gather_matmul", "chunked", "comm", 2)


def _real_cpu_trace(path):
    """A helper thread (the CPU twin's copy thread) runs two comm ranges: the first while the
    training thread is inside a GEMM range (hidden), the second while it blocks in comm_wait
    (exposed). Events order the threads, so the nesting is certain, not timing luck."""
    go1, done1, go2, done2 = (threading.Event() for _ in range(4))

    def copier():
        go1.wait(10)
        with nvtx.range(HIDDEN):
            time.sleep(0.02)
        done1.set()
        go2.wait(10)
        with nvtx.range(EXPOSED):
            time.sleep(0.02)
        done2.set()

    x = torch.randn(96, 96)
    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        t = threading.Thread(target=copier)
        t.start()
        with nvtx.step(0):
            with nvtx.range(GEMM):
                go1.set()
                for _ in range(3):
                    x = torch.tanh(x @ x)
                assert done1.wait(10)
            with timers.comm_wait("tp.chunked"):
                go2.set()
                assert done2.wait(10)
        t.join(10)
    prof.export_chrome_trace(str(path))
    return path


def _range(events, name):
    (e,) = [e for e in events if e.get("ph") == "X" and e["name"] == name]
    return e["ts"], e["ts"] + e["dur"], e["tid"]


def test_kineto_reader_on_a_real_cpu_trace(tmp_path):
    path = _real_cpu_trace(tmp_path / "trace_rank3.json")
    events = json.loads(path.read_text())["traceEvents"]
    step, gemm, wait = (_range(events, n) for n in ("step:0", GEMM, "comm_wait:tp.chunked"))
    hidden, exposed = _range(events, HIDDEN), _range(events, EXPOSED)
    assert hidden[2] != step[2] == gemm[2] == wait[2]  # comm on the helper thread
    assert gemm[0] <= hidden[0] and hidden[1] <= gemm[1]  # as the events ordered them
    assert wait[0] <= exposed[0] and exposed[1] <= wait[1]
    trace = read_kineto(path)
    assert trace.rank == 3 and trace.fmt == "kineto"
    report = analyze_rank(trace)
    assert report.mode == "host" and report.main_track == f"thread {step[2]}"
    (m,) = report.steps
    # Reference from the trace's own timestamps: compute = the GEMM range (every aten op of the
    # training thread is inside it), comm = hidden copy + the wait (the exposed copy is inside
    # the wait), hidden = the copy under the GEMM, exposed = the wait.
    dur = lambda r: (r[1] - r[0]) * US  # noqa: E731
    assert m.step == 0 and m.step_s == pytest.approx(dur(step), rel=1e-9)
    assert m.compute_s == pytest.approx(dur(gemm), rel=1e-9)
    assert m.hidden_s == pytest.approx(dur(hidden), rel=1e-9)
    assert m.exposed_s == pytest.approx(dur(wait), rel=1e-9)
    assert m.comm_s == pytest.approx(dur(hidden) + dur(wait), rel=1e-9)
    # fused: the training thread's piece of the fused op (the GEMM; the wait is comm_wait:)
    assert m.fused_s == pytest.approx(dur(gemm), rel=1e-9)
    assert dur(hidden) >= 0.02 and dur(wait) >= 0.02
    # The exposed time is charged once, to the training thread's wait, not also to the copy
    # it waited for (which ran inside it), so the list sums to the total.
    top = report.top_exposed
    assert [(t.range, t.count, t.kind) for t in top] == [("comm_wait:tp.chunked", 1, "tp")]
    assert [t.exposed_s for t in top] == pytest.approx([dur(wait)], rel=1e-9)


@pytest.mark.parametrize("variant", ["textid", "3.28.1"])
def test_both_readers_give_the_same_metrics(tmp_path, variant):
    rows = worked_example()
    kineto = analyze_rank(read_kineto(write_chrome(rows, tmp_path / "t.json")))
    (nsys,) = read_nsys_sqlite(write_nsys(rows, tmp_path / "t.sqlite", variant=variant))
    nsys = analyze_rank(nsys)
    assert [s.as_dict() for s in kineto.steps] == [s.as_dict() for s in nsys.steps]
    assert kineto.total.as_dict() == nsys.total.as_dict()
    assert kineto.top_exposed == nsys.top_exposed
    assert kineto.steps[1].exposed_s == pytest.approx(150 * US, abs=1e-12)


def _run(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        analyze.main(list(argv))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_cli_json(tmp_path, capsys):
    path = write_nsys(worked_example(), tmp_path / "r.sqlite")
    assert analyze.main([str(path), "--json", "--top", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"source", "format", "schema_version", "ranks", "summary"}
    assert report["format"] == "nsys-sqlite" and report["schema_version"] == "3.28.1"
    (rank,) = report["ranks"]
    assert set(rank) == {"rank", "source", "format", "mode", "main_track", "steps", "total",
                         "top_exposed", "by_kind"}
    assert set(rank["steps"][0]) == {"step", "step_s", "compute_s", "comm_s", "hidden_s",
                                     "exposed_s", "fused_s", "overlap_pct", "exposed_pct"}
    s0, s1 = rank["steps"]
    assert (s0["step"], s1["step"]) == (0, 1)
    assert s0["exposed_s"] == pytest.approx(150 * US) and s1["fused_s"] == pytest.approx(600 * US)
    assert s1["compute_s"] == pytest.approx(450 * US) and s0["overlap_pct"] == pytest.approx(
        100 * 400 / 550)
    assert [t["exposed_s"] for t in rank["top_exposed"]] == pytest.approx([150 * US, 100 * US])
    assert report["summary"]["exposed_s"] == pytest.approx(150 * US)
    assert report["summary"]["exposed_pct"] == pytest.approx(15.0)


def test_cli_table(tmp_path, capsys):
    path = write_chrome(worked_example(), tmp_path / "trace_rank0.json")
    assert analyze.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "   0     1      1.000      0.450      0.550      0.400      0.150      0.600" in out
    assert "all_gather_matmul.chunked.comm[1] [ncclDevKernel_AllGather_RING_LL]" in out
    assert out.splitlines()[1] == ("exposed communication: 15.0% of the step (0.150 of 1.000 "
                                   "ms per step, mean over ranks)")
    assert "   0     15.0      0.300      2.000     72.7      1.150" in out  # the rank's total


def test_cli_compare_and_png(tmp_path, capsys):
    a = write_chrome(worked_example(), tmp_path / "a.json")
    # B: the same run with the all-gather entirely under the GEMM (200-600 us).
    rows = [Kernel(r.name, 250_000, 550_000, stream=r.stream, launch=r.launch)
            if getattr(r, "name", "").startswith("nccl") else r for r in worked_example()]
    b = write_nsys(rows, tmp_path / "b.sqlite")
    png = tmp_path / "cmp.png"
    assert analyze.main(["--compare", str(a), str(b), "--json", "--png", str(png)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"a", "b", "b_minus_a", "b_over_a"}
    # Per-step means over the two steps: A exposes 150 + 150 us, B 0 + 150 us.
    assert result["a"]["summary"]["exposed_s"] == pytest.approx(150 * US)
    assert result["b"]["summary"]["exposed_s"] == pytest.approx(75 * US)
    assert result["b_minus_a"]["exposed_s"] == pytest.approx(-75 * US)
    assert result["b_over_a"]["comm_s"] == pytest.approx((300 + 550) / (550 + 550))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert analyze.main(["--compare", str(a), str(b)]) == 0
    table = capsys.readouterr().out
    assert "B / A" in table and "exposed ms" in table and "0.150        0.075" in table


def test_cli_directory_of_rank_traces(tmp_path, capsys):
    for rank in (1, 0):
        write_chrome(worked_example(), tmp_path / f"trace_rank{rank}.json")
    (tmp_path / "overlap_metrics.json").write_text(json.dumps({"ranks": []}))
    assert analyze.main([str(tmp_path), "--json", "--progress", "on"]) == 0
    out = capsys.readouterr()
    assert [r["rank"] for r in json.loads(out.out)["ranks"]] == [0, 1]
    assert "reading trace_rank0.json: 100%" in out.err
    write_chrome(worked_example(), tmp_path / "copy_rank1.json")
    code, _, err = _run(capsys, str(tmp_path))
    assert code == 2 and "rank 1 appears in both" in err
    # One nsys export per rank, as `nsys profile -o report_rank%q{RANK}` writes them.
    nsys_dir = tmp_path / "nsys"
    nsys_dir.mkdir()
    for rank in (1, 0):
        write_nsys(worked_example(), nsys_dir / f"report_rank{rank}.sqlite")
    assert analyze.main([str(nsys_dir), "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [(r["rank"], r["source"].endswith(f"report_rank{r['rank']}.sqlite")) for r in ranks] \
        == [(0, True), (1, True)]


@pytest.mark.parametrize("args, message", [
    (["{tmp}/missing.json"], "missing.json: no such file or directory"),
    (["{tmp}/metrics.json"], "not a Chrome trace"),
    (["{tmp}/broken.json"], "not a JSON trace"),
    (["{tmp}/empty"], "no torch.profiler trace"),
    (["{tmp}/r.nsys-rep"], "needs `nsys` on PATH"),
    ([], "give either PATH or --compare A B"),
    (["--top", "-1", "{tmp}/x"], "--top must be >= 0"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, message):
    (tmp_path / "metrics.json").write_text(json.dumps({"ranks": []}))
    (tmp_path / "broken.json").write_text('{"traceEvents": [')
    (tmp_path / "r.nsys-rep").write_bytes(b"\0")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no nsys
    code, out, err = _run(capsys, *(a.format(tmp=tmp_path) for a in args))
    assert code == 2 and out == ""
    assert err.startswith("overlap-analyze: error: ") and err.count("\n") == 1, err
    assert message in err


def test_module_entry_point(tmp_path):
    path = write_chrome(worked_example(), tmp_path / "t.json")
    run = subprocess.run([sys.executable, "-m", "overlap.profile.analyze", str(path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["summary"]["hidden_s"] == pytest.approx(400 * US)
    bad = subprocess.run([sys.executable, "-m", "overlap.profile.analyze", str(tmp_path / "no")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stdout == ""
