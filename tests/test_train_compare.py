"""`overlap-train --compare-no-overlap`: the same model trained twice with steps interleaved,
every overlap on and every overlap off, reporting both; the two runs compute the same losses
(the no-overlap run is the same math: unfused TP collectives, DP reduction after the backward,
parameter gathers waited at once)."""

import re

import pytest

from overlap.train.__main__ import _comparison
from overlap.train.config import ConfigError, TrainConfig
from test_train import TINY, _run

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")


def test_compare_no_overlap_reports_both_runs_with_equal_losses():
    res = _run([*TINY, "--steps", "4", "--compare-no-overlap"])
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    on = re.search(r"every overlap on\s+([\d.]+)\s+([\d.]+)%", out)
    off = re.search(r"every overlap off\s+([\d.]+)\s+([\d.]+)%", out)
    assert on and off, out[-2000:]
    speed = re.search(r"speed-up\s+([\d.]+)x", out)
    assert float(speed.group(1)) == pytest.approx(float(off.group(1)) / float(on.group(1)),
                                                  abs=0.01)
    diff = float(re.search(r"max \|loss difference\| between the two runs: (\S+)", out).group(1))
    assert diff <= 1e-4, out[-2000:]


def test_comparison_medians_and_ratio():
    rec = lambda s, ms, ex, loss: dict(step=s, step_s=ms / 1e3, exposed_fraction=ex,  # noqa: E731
                                       tokens_per_s=1e3 / ms, loss=loss)
    on = [rec(0, 900, 0.9, 5.0), rec(1, 100, 0.2, 4.0), rec(2, 120, 0.3, 3.0),
          rec(3, 110, 0.1, 2.0)]
    off = [rec(0, 950, 0.9, 5.0), rec(1, 200, 0.6, 4.0), rec(2, 220, 0.5, 3.5),
           rec(3, 210, 0.4, 2.0)]
    text = _comparison(on, off)
    # medians over steps >= 1
    assert re.search(r"every overlap on\s+110\.0\s+20\.0%", text), text
    assert re.search(r"every overlap off\s+210\.0\s+50\.0%", text), text
    assert "1.91x" in text and "5.00e-01" in text


@pytest.mark.parametrize("extra", [["--check"], ["--profile", "/tmp/x"], ["--save", "/tmp/y"],
                                   ["--tp-backend", "unfused"]])
def test_compare_refuses_flags_it_cannot_combine_with(extra):
    from overlap.train.config import parse_args

    with pytest.raises((ConfigError, SystemExit)):
        parse_args(["--compare-no-overlap", *extra])
