"""A pipeline rank that dies mid-step fails every survivor fast, naming the dead rank.

Every schedule at pp 4 and a subset at pp 8; the victim is a middle or an end rank and dies by
``os._exit`` or SIGKILL at its first stage's second forward of the second step (the first step
is healthy), on nccl_twin (the harness's transport) and in two cases on plain gloo.
Each survivor must raise ``P2PError`` naming the dead rank within ``DETECT_S`` of the death:
the later of the victim's stamp (``time.time()`` in a file just before dying) and the launcher
seeing its exit (a loaded machine may run the exit seconds after the stamp); a survivor's raise time
is ``time.time()`` as it catches the error; it then stays alive until every survivor has
caught one, so nobody learns of the death from a neighbour's exit. The neighbours learn from
their broken channel, the others from the failure record that the first rank to fail publishes
in the job's store (overlap.pp.p2p), not from the P2P timeout (60 s).
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from overlap.dist.launch import launch
from overlap.pp import Pipeline, PipelineStage, build_schedule
from overlap.pp.schedules import SCHEDULES
from tests import harness

WIDTH = 8
TIMEOUT_S = 60.0  # the P2P timeout: a survivor that waits it out fails the test
# Detection bound: the neighbours see a closed connection at once, the others poll the store
# every POLL_S (0.05 s); 2 s leaves the rest to a loaded 2-core machine's scheduling.
DETECT_S = 2.0
LINGER_S = 3 * DETECT_S  # longer than a survivor may take, so no exit rescues a late one


def _body(name: str, p: int, victim: int, mode: str, death_file: str):
    rank = dist.get_rank()
    v = 2 if name == "interleaved_1f1b" else 1
    sched = build_schedule(name, pp_size=p, num_microbatches=p, num_virtual=v)
    torch.manual_seed(0)
    mods = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(sched.num_stages)]
    stages = [PipelineStage(mods[s], stage_index=s, num_stages=sched.num_stages,
                            pp_group=dist.group.WORLD) for s in sched.stages_of(rank)]
    pipe = Pipeline(stages, sched, loss_fn=torch.nn.functional.mse_loss,
                    pp_group=dist.group.WORLD, timeout=TIMEOUT_S)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(p, WIDTH, generator=g), torch.randn(p, WIDTH, generator=g)
    pipe.step(x, y)
    dist.barrier()
    if rank == victim and mode == "between":  # dies between steps: no transfer in flight
        time.sleep(0.3)  # the others are waiting for the next step's shape digest
        with open(death_file, "w") as f:
            f.write(repr(time.time()))
        os._exit(7)
    if rank == victim:
        forwards = []

        def die(*_):
            forwards.append(1)
            if len(forwards) < 2:
                return
            with open(death_file, "w") as f:
                f.write(repr(time.time()))
            if mode == "exit":
                os._exit(7)
            os.kill(os.getpid(), signal.SIGKILL)

        stages[0].module.register_forward_pre_hook(die)
    outcome, caught = _step(pipe, x, y), time.time()
    # A failure stays a failure: the next step raises at once, naming the same rank.
    again = _step(pipe, x, y)
    again_s = time.time() - caught
    # Stay alive (channels open) until every survivor has its error, as a rank of a real job
    # does while it reports: a survivor must not learn of the death from a neighbour's exit.
    store = dist.distributed_c10d._get_default_store()
    store.add("pp_failures/caught", 1)
    end = time.monotonic() + LINGER_S
    while store.add("pp_failures/caught", 0) < p - 1 and time.monotonic() < end:
        time.sleep(0.02)
    return caught, outcome, again_s, again


def _step(pipe: Pipeline, x, y) -> str:
    try:
        pipe.step(x, y)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}"
    return "returned"


# Every schedule at pp 4 (a middle and an end rank, both ways of dying); at pp 8 every schedule
# once, with both ways of dying and three victims; plain gloo (whose transfers complete only
# inside wait, so a helper thread waits for them) once each way.
CASES = ([(4, name, victim, mode, "twin") for name in sorted(SCHEDULES) for victim in (1, 3)
          for mode in ("exit", "sigkill")]
         + [(8, "1f1b", 3, "exit", "twin"), (8, "1f1b", 3, "sigkill", "twin"),
            (8, "gpipe", 7, "sigkill", "twin"), (8, "zb_h1", 7, "exit", "twin"),
            (8, "interleaved_1f1b", 0, "sigkill", "twin"),
            (4, "1f1b", 1, "exit", "gloo"), (4, "zb_h1", 3, "sigkill", "gloo"),
            # pp rank 0 dies between two steps: the others wait for its shape digest
            (4, "1f1b", 0, "between", "twin"), (2, "gpipe", 0, "between", "twin")])


@pytest.mark.parametrize("p,name,victim,mode,transport", CASES)
def test_every_survivor_names_the_dead_rank(tmp_path, p, name, victim, mode, transport):
    death_file = str(tmp_path / "death")
    args = (_body, p, name, p, victim, mode, death_file)
    if transport == "twin":
        outcomes = harness.run_ranks_outcomes(*args, timeout=90, grace=LINGER_S + 5)
    else:
        outcomes = launch(_body, p, args=args[2:], timeout=90, grace=LINGER_S + 5,
                          raise_on_error=False, backend="gloo", preload=harness._PRELOAD)
    assert outcomes[victim].status == "died", outcomes[victim]
    with open(death_file) as f:
        stamped = float(f.read())
    # The death: the victim stamps the time just before it exits, but on a loaded machine its
    # exit (and the teardown that closes its connections and makes its pid dead) may run
    # seconds later; the launcher sees the exit at once (the process sentinel), so the later
    # of the two is when the others could know.
    died_at = max(stamped, outcomes[victim].finished_at)
    dead = f"pp rank {victim} (global rank {victim})"
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.status == "ok", (o.rank, o.status, o.error)
        caught, error, again_s, again = o.value
        for e in (error, again):
            assert e.startswith("P2PError"), (o.rank, e)
            # The dead rank is named first: a relaying neighbour is not the culprit.
            assert dead in e.split(";")[0], (o.rank, e)
        assert caught - died_at < DETECT_S, (o.rank, caught - died_at, error)
        assert again_s < DETECT_S, (o.rank, again_s, again)
