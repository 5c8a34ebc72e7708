"""The metric definitions (overlap/profile/metrics.py) on small hand-made timelines."""

import pytest

from overlap.profile import names
from overlap.profile.kineto import spans_from_events
from overlap.profile.metrics import analyze_rank, exposed_intervals, lane_of, summary
from overlap.profile.spans import RankTrace, intersect, merge, subtract

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

US = 1e-6


def _ev(name, ts, dur, tid=1, **kw):
    return {"ph": "X", "cat": kw.pop("cat", "user_annotation"), "name": name, "ts": ts,
            "dur": dur, "tid": tid, "pid": 1, **kw}


def _kernel(name, ts, dur, stream, corr=None):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0,
            "tid": stream, "args": {"device": 0, "stream": stream, "correlation": corr}}


def _launch(ts, corr, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "tid": tid, "pid": 1, "args": {"correlation": corr}}


def _report(events, top=5):
    return analyze_rank(RankTrace(0, spans_from_events(events), "mem", "kineto"), top=top)


def _us(m):
    return {k: round(v / US, 9) for k, v in m.as_dict().items()
            if k.endswith("_s")}


def test_interval_arithmetic():
    a = merge([(0, 10), (5, 20), (30, 40), (40, 45), (50, 50)])
    assert a == [(0, 20), (30, 45)]
    assert intersect(a, [(10, 35), (44, 60)]) == [(10, 20), (30, 35), (44, 45)]
    assert subtract(a, [(5, 8), (15, 32), (44, 60)]) == [(0, 5), (8, 15), (32, 44)]


def test_host_fused_range_counts_as_compute_except_its_waits():
    # A fused range 10-60 waits 30-40 inside; compute 60-90; a copy thread moves 50-80.
    events = [_ev("step:0", 0, 100), _ev("ag.triton.fused[0]", 10, 50),
              _ev("comm_wait:tp.triton", 30, 10), _ev("compute:tail", 60, 30),
              _ev("ag.symmetric.comm[1]", 50, 30, tid=2)]
    (m,) = _report(events).steps
    # C = 10-30, 40-90 (70); M = fused 10-60 + copy 50-80 = 10-80 (70); hidden = 60.
    assert _us(m) == dict(step_s=100, compute_s=70, comm_s=70, hidden_s=60, exposed_s=10,
                          fused_s=50)


def test_communication_on_the_training_thread_is_not_compute():
    # aten ops inside a wait (the copier's work done by the waiting thread) are communication.
    events = [_ev("step:0", 0, 100), _ev("compute:gemm", 0, 100),
              _ev("comm_wait:tp.copier", 40, 20), _ev("aten::copy_", 45, 10, cat="cpu_op")]
    (m,) = _report(events).steps
    assert _us(m) == dict(step_s=100, compute_s=80, comm_s=20, hidden_s=0, exposed_s=20,
                          fused_s=0)


def test_device_rows_belong_to_the_step_that_launched_them():
    events = [_ev("step:0", 0, 100), _ev("step:1", 100, 100),
              _launch(90, 7), _kernel("sm80_gemm", 150, 30, stream=7, corr=7),  # host ran ahead
              _kernel("ncclDevKernel_AllReduce", 110, 60, stream=13),  # no launch record
              _kernel("sm80_gemm", 10, 20, stream=7)]
    s0, s1 = _report(events).steps
    assert _us(s0) == dict(step_s=180, compute_s=50, comm_s=0, hidden_s=0, exposed_s=0,
                           fused_s=0)  # the window runs to the end of the row it launched
    assert _us(s1) == dict(step_s=100, compute_s=0, comm_s=60, hidden_s=0, exposed_s=60,
                           fused_s=0)


def test_steps_prefer_our_ranges_and_fall_back_to_profiler_steps():
    ours = [_ev("ProfilerStep#5", 0, 200), _ev("step:3", 10, 50), _ev("step:4", 60, 100),
            _ev("compute:x", 0, 200)]
    assert [s.step for s in _report(ours).steps] == [3, 4]
    theirs = [_ev("ProfilerStep#5", 0, 200), _ev("compute:x", 0, 200)]
    assert [(s.step, s.step_s) for s in _report(theirs).steps] == [(5, 200 * US)]
    none = [_ev("compute:x", 0, 50), _ev("gloo:all_reduce", 25, 50, tid=3)]
    (whole,) = _report(none).steps
    assert whole.step is None and _us(whole)["step_s"] == 75 and _us(whole)["exposed_s"] == 25


def test_top_exposed_lists_the_outermost_range_and_sums_over_steps():
    events = []
    for i in range(3):
        t = 100 * i
        events += [_ev(f"step:{i}", t, 100), _ev("compute:gemm", t, 50),
                   _ev("ag.chunked.comm[1].wait", t + 50, 20),
                   _ev("comm_wait:tp.chunked", t + 52, 16),
                   _ev("dp.grads.comm[0].wait", t + 80, 5)]
    r = _report(events, top=1)
    assert [(t.range, t.count, round(t.exposed_s / US, 9)) for t in r.top_exposed] == [
        ("ag.chunked.comm[1].wait", 3, 60.0)]
    assert len(_report(events, top=5).top_exposed) == 2
    assert _us(r.total)["exposed_s"] == 75 and _us(r.total)["step_s"] == 300


def test_lanes_and_exposed_intervals():
    events = [_ev("step:0", 0, 100), _ev("compute:gemm", 0, 50),
              _ev("comm_wait:x", 50, 10), _ev("gloo:all_reduce", 20, 60, tid=5),
              _ev("ag.symmetric.comm[0]", 30, 10, tid=6), _ev("aten::add", 0, 5, tid=6,
                                                                 cat="cpu_op")]
    trace = RankTrace(0, spans_from_events(events), "mem", "kineto")
    main = "thread 1"
    lanes = {s.name: lane_of(s, main, False) for s in trace.spans}
    assert lanes == {"step:0": None, "compute:gemm": "compute", "comm_wait:x": "wait",
                     "gloo:all_reduce": "comm", "ag.symmetric.comm[0]": "copy",
                     "aten::add": None}
    assert exposed_intervals(trace) == [(50, 80)]
    kernels = spans_from_events([_kernel("overlap_signal_wait", 0, 5, 3),
                                 _kernel("_all_gather_matmul_kernel", 0, 5, 4),
                                 _kernel("ncclDevKernel_x", 0, 5, 5),
                                 _ev("comm:launch", 0, 1)])
    assert [lane_of(s, main, True) for s in kernels] == ["wait", "fused", "comm", None]


def test_summary_is_the_mean_per_step_over_ranks():
    a = _report([_ev("step:0", 0, 100), _ev("compute:x", 0, 100), _ev("comm:y", 50, 100, 2)])
    b = _report([_ev("step:0", 0, 200), _ev("comm:y", 0, 50, 2)])
    s = summary([a, b])
    assert s["step_s"] == pytest.approx(150 * US) and s["num_windows"] == 2
    # a: its comm is clipped to the step (50-100) and hidden; b: 50 us exposed.
    assert s["exposed_s"] == pytest.approx(25 * US) and s["hidden_s"] == pytest.approx(25 * US)
    assert s["overlap_pct"] == pytest.approx(100 * 50 / 100)
    assert s["exposed_pct"] == pytest.approx(100 * 50 / 300)
    assert names.classify_range("comm:y").kind == names.COMM


def test_communication_by_kind_reports_how_much_of_each_hid():
    # compute 0-100 on the training thread except a reload wait 70-80; the offload copies run
    # on the copy threads: d2h 20-50 (under compute), h2d 60-80 (60-70 under compute, 70-80
    # waited for); a pipeline send 90-110 (90-100 hidden).
    events = [_ev("step:0", 0, 120), _ev("compute:blocks", 0, 100),
              _ev("comm_wait:offload.reload", 70, 10), _ev("offload.d2h.comm", 20, 30, tid=2),
              _ev("offload.h2d.comm", 60, 20, tid=3), _ev("pp.stage0.comm[send]", 90, 20,
                                                           tid=4)]
    r = _report(events)
    got = {g: (round(v["comm_s"] / US, 9), round(v["hidden_s"] / US, 9),
               round(v["exposed_s"] / US, 9)) for g, v in r.by_kind.items()}
    # offload: 20-50 and 60-80 (the wait 70-80 inside it) = 50, hidden 30 + 10 = 40, exposed
    # the wait 70-80; pp: exposed 100-110, after the compute
    assert got == {"pp": (20, 10, 10), "offload": (50, 40, 10)}
    assert r.as_dict()["by_kind"]["offload"]["hidden_s"] == pytest.approx(40 * US)
