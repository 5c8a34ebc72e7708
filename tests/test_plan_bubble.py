"""overlap.plan.bubble: the planner's per-stage replay of the project's schedules against
overlap.pp's own simulator and against the closed forms."""

import random

import pytest

from overlap.plan.bubble import (PP_NAMES, _replay, closed_form_bubble, peak_live,
                                 simulate_stages)
from overlap.pp import build_schedule, simulate

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

CASES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 7, 1), ("interleaved", 4, 8, 2),
         ("interleaved", 2, 6, 3), ("zb-h1", 4, 8, 1), ("zb-h1", 3, 5, 1)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_replay_equals_pp_simulator(name, p, m, v):
    """Uniform stage costs: the planner's replay must be overlap.pp.check.simulate."""
    costs = {"F": 1.3, "B": 2.1, "I": 1.2, "W": 0.9}
    ref = simulate(build_schedule(PP_NAMES[name], pp_size=p, num_microbatches=m,
                                  num_virtual=v), costs)
    mine = simulate_stages(name, p, m, v, [costs] * (p * v))
    assert mine.makespan == pytest.approx(ref.makespan, rel=1e-12)
    assert list(mine.busy) == pytest.approx(ref.busy, rel=1e-12)
    assert mine.bubble_fraction == pytest.approx(ref.bubble_fraction, rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 4])
def test_closed_forms(p, m_per_p):
    m = m_per_p * p
    fb = [{"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}] * p
    for name in ("gpipe", "1f1b"):
        sim = simulate_stages(name, p, m, 1, fb)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert sim.bubble_fraction == pytest.approx(closed_form_bubble(name, p, m))
    sim = simulate_stages("zb-h1", p, m, 1, fb)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    for v in (2, 3):
        sim = simulate_stages("interleaved", p, m, v, [{"F": 1.0, "B": 2.0}] * (p * v))
        assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
        assert sim.bubble_fraction == pytest.approx(closed_form_bubble("interleaved", p, m, v))


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_peak_live_matches_validator(name, p, m, v):
    sched = build_schedule(PP_NAMES[name], pp_size=p, num_microbatches=m, num_virtual=v)
    assert peak_live(name, p, m, v) == list(sched.peak_live_activations)


def test_heavier_last_stage_grows_the_bubble():
    """Per-stage costs matter: a last stage 30% heavier (the vocabulary projection) stretches
    1F1B's steady state to its own period, (m + p - 1) cycles become m heavy + p - 1 mixed."""
    p, m = 4, 16
    costs = [{"F": 1.0, "B": 2.0}] * (p - 1) + [{"F": 1.3, "B": 2.6}]
    sim = simulate_stages("1f1b", p, m, 1, costs)
    assert sim.makespan == pytest.approx(m * 3.9 + (p - 1) * 3.0)
    assert sim.bubble_fraction > closed_form_bubble("1f1b", p, m)


@pytest.mark.parametrize("name,p,v,m", [("1f1b", 4, 1, 41), ("zb-h1", 4, 1, 64),
                                        ("gpipe", 3, 1, 50), ("interleaved", 4, 2, 96),
                                        ("interleaved", 8, 2, 64)])
def test_steady_state_extrapolation_is_exact(name, p, v, m):
    rnd = random.Random(p * 100 + m)
    costs = [{k: rnd.uniform(1, 3) for k in "FBIW"} for _ in range(p * v)]
    full = _replay(name, p, m, v, tuple(costs))
    fast = simulate_stages(name, p, m, v, costs)
    assert fast.makespan == pytest.approx(full.makespan, rel=1e-9)
    assert list(fast.finish) == pytest.approx(list(full.finish), rel=1e-9)
    assert list(fast.busy) == pytest.approx(list(full.busy), rel=1e-9)


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="--schedule 'dualpipe'"):
        simulate_stages("dualpipe", 2, 4, 1, [{"F": 1, "B": 2}] * 2)
