"""EP all-to-all hidden inside the pipeline schedules: forward/backward pairs that hand the host
to each other at every EP wait. The NCCL-order proof with EP communicators (two data-parallel
replicas of each pipeline rank share one, in equal and mixed header modes) over a grid of
schedules and EP op counts; orders that would hang are rejected; the interleaver runs exactly
the order the proof expands; the main job with pairs equals one process and the run without
pairs (the pairs reorder host work, not arithmetic: the losses are bit-identical)."""

import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from overlap.pp import build_schedule
from overlap.pp.interleave import Interleaver, PartnerFailed
from overlap.pp.programs import (NcclOrderDeadlock, _makespan, candidate_pairs, check_all,
                                 check_plans, ep_pairs, expand, rank_plan)
from overlap.pp.schedules import Action, Kind

GRID = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zb_h1") for p in (1, 2, 4)
        for m in (p, 2 * p, 3 * p + 1)]
GRID += [("interleaved_1f1b", p, m, 2) for p in (2, 4) for m in (p, 2 * p)]
EP_OPS = [{"F": 1, "B": 1, "I": 1, "W": 0}, {"F": 3, "B": 2, "I": 2, "W": 0},
          {"F": 0, "B": 2, "I": 1, "W": 1}]


@pytest.mark.parametrize("name, p, m, v", GRID)
def test_pairs_are_proven_with_ep_collectives_for_every_count(name, p, m, v):
    sched = build_schedule(name, pp_size=p, num_microbatches=m, num_virtual=v)
    pairs = ep_pairs(sched)
    for ops in EP_OPS:
        check_all(sched, pairs=pairs, ep_ops=ops)
    for r, prs in enumerate(pairs):
        comp = [a for a in sched.actions[r] if a.is_compute]
        for a, b in prs:
            assert comp.index(b) == comp.index(a) + 1 and a.microbatch != b.microbatch
            assert Kind.F in {a.kind, b.kind} and {a.kind, b.kind} - {Kind.F}
    none = [[] for _ in range(p)]
    if any(pairs):  # chosen because they shorten the step in the cost model
        assert _makespan(sched, pairs) < _makespan(sched, none)
    if m >= 2 * p and (p == 1 or name in ("zb_h1", "interleaved_1f1b")):
        # pp 1 pairs every steady-state F with a B; ZB-H1 a W (no input to wait for) with a
        # forward; interleaved a backward with a forward of another chunk: on every rank
        assert all(len(prs) >= 1 for prs in pairs), pairs


@pytest.mark.parametrize("p", [2, 4, 8])
def test_one_chunk_1f1b_keeps_its_all_to_alls_in_the_layers(p):
    """Plain 1F1B with p > 1: a forward paired with the backward next to it makes that
    backward's input (or the next stage) wait, which costs more than the all-to-all it hides
    in the cost model (and on the CPU twin), so no pair is chosen."""
    sched = build_schedule("1f1b", pp_size=p, num_microbatches=4 * p)
    assert ep_pairs(sched) == tuple(() for _ in range(p))
    every = [_disjoint_first(candidate_pairs(sched, r)) for r in range(p)]
    assert _makespan(sched, every) > _makespan(sched, [[] for _ in range(p)])


def _disjoint_first(cands):
    used, out = set(), []
    for a, b in cands:
        if a.kind == Kind.F and a not in used and b not in used:
            used |= {a, b}
            out.append((a, b))
    return out[:-1]  # the last stage's last F feeds its own B: keep the set feasible


def test_pairs_that_feed_each_other_are_a_deadlock():
    sched = build_schedule("1f1b", pp_size=2, num_microbatches=4)
    every = [[pr for pr in candidate_pairs(sched, 0) if pr[0].kind == Kind.F],
             [pr for pr in candidate_pairs(sched, 1) if pr[0].kind == Kind.B]]
    # rank 0 pairs (F1, B0) and rank 1 pairs (B0, F1): each needs what the other produces
    with pytest.raises(NcclOrderDeadlock, match="deadlock under NCCL ordering") as err:
        check_all(sched, pairs=every)
    assert "blocked at wait for ('data', ('grad', 0, 0))" in str(err.value)


@pytest.mark.parametrize("name, p, v", [("1f1b", 1, 1), ("interleaved_1f1b", 2, 2),
                                        ("interleaved_1f1b", 4, 2)])
def test_replicas_that_issue_ep_collectives_in_another_order_are_rejected(name, p, v):
    """A data-parallel replica that does not pair (or pairs differently) issues its EP
    collectives in another order: NCCL matches collectives by position, so this hangs or mixes
    data. The proof sees it even where each replica alone is fine."""
    sched = build_schedule(name, pp_size=p, num_microbatches=2 * p, num_virtual=v)
    pairs = ep_pairs(sched)

    def count(a):
        return 2 if a.kind in (Kind.F, Kind.B, Kind.I) else 0

    good = {(g, r): expand(rank_plan(sched, r, header_mode=g == 1, pairs=pairs[r]), count)
            for g in (0, 1) for r in range(p)}
    check_plans(good, where="same pairs, mixed header modes")
    bad = dict(good)
    for r in range(p):
        bad[(1, r)] = expand(rank_plan(sched, r, header_mode=False), count)
    with pytest.raises(NcclOrderDeadlock, match="EP order mismatch on the EP communicator") as e:
        check_plans(bad, where="replica 1 without pairs")
    assert re.search(r"EP op \d of .* on replica 0, EP op \d of .* on replica 1", str(e.value))


def test_expand_pins_the_interleaved_order():
    f, b = Action(Kind.F, 0, 1), Action(Kind.B, 0, 0)
    wait_b = ("wait", ("data", "grad"))
    send_f = ("post", (0, 1), (("data", "act", True),))
    flat = expand([("pair", f, b, (wait_b,), (send_f,))], lambda a: 2)
    assert flat == [("ep_post", (f, 0)), wait_b, ("ep_post", (b, 0)), ("ep_wait", (f, 0)),
                    ("ep_post", (f, 1)), ("ep_wait", (b, 0)), ("ep_post", (b, 1)),
                    ("ep_wait", (f, 1)), ("compute", f), send_f, ("ep_wait", (b, 1)),
                    ("compute", b)]


@pytest.mark.parametrize("n_main, n_helper, helper_first", [(2, 2, False), (3, 1, False),
                                                             (0, 2, True), (2, 0, True)])
def test_interleaver_runs_the_order_the_proof_expands(n_main, n_helper, helper_first):
    """Each action posts, switches, waits, as EPComm does; the interleaver's order of those
    events equals expand()'s for the same counts."""
    f, b = Action(Kind.F, 0, 1), Action(Kind.B, 0, 0)
    it, events = Interleaver(), []
    threads = set()

    def task(a, n):
        def run():
            threads.add(threading.get_ident())
            for k in range(n):
                events.append(("ep_post", (a, k)))
                it.switch()
                events.append(("ep_wait", (a, k)))
            events.append(("compute", a))
        return run

    counts = {f: n_main, b: n_helper}
    it.run(task(f, n_main), task(b, n_helper), helper_first=helper_first)
    first, second = (b, f) if helper_first else (f, b)
    assert events == expand([("pair", first, second, (), ())], counts.__getitem__)
    assert len(threads) == 2 and threading.get_ident() in threads
    it.switch()  # outside a pair: nothing happens


def test_a_failing_action_stops_its_partner_and_is_raised():
    it = Interleaver()
    reached = []

    def bad():
        it.switch()
        raise ValueError("stage 1 forward failed")

    def partner():
        reached.append("ran until its switch")
        it.switch()  # hands back to bad(), which fails: raises PartnerFailed here
        reached.append("never")

    before = threading.active_count()
    with pytest.raises(ValueError, match="stage 1 forward failed"):
        it.run(bad, partner)
    assert reached == ["ran until its switch"] and threading.active_count() == before
    with pytest.raises(PartnerFailed):
        it.run(lambda: it.switch(), lambda: (_ for _ in ()).throw(PartnerFailed("x")))


def _train(args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "overlap.train", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


TINY = ["--steps", "3", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len",
        "16", "--micro-batch-size", "2", "--micro-batches", "4", "--timeout", "240",
        "--moe-experts", "4", "--ep", "2"]


@pytest.mark.parametrize("layout", [["--tp", "1", "--pp", "1", "--dp", "2"],
                                    ["--tp", "1", "--pp", "2", "--dp", "2", "--schedule",
                                     "zb-h1"],
                                    ["--tp", "2", "--pp", "2", "--dp", "2", "--schedule",
                                     "interleaved", "--n-layer", "4"]])
def test_main_job_pairs_change_no_number(layout):
    """World sizes 2, 4 and 8 (1F1B at pp 1, ZB-H1's weight passes paired with forwards,
    interleaved): the run with pairs and the run without, steps interleaved, give
    bit-identical losses (each micro-batch's arithmetic and the order of gradient
    accumulation are unchanged); the summary reports the pairs and both exposed times."""
    res = _train([*TINY, *layout, "--compare-ep-overlap"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "max |loss difference| between the two runs: 0.00e+00" in out, out
    m = re.search(r"EP pairs on +([\d.]+) +([\d.]+)\nEP pairs off +([\d.]+) +([\d.]+)", out)
    assert m and all(float(x) >= 0 for x in m.groups()), out
    pairs = re.search(r"in-schedule EP pairs +(\d+) per step on pp rank 0", out)
    assert pairs and int(pairs.group(1)) >= 1, out


def test_compare_ep_overlap_refuses_what_it_cannot_compare():
    for extra, words in ((["--no-ep-pipeline-overlap"], "--ep > 1 and --ep-pipeline-overlap"),
                         (["--compare-no-overlap"], "pass one of them")):
        res = _train([*TINY, "--compare-ep-overlap", *extra])
        assert res.returncode != 0 and words in res.stderr, res.stderr[-2000:]


def _pipeline_rank(with_pairs: bool, fail: str | None = None, timeout: float = 30.0,
                   backend: str = "chunked"):
    """One 1F1B step (pp 1, m 4) of a 2-block MoE GPT on the EP group of every rank, data
    different per rank; returns (loss, gradients, pairs, switches) or, with ``fail`` (a rank's
    forward raising in its third micro-batch), (seconds, error text)."""
    import time

    import torch
    import torch.distributed as dist

    from overlap.dist import ParallelDims
    from overlap.models.gpt import GPT, GPTConfig, gpt_loss
    from overlap.pp import Pipeline, pipeline_stages

    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims.build(dp=world, ep=world)
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=2,
                    moe_experts=4, moe_top_k=2)
    torch.manual_seed(0)
    extra = dict(max_tokens=32, lanes=2) if backend == "symmetric" else {}
    comm = dims.ep_comm(timeout=timeout, backend=backend, **extra)
    model = GPT(cfg, ep_comm=comm)
    stages = pipeline_stages(model, pp_group=dims.pp_group)
    sched = build_schedule("1f1b", pp_size=1, num_microbatches=4)
    pipe = Pipeline(stages, sched, loss_fn=gpt_loss, pp_group=dims.pp_group,
                    ep_comms=[comm] if with_pairs else [])
    pipe.interleaver.trace = []
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 64, (4, 2, 17), generator=gen)
    x, y = list(ids[:, :, :-1]), list(ids[:, :, 1:])
    try:
        if fail is not None:
            pipe.step(x, y)  # a good step first
            calls = []

            def hook(*_):
                calls.append(1)
                if rank == int(fail) and len(calls) == 3:
                    raise ValueError(f"injected failure in the forward on rank {rank}")

            model.blocks[1].register_forward_hook(hook)
            t0 = time.monotonic()
            try:
                pipe.step(x, y)
            except Exception as exc:  # noqa: BLE001 - the test reads the message
                return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
            return time.monotonic() - t0, "returned"
        out = pipe.step(x, y)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.loss.item(), grads, len(pipe.pairs), list(pipe.interleaver.trace)
    finally:
        pipe.close()
        comm.close()


@pytest.mark.parametrize("world, backend", [(1, "chunked"), (2, "chunked"), (4, "chunked"),
                                            (2, "symmetric"), (4, "symmetric")])
def test_pipeline_pairs_equal_the_sequential_step_bit_for_bit(world, backend):
    """A pair reorders host work, never arithmetic: the loss and every gradient equal the
    unpaired step's exactly; at EP > 1 the actions hand over at their EP waits (the symmetric
    exchange with a workspace per direction, lanes=2)."""
    from harness import run_ranks

    on = run_ranks(_pipeline_rank, world, True, None, 30.0, backend, timeout=120)
    off = run_ranks(_pipeline_rank, world, False, None, 30.0, backend, timeout=120)
    for (loss_on, g_on, pairs, trace), (loss_off, g_off, pairs_off, _) in zip(on, off):
        assert pairs == 3 and pairs_off == 0  # F1B0, F2B1, F3B2 on the only stage
        assert loss_on == loss_off and g_on.keys() == g_off.keys() and len(g_on) > 0
        for name in g_on:
            assert torch.equal(g_on[name], g_off[name]), name
        if world > 1:
            # both actions of each pair switched at their waits, in turns
            assert {"F1s0", "B0s0"} <= set(trace) and len(trace) >= 6, trace


@pytest.mark.parametrize("world", [2, 4])
def test_a_failure_inside_a_pair_fails_every_rank_within_the_timeout(world):
    from harness import run_ranks_outcomes

    timeout = 3.0
    outcomes = run_ranks_outcomes(_pipeline_rank, world, True, "1", timeout, timeout=120,
                                  grace=30)
    for out in outcomes:
        assert out.status == "ok", (out.status, out.error)
        took, msg = out.value
        if out.rank == 1:
            assert msg.startswith("ValueError: injected failure in the forward on rank 1"), msg
        else:
            assert msg.startswith("RuntimeError") and "ep moe" in msg, msg
            assert f"(rank {out.rank})" in msg and "timed out" in msg, msg
        # a peer's failure is seen at an EP wait; the pair's partner may sit in one more wait
        assert took <= 2 * timeout + 2, (took, msg)


def _symmetric_refused():
    import torch.distributed as dist

    from overlap.dist import ParallelDims
    from overlap.models.gpt import GPT, GPTConfig, gpt_loss
    from overlap.pp import Pipeline, pipeline_stages

    dims = ParallelDims.build(dp=dist.get_world_size(), ep=dist.get_world_size())
    comm = dims.ep_comm(backend="symmetric", max_tokens=32)
    try:
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=1, n_head=2,
                              moe_experts=4, moe_top_k=2), ep_comm=comm)
        with pytest.raises(ValueError) as err:
            Pipeline(pipeline_stages(model, pp_group=dims.pp_group),
                     build_schedule("1f1b", pp_size=1, num_microbatches=2), loss_fn=gpt_loss,
                     pp_group=dims.pp_group, ep_comms=[comm])
        return str(err.value)
    finally:
        comm.close()


def test_a_single_lane_symmetric_exchange_is_refused_as_a_pair():
    from harness import run_ranks

    for msg in run_ranks(_symmetric_refused, 2, timeout=60):
        assert "cannot overlap across micro-batches" in msg and "lanes=2" in msg, msg


def _pairs_disagree():
    import torch.distributed as dist

    from overlap.dist import ParallelDims
    from overlap.models.gpt import GPT, GPTConfig, gpt_loss
    from overlap.pp import Pipeline, pipeline_stages

    dims = ParallelDims.build(dp=dist.get_world_size(), ep=dist.get_world_size())
    comm = dims.ep_comm(timeout=30.0)
    try:
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=1, n_head=2,
                              moe_experts=4, moe_top_k=2), ep_comm=comm)
        m = 4 if dist.get_rank() == 0 else 6  # another program: other pairs, another EP order
        with pytest.raises(ValueError) as err:
            Pipeline(pipeline_stages(model, pp_group=dims.pp_group),
                     build_schedule("1f1b", pp_size=1, num_microbatches=m), loss_fn=gpt_loss,
                     pp_group=dims.pp_group, ep_comms=[comm])
        return str(err.value)
    finally:
        comm.close()


def test_ep_ranks_whose_pairs_differ_are_refused_on_every_rank():
    """Pipeline replicas that would issue their EP collectives in different orders (here
    another micro-batch count, so other pairs) fail at construction on every EP rank."""
    from harness import run_ranks

    for rank, msg in enumerate(run_ranks(_pairs_disagree, 2, timeout=60)):
        assert "pp Pipeline(ep_comms=...): the EP ranks disagree on" in msg, msg
        assert "schedule_and_pairs" in msg and "num_microbatches: [4, 6]" in msg, msg
        assert f"(rank {rank})" in msg, msg
