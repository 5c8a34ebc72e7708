"""Every pipeline schedule under NCCL's ordering rules (the nccl_twin transport), p = 2 and 4:
one step completes and equals the unsplit model. The executor that posted one batch per
compute gap hung here in 1F1B, interleaved 1F1B and ZB-H1 (12 of 16 cases)."""

import pytest

from harness import run_ranks
from tests.test_pp_executor import SEQ, _check_schedules

GRID = [(name, p, m, v) for p in (2, 4) for m in (p, 2 * p)
        for name, v in (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2))]


@pytest.mark.parametrize("name, p, m, v", GRID, ids=[f"{n}-p{p}-m{m}" for n, p, m, _ in GRID])
def test_schedule_completes_under_nccl_order(name, p, m, v):
    results = run_ranks(_check_schedules, p, [(name, m, v, (SEQ, SEQ))], p * v,
                        backend="nccl_twin", timeout=90)
    assert len(results[-1]) == 2  # two steps, each loss equal to the reference
