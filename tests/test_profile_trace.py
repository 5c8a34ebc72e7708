"""Overlap metrics from traces: exact on synthetic timelines, consistent on a real one."""

import json

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from overlap.profile.trace import load_events, overlap_metrics, union_length


def _ev(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_union_length():
    assert union_length([]) == 0
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([(5, 6), (0, 10)]) == 10


@pytest.mark.parametrize("comm, want_exposed", [
    ((20, 30), 0.0),      # entirely under the GEMM
    ((60, 20), 20.0),     # entirely after it: fully exposed
    ((40, 40), 30.0),     # half under (40..50), 30 us after (50..80)
])
def test_exposed_is_comm_not_under_compute(comm, want_exposed):
    events = [_ev("step:0", 0, 100), _ev("compute:gemm", 0, 50),
              _ev("gloo:all_reduce", comm[0], comm[1], tid=2)]
    m = overlap_metrics(events)
    assert m.step_s == pytest.approx(100e-6)
    assert m.comm_s == pytest.approx(comm[1] * 1e-6)
    assert m.exposed_comm_s == pytest.approx(want_exposed * 1e-6)
    assert m.hidden_comm_s == pytest.approx((comm[1] - want_exposed) * 1e-6)
    assert m.exposed_fraction == pytest.approx(want_exposed / 100)


def test_copier_thread_copies_are_not_compute():
    # aten::copy_ on a copier thread is communication work, not compute that hides it.
    events = [_ev("step:0", 0, 100), _ev("aten::copy_", 0, 100, tid=7),
              _ev("comm:copy_chunk", 0, 100, tid=7)]
    m = overlap_metrics(events)
    assert m.compute_s == 0 and m.exposed_comm_s == pytest.approx(100e-6)


def _profiled_step(path):
    from torch.profiler import ProfilerActivity, profile, record_function

    x, big = torch.randn(256, 256), torch.randn(2_000_000)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step:0"):
            h = dist.all_reduce(big, async_op=True)
            with record_function("compute:gemm"):
                for _ in range(4):
                    x = torch.tanh(x @ x)
            with record_function("comm_wait:all_reduce"):
                h.wait()
    out = f"{path}/trace{dist.get_rank()}.json"
    prof.export_chrome_trace(out)
    return out


def test_metrics_of_a_real_trace_are_consistent(tmp_path):
    for path in run_ranks(_profiled_step, 2, str(tmp_path)):
        m = overlap_metrics(load_events(path))
        assert m.comm_s > 0 and m.compute_s > 0 and m.step_s > 0
        assert 0 <= m.exposed_comm_s <= m.comm_s + 1e-12
        assert 0 <= m.exposed_fraction <= 1 and 0 <= m.hidden_fraction <= 1
        assert m.exposed_comm_s + m.hidden_comm_s == pytest.approx(m.comm_s)
        json.dumps(m.as_dict())


def test_comm_wait_accounts_outermost_waits_once():
    import time

    from overlap.profile.timers import comm_wait, exposed_seconds, reset_exposed

    reset_exposed()
    with comm_wait("outer"):
        time.sleep(0.02)
        with comm_wait("inner"):  # nested: must not be counted twice
            time.sleep(0.02)
    took = exposed_seconds()
    assert 0.04 <= took < 0.5
    time.sleep(0.02)  # outside any wait: not counted
    assert exposed_seconds() == took
    reset_exposed()
    assert exposed_seconds() == 0.0
