"""One exposed-communication number: a synthetic two-rank trace with nested and overlapping
communication ranges, worked out by hand, and every consumer (metrics.analyze_rank,
trace.overlap_metrics behind the train profile table and overlap_metrics.json, the
overlap-analyze command line, the bench runner's trace column) gives the same numbers."""

import json
import re
import subprocess
import sys

import pytest

from bench.runner import TRACE_COLUMN, fill_trace_column
from overlap.profile import analyze
from overlap.profile.kineto import read_kineto
from overlap.profile.metrics import analyze_rank
from overlap.profile.synthetic import Range, write_chrome
from overlap.profile.trace import load_events, overlap_metrics

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

US = 1e-6
MAIN, SEND, HELP = 100, 200, 300  # the training thread and two communication threads
TP_GEMM = "all_gather_matmul.chunked.gemm[0]"
TP_WAIT = "matmul_reduce_scatter.chunked.comm[1].wait"


def _rows(rank):
    """Times in us (Range takes ns). Both ranks, step 0 [0, 1000):
      training thread: pp.stage0.F[0] 0-400 (holding the fused op's GEMM piece 100-300),
        comm_wait:pp.p2p 400-600 holding gloo:recv 420-580 holding gloo:recv 450-550,
        pp.stage0.B[0] 600-1000 holding the fused op's wait 700-750 holding gloo:all_reduce
        705-745;
      thread SEND: comm:pp.send 300-500 holding gloo:send 310-490;
      thread HELP: matmul_reduce_scatter.chunked.comm[1] 200-350.
    Between the steps (1000-1200, in no step): dp.grads.comm[0] on HELP 1050-1150.
    Step 1 [1200, 2000): HELP runs dp.grads.comm[1] 1500-1650; the training thread
      rank 0: pp.stage0.F[1] 1200-1600, comm_wait:dp.grads 1600-1700 holding
              dp.grads.comm[0].wait 1610-1690 holding gloo:all_reduce 1620-1680,
              compute:optimizer 1700-2000;
      rank 1: pp.stage0.F[1] 1200-2000 (it never waits)."""
    r = lambda name, a, b, tid=MAIN: Range(name, a * 1000, b * 1000, tid=tid)  # noqa: E731
    rows = [r("step:0", 0, 1000), r("pp.stage0.F[0]", 0, 400), r(TP_GEMM, 100, 300),
            r("comm_wait:pp.p2p", 400, 600), r("gloo:recv", 420, 580), r("gloo:recv", 450, 550),
            r("pp.stage0.B[0]", 600, 1000), r(TP_WAIT, 700, 750),
            r("gloo:all_reduce", 705, 745),
            r("comm:pp.send", 300, 500, SEND), r("gloo:send", 310, 490, SEND),
            r("matmul_reduce_scatter.chunked.comm[1]", 200, 350, HELP),
            r("dp.grads.comm[0]", 1050, 1150, HELP),
            r("step:1", 1200, 2000), r("dp.grads.comm[1]", 1500, 1650, HELP)]
    if rank == 0:
        rows += [r("pp.stage0.F[1]", 1200, 1600), r("comm_wait:dp.grads", 1600, 1700),
                 r("dp.grads.comm[0].wait", 1610, 1690), r("gloo:all_reduce", 1620, 1680),
                 r("compute:optimizer", 1700, 2000)]
    else:
        rows += [r("pp.stage0.F[1]", 1200, 2000)]
    return rows


# By hand (us). C = the training thread's compute ranges minus its comm ranges; M = the union
# of every comm range on any thread (nested ones once); exposed = |M - C|; hidden = |M & C|.
# Step 0 (both ranks): C = 0-400 + 600-1000 - (700-750) = 400 + 100 + 250 = 750;
#   M = HELP 200-350 + SEND 300-500 + wait 400-600 + 700-750 = 200-600 + 700-750 = 450;
#   hidden = 200-400 = 200; exposed = 400-600 + 700-750 = 250; fused (the training thread's
#   pieces of the fused TP ops) = 100-300 + 700-750 = 250.
# Step 1, rank 0: C = 1200-1600 + 1700-2000 = 700; M = 1500-1650 + 1600-1700 = 1500-1700 = 200;
#   hidden = 1500-1600 = 100; exposed = 1600-1700 = 100.
# Step 1, rank 1: C = 1200-2000 = 800; M = 1500-1650 = 150, all hidden; exposed = 0.
# The gap 1000-1200 lies in no step: its dp.grads.comm[0] counts nowhere.
# Rank 0: step 1000 + 800 = 1800, comm 450 + 200 = 650, hidden 300, exposed 350, fused 250:
#   exposed 350 / 1800 = 19.44% of the step.
# Rank 1: step 1800, comm 450 + 150 = 600, hidden 350, exposed 250, fused 250: 13.89%.
# Both: exposed (350 + 250) / (1800 + 1800) = 16.67% of the step; hidden (300 + 350) /
#   (650 + 600) = 52% of the communication.
# Each exposed instant is charged to the training thread's outermost comm range open then:
# rank 0: comm_wait:pp.p2p 200 (pp), comm_wait:dp.grads 100 (dp), TP_WAIT 50 (tp) = 350.
# Per kind, rank 0 (comm, hidden, exposed): pp = SEND 300-500 + 400-600 = 300-600: (300, 100,
#   200); tp = HELP 200-350 + 700-750: (200, 150, 50); dp = 1500-1700: (200, 100, 100).
# Rank 1: pp (300, 100, 200), tp (200, 150, 50), dp = 1500-1650: (150, 150, 0).
WANT = {0: dict(step_s=1800, comm_s=650, hidden_s=300, exposed_s=350, fused_s=250),
        1: dict(step_s=1800, comm_s=600, hidden_s=350, exposed_s=250, fused_s=250)}
KINDS = {0: {"pp": (300, 100, 200), "tp": (200, 150, 50), "dp": (200, 100, 100)},
         1: {"pp": (300, 100, 200), "tp": (200, 150, 50), "dp": (150, 150, 0)}}


@pytest.fixture()
def traces(tmp_path):
    for rank in (0, 1):
        write_chrome(_rows(rank), tmp_path / f"trace_rank{rank}.json", rank=rank)
    return tmp_path


def _us(d):
    return {k: round(v / US, 6) for k, v in d.items()}


def test_every_consumer_gives_the_hand_computed_exposed_time(traces, capsys):
    for rank in (0, 1):
        path = traces / f"trace_rank{rank}.json"
        total = analyze_rank(read_kineto(path)).total
        assert _us({k: getattr(total, k) for k in WANT[rank]}) == WANT[rank]
        assert total.exposed_pct == pytest.approx(100 * WANT[rank]["exposed_s"] / 1800)
        # The train profile table and overlap_metrics.json print these.
        m = overlap_metrics(load_events(path))
        assert _us(dict(step_s=m.step_s, comm_s=m.comm_s, hidden_s=m.hidden_comm_s,
                        exposed_s=m.exposed_comm_s, fused_s=m.fused_s)) == WANT[rank]
        assert m.exposed_fraction == pytest.approx(WANT[rank]["exposed_s"] / 1800)
        assert {k: tuple(round(v[f] / US, 6) for f in ("comm_s", "hidden_s", "exposed_s"))
                for k, v in m.by_kind.items()} == KINDS[rank]
    # The train summary's figure from the same traces (what it should print under --profile).
    from overlap.profile.trace import exposed_percent

    ranks = [overlap_metrics(load_events(traces / f"trace_rank{r}.json")) for r in (0, 1)]
    assert exposed_percent(ranks) == pytest.approx(100 * 600 / 3600)
    run = subprocess.run([sys.executable, "-m", "overlap.profile.analyze", str(traces)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    # The headline leads: the mean, then exposed % of the step per rank.
    assert lines[1].startswith("exposed communication: 16.7% of the step (0.150 of 0.900 ms "
                               "per step"), lines[:3]
    assert re.search(r"^ +0 +19\.4 +0\.350 +1\.800 +46\.2 +0\.250$", run.stdout, re.M)
    assert re.search(r"^ +1 +13\.9 +0\.250 +1\.800 +58\.3 +0\.250$", run.stdout, re.M)
    # The per-kind table over both ranks: exposed, its % of 3600 us, comm, hidden, hidden %.
    kinds = lines[lines.index(next(x for x in lines if x.startswith("kind"))) + 1:][:3]
    assert [x.split() for x in kinds] == [
        ["tp", "0.100", "2.8", "0.400", "0.300", "75.0"],
        ["pp", "0.400", "11.1", "0.600", "0.200", "33.3"],
        ["dp", "0.100", "2.8", "0.350", "0.250", "71.4"]]
    assert analyze.main([str(traces), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["exposed_pct"] == pytest.approx(100 * 600 / 3600)
    for r in report["ranks"]:
        assert _us({k: r["total"][k] for k in WANT[0]}) == WANT[r["rank"]]
    # The benches' trace column: 100 * hidden / comm over the row's steps on every rank.
    row = {"trace_steps": [0, 1]}
    fill_trace_column([row], str(traces))
    assert row[TRACE_COLUMN] == pytest.approx(100 * 650 / 1250)


def test_nested_and_concurrent_ranges_are_charged_once(traces):
    report = analyze_rank(read_kineto(traces / "trace_rank0.json"), top=10)
    top = [(t.range, round(t.exposed_s / US, 6), t.count, t.kind) for t in report.top_exposed]
    assert top == [("comm_wait:pp.p2p", 200, 1, "pp"), ("comm_wait:dp.grads", 100, 1, "dp"),
                   (TP_WAIT, 50, 1, "tp")]
    assert sum(t.exposed_s for t in report.top_exposed) == pytest.approx(report.total.exposed_s)


def test_fused_column_and_no_other_bucket_on_named_ranges(traces):
    report = analyze_rank(read_kineto(traces / "trace_rank0.json"))
    assert report.total.fused_s == pytest.approx(250 * US)
    assert [s.fused_s / US for s in report.steps] == pytest.approx([250, 0])
    # Every range is named (gloo:* ones are nested in named ranges), so there is no "other".
    assert list(report.by_kind) == ["tp", "pp", "dp"]
    assert {k: tuple(round(v[f] / US, 6) for f in ("comm_s", "hidden_s", "exposed_s"))
            for k, v in report.by_kind.items()} == KINDS[0]


def test_plot_draws_the_timeline(traces, tmp_path, capsys):
    png = tmp_path / "t.png"
    assert analyze.main([str(traces), "--plot", str(png)]) == 0
    assert "exposed communication: 16.7% of the step" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
