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


def _disagree(which):
    import time

    import torch.distributed as dist

    from overlap.models import gpt_loss
    from overlap.pp import Pipeline, build_schedule, pipeline_stages
    from tests.test_pp_executor import _model

    r = dist.get_rank()
    name, m, v = "1f1b", 2, 1
    if which == "schedule" and r == 1:
        name = "gpipe"
    if which == "num_microbatches" and r == 1:
        m = 4
    if which == "num_virtual":
        name, v = "interleaved_1f1b", 1 + r
    stages = pipeline_stages(_model(4), pp_group=dist.group.WORLD, num_virtual=v)
    sched = build_schedule(name, pp_size=2, num_microbatches=m, num_virtual=v)
    t0 = time.monotonic()
    try:
        Pipeline(stages, sched, loss_fn=gpt_loss, pp_group=dist.group.WORLD, timeout=30)
    except ValueError as exc:
        return str(exc), time.monotonic() - t0
    return "constructed", time.monotonic() - t0


@pytest.mark.parametrize("which, values", [
    ("schedule", ("'1f1b'", "'gpipe'")), ("num_microbatches", ("2", "4")),
    ("num_virtual", ("1", "2"))])
def test_ranks_that_disagree_fail_at_construction(which, values):
    for msg, seconds in run_ranks(_disagree, 2, which):
        assert seconds < 5, msg
        assert f"the pp ranks disagree on {which}" in msg
        assert f"pp rank 0 has {values[0]}" in msg and f"pp rank 1 has {values[1]}" in msg
