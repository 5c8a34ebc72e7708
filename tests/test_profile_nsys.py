"""The nsys SQLite reader: exact metrics from synthetic exports of several schema variants."""

import json
import os
import shutil
import sqlite3
import stat
import sys

import pytest

from overlap.profile import analyze, names
from overlap.profile.metrics import analyze_rank
from overlap.profile.nsys import export_report, read_nsys_sqlite
from overlap.profile.synthetic import VARIANTS, Kernel, Range, worked_example, write_nsys
from overlap.profile.trace import events_from_nsys_sqlite, overlap_metrics

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

US = 1e-6
# The worked example (overlap.profile.synthetic.worked_example), by hand, in us:
# step 0: compute C = GEMM 200-600 = 400; comm M = NCCL 150-700 = 550; hidden = 400;
#         exposed = 150-200 + 600-700 = 150; step = 1000 (the host range; device ends at 700);
#         fused = the rows launched from the all_gather_matmul.chunked pieces = 150-700 = 550.
# step 1: C = fused 1100-1500 + DtoD on the compute stream 1650-1700 = 450;
#         M = fused 1100-1500 + comm-stream DtoD 1400-1450 + wait 1500-1600 + PtoP 1600-1650
#           = 1100-1650 = 550; hidden = 400; exposed = 150 (wait + PtoP); fused = the rows
#         launched inside all_gather_matmul.triton.fused[0] (all but the HtoD) = 1100-1700 = 600.
STEP0 = dict(step=0, step_s=1000, compute_s=400, comm_s=550, hidden_s=400, exposed_s=150,
             fused_s=550)
STEP1 = dict(step=1, step_s=1000, compute_s=450, comm_s=550, hidden_s=400, exposed_s=150,
             fused_s=600)
# The minimal variant has no MEMCPY table (no copies: C = 400, M = 1100-1600) and no RUNTIME
# table, so no row knows the range that launched it: fused is the fused kernel alone.
STEP0_MINIMAL = dict(STEP0, fused_s=0)
STEP1_NO_COPIES = dict(STEP1, compute_s=400, comm_s=500, exposed_s=100, fused_s=400)


def _check(step, want):
    got = step.as_dict()
    for key, value in want.items():
        expected = value if key == "step" else value * US
        assert got[key] == pytest.approx(expected, abs=1e-12), (key, got)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exact_metrics_from_every_schema_variant(tmp_path, variant):
    (trace,) = read_nsys_sqlite(write_nsys(worked_example(), tmp_path / "r.sqlite",
                                           variant=variant))
    report = analyze_rank(trace)
    assert report.mode == "device" and [s.step for s in report.steps] == [0, 1]
    _check(report.steps[0], STEP0_MINIMAL if variant == "minimal" else STEP0)
    _check(report.steps[1], STEP1_NO_COPIES if variant == "minimal" else STEP1)
    assert report.steps[0].overlap_pct == pytest.approx(100 * 400 / 550)
    assert report.steps[1].exposed_pct == pytest.approx(
        (10.0 if variant == "minimal" else 15.0))
    _check(report.total, dict(step_s=2000, compute_s=800 if variant == "minimal" else 850,
                              hidden_s=800, exposed_s=250 if variant == "minimal" else 300,
                              fused_s=400 if variant == "minimal" else 1150))


@pytest.mark.parametrize("variant", ["textid", "3.28.1"])
def test_exposed_rows_are_named_after_the_range_that_launched_them(tmp_path, variant):
    (trace,) = read_nsys_sqlite(write_nsys(worked_example(), tmp_path / "r.sqlite",
                                           variant=variant))
    top = [(t.range, t.kernel, round(t.exposed_s / US, 6), t.count)
           for t in analyze_rank(trace).top_exposed]
    assert top == [
        ("all_gather_matmul.chunked.comm[1]", "ncclDevKernel_AllGather_RING_LL", 150.0, 1),
        ("all_gather_matmul.triton.fused[0]", "overlap_signal_wait", 100.0, 1),
        ("all_gather_matmul.triton.fused[0]", "Memcpy PtoP (4096 B)", 50.0, 1)]


def test_without_launch_records_rows_keep_their_kernel_names(tmp_path):
    (trace,) = read_nsys_sqlite(write_nsys(worked_example(), tmp_path / "r.sqlite",
                                           variant="minimal"))
    top = [(t.range, t.kernel) for t in analyze_rank(trace).top_exposed]
    assert top == [("ncclDevKernel_AllGather_RING_LL", None), ("overlap_signal_wait", None)]


def test_schema_details(tmp_path):
    full = read_nsys_sqlite(write_nsys(worked_example(), tmp_path / "a.sqlite"))[0]
    assert full.schema_version == "3.28.1" and full.fmt == "nsys-sqlite"
    assert read_nsys_sqlite(write_nsys(worked_example(), tmp_path / "b.sqlite",
                                       variant="minimal"))[0].schema_version is None
    # The mark (eventType 34) spans the whole trace as "comm:mark"; the domain row has no end.
    assert not [s for s in full.spans if s.name in ("comm:mark", "NCCL")]
    kinds = {(s.name, s.track): s.kind for s in full.spans if s.copy is not None}
    assert kinds == {("Memcpy PtoP (4096 B)", "stream 0:20"): names.COMM,
                     ("Memcpy DtoD (4096 B)", "stream 0:7"): names.COMPUTE,
                     ("Memcpy DtoD (4096 B)", "stream 0:20"): names.COMM,
                     ("Memcpy HtoD (4096 B)", "stream 0:7"): None}
    wait = next(s for s in full.spans if s.name == "overlap_signal_wait")
    assert wait.device and wait.wait and wait.launch == 1060.0 and wait.launch_track == "thread 100"


def test_each_process_is_a_rank_numbered_by_device(tmp_path):
    k = 1000
    rows = [Range("step:0", 0, 100 * k, pid=300, tid=300),
            Kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 10 * k, 50 * k, device=1, pid=300),
            Range("step:0", 0, 100 * k, pid=200, tid=200),
            Kernel("sm80_gemm", 0, 40 * k, device=0, pid=200, stream=7),
            Kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 30 * k, 60 * k, device=0, pid=200,
                   stream=13)]
    traces = read_nsys_sqlite(write_nsys(rows, tmp_path / "r.sqlite"))
    assert [t.rank for t in traces] == [0, 1]
    r0, r1 = (analyze_rank(t).steps[0] for t in traces)
    _check(r0, dict(step=0, step_s=100, compute_s=40, comm_s=30, hidden_s=10, exposed_s=20))
    _check(r1, dict(step=0, step_s=100, compute_s=0, comm_s=40, hidden_s=0, exposed_s=40))


def test_events_from_nsys_sqlite_feeds_overlap_metrics(tmp_path):
    events = events_from_nsys_sqlite(write_nsys(worked_example(), tmp_path / "r.sqlite"))
    m = overlap_metrics(events)  # the sums of the two step windows
    assert m.step_s == pytest.approx(2000 * US) and m.compute_s == pytest.approx(850 * US)
    assert m.comm_s == pytest.approx(1100 * US)
    assert m.exposed_comm_s == pytest.approx(300 * US)
    assert m.hidden_fraction == pytest.approx(800 / 1100)


def _db(path, *statements):
    con = sqlite3.connect(path)
    for s in statements:
        con.execute(s)
    con.commit()
    con.close()
    return path


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"no NVTX_EVENTS or CUPTI_ACTIVITY_KIND_KERNEL table"):
        read_nsys_sqlite(_db(tmp_path / "empty.sqlite", "CREATE TABLE StringIds (id, value)"))
    with pytest.raises(ValueError, match=r"table NVTX_EVENTS has no column\(s\) end"):
        read_nsys_sqlite(_db(tmp_path / "old.sqlite", "CREATE TABLE NVTX_EVENTS (start, text)"))
    junk = tmp_path / "junk.sqlite"
    junk.write_text("not a database at all, just text " * 100)
    with pytest.raises(ValueError, match=r"junk.sqlite: (not an SQLite file|cannot read)"):
        read_nsys_sqlite(junk)


def test_a_report_is_exported_with_nsys_when_it_is_on_path(tmp_path, monkeypatch, capsys):
    src = write_nsys(worked_example(), tmp_path / "src.sqlite")
    report = tmp_path / "run.nsys-rep"
    report.write_bytes(b"binary report")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(ValueError, match=r"needs `nsys` on PATH"):
        export_report(report)
    # A stand-in `nsys` that checks the arguments and "exports" the prepared file.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nsys"
    fake.write_text(f"#!{sys.executable}\nimport shutil, sys\na = sys.argv[1:]\n"
                    "assert a[:3] == ['export', '--type', 'sqlite'], a\n"
                    "assert a[-1].endswith('run.nsys-rep'), a\n"
                    f"shutil.copy({str(src)!r}, a[a.index('--output') + 1])\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ.get("PATH", ""))
    out, tmp = export_report(report)
    try:
        _check(analyze_rank(read_nsys_sqlite(out)[0]).steps[1], STEP1)
    finally:
        shutil.rmtree(tmp)
    assert not tmp.exists()
    assert analyze.main([str(report), "--json"]) == 0  # the CLI exports, reads, cleans up
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    assert rank["source"] == str(report) and rank["total"]["hidden_s"] == pytest.approx(800 * US)
