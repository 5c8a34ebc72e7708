"""overlap-train and overlap-selftest under srun, emulated on CPU: SLURM's compressed node lists
and task counts, its variables mapped onto torchrun's (precedence, the block layout, tp per
node, every inconsistency named), and the commands started as N local "tasks" that each carry
the environment srun would give them."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from overlap.dist.dims import ParallelDims
from overlap.dist.slurm import (SlurmError, adopt, default_port, expand_hostlist,
                                expand_tasks_per_node, is_slurm_step, read_step)
from train_cli import check_diffs

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")

TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "2", "--timeout", "60"]


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu-[001-003]-x", ["gpu-001-x", "gpu-002-x", "gpu-003-x"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("a[1,3],b[2-3]c,d.e-f", ["a1", "a3", "b2c", "b3c", "d.e-f"]),
    ("  x[0],y  ", ["x0", "y"]),
])
def test_hostlist_forms(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, match", [
    ("", "is empty"), ("node[1-2", "unclosed"), ("node1-2]", "without"),
    ("node[1[2]]", "nested"), ("node[2-1]", "ends before it starts"),
    ("node[a-b]", "is not N or N-M"), ("node[]", "is not N or N-M"),
    ("node[1-2,]", "is not N or N-M"), ("a,,b", "empty entry"), ("a,", "empty entry"),
    ("no de", "cannot have"), ("n(1)", "cannot have"), ("n[1-99999999]", "more than"),
])
def test_hostlist_errors(text, match):
    with pytest.raises(SlurmError, match=match):
        expand_hostlist(text)


@pytest.mark.parametrize("text, counts", [
    ("8", [8]), ("2(x3),1", [2, 2, 2, 1]), ("1(x4)", [1, 1, 1, 1]), ("4,2(x2),3", [4, 2, 2, 3]),
])
def test_tasks_per_node_forms(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "0", "2(x0)", "2x3", "2(3)", "a", "2,,1", "-1"])
def test_tasks_per_node_errors(text):
    with pytest.raises(SlurmError, match="is not N or N"):
        expand_tasks_per_node(text)


def test_default_port_is_unprivileged_deterministic_and_apart():
    ports = {default_port(str(job), str(step)) for job in range(123000, 124000)
             for step in range(15)}
    assert len(ports) == 15000 and min(ports) >= 15000 and max(ports) < 30000
    assert default_port("987654", "3") == default_port("987654", "3")
    assert 15000 <= default_port("123_4", None) < 30000  # not a number: hashed


def _env(rank, tasks=(2, 2), nodes="node[01-02]", **extra):
    """What srun gives task ``rank`` of a block-distributed step."""
    node = max(i for i in range(len(tasks)) if sum(tasks[:i]) <= rank)
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(sum(tasks)),
           "SLURM_LOCALID": str(rank - sum(tasks[:node])), "SLURM_NODEID": str(node),
           "SLURM_NNODES": str(len(tasks)), "SLURM_JOB_NODELIST": nodes,
           "SLURM_TASKS_PER_NODE": ",".join(map(str, tasks)), "SLURM_JOB_ID": "4242",
           "SLURM_STEP_ID": "1"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize("tasks, nodes", [((2, 2), "node[01-02]"), ((4, 4, 2), "g[1-3]"),
                                          ((1, 1, 1), "a,b,c"), ((6,), "solo")])
def test_every_task_maps_to_its_block_rank(tasks, nodes):
    names = expand_hostlist(nodes)
    world = sum(tasks)
    steps = [read_step(_env(r, tasks, nodes), tp=1) for r in range(world)]
    assert [s.rank for s in steps] == list(range(world))
    for s in steps:
        assert (s.world_size, s.nodes, s.tasks_per_node) == (world, tuple(names), tasks)
        assert s.local_world_size == tasks[s.node_rank]
        assert s.rank == sum(tasks[:s.node_rank]) + s.local_rank
        assert (s.master_addr, s.master_port) == (names[0], default_port("4242", "1"))
        assert s.torch_env() == {"RANK": str(s.rank), "WORLD_SIZE": str(world),
                                 "LOCAL_RANK": str(s.local_rank),
                                 "LOCAL_WORLD_SIZE": str(tasks[s.node_rank]),
                                 "MASTER_ADDR": names[0],
                                 "MASTER_PORT": str(default_port("4242", "1"))}


@pytest.mark.parametrize("tp, tasks", [(2, (2, 2)), (2, (4, 2, 2)), (4, (8, 8)), (8, (8, 8, 8))])
def test_tp_groups_stay_inside_a_node(tp, tasks):
    world = sum(tasks)
    steps = [read_step(_env(r, tasks, f"n[1-{len(tasks)}]"), tp=tp) for r in range(world)]
    node_of = {s.rank: s.node_rank for s in steps}
    for s in steps:  # what ParallelDims sees on that task: ranks_per_node = LOCAL_WORLD_SIZE
        dims = ParallelDims.resolve(world_size=world, tp=tp, ranks_per_node=s.local_world_size)
        group = dims.group_ranks("tp", s.rank)
        assert {node_of[r] for r in group} == {s.node_rank}, (s, group)


def test_explicit_rendezvous_and_reserved_ports_and_step_variables_win():
    s = read_step(_env(1, MASTER_ADDR="10.0.0.7", MASTER_PORT="29400"))
    assert (s.master_addr, s.master_port) == ("10.0.0.7", 29400)
    s = read_step(_env(1, SLURM_STEP_RESV_PORTS="12000-12015"))
    assert s.master_port == 12000
    # a step on part of the allocation: SLURM_STEP_* describe it, the job's variables do not
    s = read_step(_env(1, (2, 2), "job[1-4]", SLURM_NNODES="4", SLURM_TASKS_PER_NODE="2(x4)",
                       SLURM_NTASKS="8", SLURM_STEP_NODELIST="job[3-4]",
                       SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="4",
                       SLURM_STEP_TASKS_PER_NODE="2(x2)"))
    assert (s.nodes, s.world_size, s.master_addr) == (("job3", "job4"), 4, "job3")
    # SLURM_NTASKS_PER_NODE alone: one number for every node; SLURM_NODELIST if no JOB_ one
    s = read_step(_env(3, SLURM_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE="2",
                       SLURM_JOB_NODELIST=None, SLURM_NODELIST="x[7-8]"))
    assert (s.tasks_per_node, s.node_rank, s.local_rank, s.master_addr) == ((2, 2), 1, 1, "x7")


@pytest.mark.parametrize("env, match", [
    (_env(0, SLURM_NTASKS="5"), r"SLURM_NTASKS=5 but SLURM_TASKS_PER_NODE='2,2' sums to 4"),
    (_env(3, SLURM_PROCID="4"), r"SLURM_PROCID=4 is outside 0..3"),
    (_env(3, SLURM_NODEID="2"), r"SLURM_NODEID=2 is outside 0..1"),
    (_env(3, SLURM_LOCALID="2"), r"SLURM_LOCALID=2 but node 1 has 2 tasks"),
    (_env(0, SLURM_NNODES="3"), r"SLURM_NNODES='3' but SLURM_JOB_NODELIST='node\[01-02\]' "
                                r"names 2 nodes"),
    (_env(0, SLURM_TASKS_PER_NODE="2(x3)", SLURM_NTASKS="6"),
     r"SLURM_TASKS_PER_NODE='2\(x3\)' gives 3 nodes but SLURM_JOB_NODELIST"),
    (_env(0, SLURM_JOB_NODELIST="node[01-02"), r"SLURM_JOB_NODELIST='node\[01-02'.*unclosed"),
    (_env(0, SLURM_TASKS_PER_NODE="2(x)"), r"SLURM_TASKS_PER_NODE='2\(x\)'.*is not N"),
    (_env(0, SLURM_PROCID="x"), r"SLURM_PROCID='x' is not an integer"),
    (_env(0, SLURM_LOCALID=None), r"none of SLURM_LOCALID is set"),
    (_env(0, SLURM_JOB_NODELIST=None), r"none of SLURM_STEP_NODELIST, SLURM_NODELIST, "
                                       r"SLURM_JOB_NODELIST is set"),
    (_env(0, SLURM_TASKS_PER_NODE=None), r"none of .*SLURM_TASKS_PER_NODE.* is set"),
    # cyclic: node 0 runs ranks 0 and 2; rank 2 is node 0's second task
    (_env(2, SLURM_NODEID="0", SLURM_LOCALID="1"), r"SLURM_PROCID=2 on SLURM_NODEID=0 with "
                                                   r"SLURM_LOCALID=1; .* has rank 1 there"),
    (_env(0, SLURM_DISTRIBUTION="cyclic"), r"SLURM_DISTRIBUTION='cyclic' .* --distribution=block"),
    (_env(0, SLURM_DISTRIBUTION="plane=1"), r"SLURM_DISTRIBUTION='plane=1'"),
    (_env(0, MASTER_PORT="http"), r"MASTER_PORT='http' is not a port"),
    (_env(0, MASTER_PORT="70000"), r"MASTER_PORT='70000' is not a port"),
])
def test_inconsistent_variables_are_named(env, match):
    with pytest.raises(SlurmError, match=match):
        read_step(env, tp=1)


def test_distributions_that_are_blocks_pass():
    for d in ("block", "block:cyclic", "*:block,Pack", "plane=2", "plane=8"):
        assert read_step(_env(3, SLURM_DISTRIBUTION=d)).rank == 3
    assert read_step(_env(2, (1, 1, 1), "a,b,c", SLURM_DISTRIBUTION="cyclic")).rank == 2


def test_tp_must_divide_every_node():
    with pytest.raises(SlurmError, match=r"tp=2 must divide every node's task count.*"
                                         r"SLURM_TASKS_PER_NODE='4,3' gives node 1 \(g2\) 3"):
        read_step(_env(0, (4, 3), "g[1-2]"), tp=2)
    with pytest.raises(SlurmError, match=r"tp=4 must divide"):
        read_step(_env(0, (2, 2)), tp=4)
    assert read_step(_env(0, (4, 3), "g[1-2]"), tp=None).rank == 0  # the selftest: no tp


def test_precedence_torchrun_then_srun_step_then_local():
    # srun starting torchrun: the worker has torchrun's variables and the agent's SLURM ones
    env = _env(1, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1")
    assert adopt(environ=env) is None and env["RANK"] == "5" and "MASTER_PORT" not in env
    # the batch script itself (no srun): SLURM_PROCID=0 but no step
    env = _env(0, SLURM_STEP_ID=None)
    assert not is_slurm_step(env) and adopt(environ=env) is None and "RANK" not in env
    # a one-task step (srun --pty bash): the command starts its own local ranks
    env = _env(0, (1,), "solo")
    assert is_slurm_step(env) and adopt(environ=env) is None and "RANK" not in env
    env = _env(3, SLURM_STEP_ID=None, SLURM_STEPID="0")  # the older spelling
    step = adopt(tp=2, environ=env)
    assert step.rank == 3 and env["RANK"] == "3" and env["LOCAL_WORLD_SIZE"] == "2"
    with pytest.raises(SlurmError, match=r"RANK='2' is set but not all of RANK, WORLD_SIZE, "
                                         r"LOCAL_RANK"):
        adopt(environ=_env(0, RANK="2"))


# ---------------------------------------------------------------- end to end, N local tasks

def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _clean_env() -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}


def _srun(module, args, tasks, nodes, tmp_path, *, extra=None, ranks=None, timeout=150):
    """Start ``python -m module args`` once per task (or only ``ranks``), each with the SLURM
    environment of its task; returns [(returncode, stdout, stderr)] in rank order."""
    procs, files = [], []
    try:
        for r in ranks if ranks is not None else range(sum(tasks)):
            env = dict(_clean_env(), PYTHONUNBUFFERED="1", **_env(r, tasks, nodes, **extra or {}))
            out, err = (open(tmp_path / f"task{r}.{k}", "w+") for k in ("out", "err"))
            files.append((out, err))
            procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env,
                                          stdout=out, stderr=err, start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:  # a task still running (timeout, a failed peer): its whole group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = []
    for p, (out, err) in zip(procs, files):
        out.seek(0), err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close(), err.close()
    return results


def test_train_under_emulated_srun_2_nodes_x_2_tasks_checks(tmp_path):
    # No MASTER_ADDR/PORT: the first node of the list and the port derived from the job id.
    job = next(j for j in (str(random.randrange(10**6, 10**7)) for _ in range(1000))
               if _free(default_port(j, "0")))
    out = _srun("overlap.train", ["--tp", "2", "--pp", "1", "--dp", "2", "--steps", "3",
                                  "--check", *TINY], (2, 2), "localhost,emunode2", tmp_path,
                extra={"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0"})
    for rc, so, se in out:
        assert rc == 0, so[-2000:] + se[-3000:]
    rank0 = out[0][1]
    assert "layout          tp=2 x pp=1 x dp=2 (4 ranks)" in rank0, rank0
    diffs = check_diffs(rank0)
    assert len(diffs) == 3 and max(diffs) <= 2e-3 and "PASS" in rank0, rank0
    assert all("summary" not in so for _, so, _ in out[1:])  # rank 0 reports


@pytest.mark.parametrize("args, match", [
    (["--tp", "4", "--pp", "1", "--dp", "1", "--n-head", "4"],
     r"overlap-train: error: SLURM step: tp=4 must divide every node's task count"),
    (["--tp", "2", "--pp", "2", "--dp", "2"],
     r"overlap-train: error: srun started 4 processes but tp\*cp\*pp\*dp = 8"),
])
def test_train_refuses_a_step_that_cannot_hold_the_layout(tmp_path, args, match):
    # Refused before any rendezvous: one task is enough to see it.
    (rc, so, se), = _srun("overlap.train", [*TINY, *args], (2, 2), "n[1-2]", tmp_path,
                          ranks=[0], timeout=60)
    assert rc == 1 and re.search(match, se), so + se


def test_selftest_under_emulated_srun_2_tasks(tmp_path):
    # MASTER_ADDR/MASTER_PORT exported by the batch script: the node names need not resolve.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    path = tmp_path / "selftest.json"
    out = _srun("overlap.selftest", ["--only", "tp.all_gather_matmul.chunked,"
                                     "quant.all_reduce.int8.sync", "--json", str(path)],
                (1, 1), "emunode[1-2]", tmp_path,
                extra={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    for rc, so, se in out:
        assert rc == 0, so[-2000:] + se[-3000:]
    doc = json.loads(path.read_text())
    assert doc["passed"] is True and (doc["world_size"], doc["mode"]) == (2, "srun")
    assert [c["name"] for c in doc["checks"]] == ["tp.all_gather_matmul.chunked",
                                                   "quant.all_reduce.int8.sync"]
    assert "checks on 2 cpu ranks (srun, nccl_twin)" in out[0][1]
