"""Elastic shrink and grow-back of the main job (overlap.train.shrink, overlap.train.elastic).

An emulated node (``--ranks-per-node``) is lost for good at a random step after a checkpoint;
the job continues on the survivors with the layout ``choose_layout`` (the planner) picks, and
its losses equal those of a fresh run started on that layout from the same checkpoint. The
reference run resumes the same checkpoint on the same layout with the same code: the two sum in
the same order, so the bound is the resharded-resume one of tests/test_train_checkpoint.py
(1e-5 on the loss), not a measured one. Losses are read from ``--log-json`` (full precision).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from harness import shm_leaks_since
from overlap.dist.launch import orphaned_shm_segments
from overlap.train.config import ConfigError, parse_args
from overlap.train.shrink import choose_layout, layout_dict, mark_node_down, nodes_down
from train_cli import run_train

pytestmark = [
    pytest.mark.no_delay_pass("end to end; component files run its async paths delayed"),
    pytest.mark.no_numerics_pass("end to end; the model and op files run its numerics"),
]

TINY = ["--n-layer", "3", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--micro-batch-size", "2", "--micro-batches", "2", "--timeout", "120",
        "--clip-grad", "0.5", "--save-every", "2"]
LOSS_TOL = 1e-5  # the resharded-resume bound of tests/test_train_checkpoint.py
STEPS_GROW = 40  # room for the node to come back while the shrunk job runs


def _log(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _steps(events, *, after: int = -1) -> dict[int, float]:
    """Step number (1-based) -> loss of the last segment that ran it."""
    return {e["step"] + 1: e["loss"] for e in events if e["event"] == "step" and e["step"] > after}


def _flags(d: dict) -> list[str]:
    return ["--tp", str(d["tp"]), "--cp", str(d["cp"]), "--pp", str(d["pp"]), "--dp",
            str(d["dp"]), "--micro-batches", str(d["micro_batches"]), "--micro-batch-size",
            str(d["micro_batch_size"])]


def _fresh_run_matches(tmp_path, layout: dict, checkpoint: str, steps: int, got: dict) -> None:
    log = tmp_path / "fresh.jsonl"
    fresh = run_train([*TINY, *_flags(layout), "--steps", str(steps), "--resume", checkpoint,
                       "--log-json", str(log)])
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-3000:]
    want = _steps(_log(log))
    assert sorted(want) == sorted(got), (want, got)
    worst = max(abs(want[s] - got[s]) for s in want)
    assert worst <= LOSS_TOL, (worst, want, got)


def _run_returning(args, log, nodes_dir, shrunk_ranks: int, timeout=400):
    """Run the job; once it resumed on ``shrunk_ranks`` ranks, bring the lost node back (remove
    its marker, as a node passing its health check again)."""
    proc = subprocess.Popen([sys.executable, "-m", "overlap.train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if log.exists() and any(e["event"] == "resumed" and e["layout"]["ranks"] ==
                                    shrunk_ranks for e in _log(log)):
                for name in os.listdir(nodes_dir):
                    os.unlink(os.path.join(nodes_dir, name))
                break
            time.sleep(0.05)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks
            proc.communicate()
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _shrink_case(tmp_path, base: list[str], rpn: int, steps: int, grow=False, seed=None):
    rng = random.Random(seed)
    cfg = parse_args([*TINY, *base])
    nodes = cfg.world_size // rpn
    node, step = rng.randrange(nodes), rng.randrange(3, min(steps - 1, 7))  # after step_2
    log = tmp_path / "log.jsonl"
    shm_before = set(orphaned_shm_segments())
    args = [*TINY, *base, "--steps", str(steps), "--save", str(tmp_path / "ck"),
            "--max-restarts", "1", "--ranks-per-node", str(rpn), "--min-nodes", "1",
            "--kill-node", str(node), "--kill-at-step", str(step), "--log-json", str(log)]
    if grow:
        res = _run_returning([*args, "--grow-back"], log, tmp_path / "ck" / ".nodes",
                             cfg.world_size - rpn)
    else:
        res = run_train(args, timeout=400)
    msg = f"kill node {node} at step {step}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    assert res.returncode == 0, msg
    assert shm_leaks_since(shm_before) == [], msg
    return cfg, res, _log(log), msg


def test_lost_node_shrinks_to_the_planner_layout_and_matches_a_fresh_run(tmp_path):
    """The must-show case: 8 ranks in 4 emulated nodes of 2, one node lost for good."""
    cfg, res, events, msg = _shrink_case(tmp_path, ["--tp", "2", "--pp", "2", "--dp", "2"],
                                         rpn=2, steps=8)
    want = choose_layout(cfg, 6, ranks_per_node=2).cfg
    (shrink,) = [e for e in events if e["event"] == "shrink"]
    assert shrink["old_layout"] == layout_dict(cfg), msg
    assert shrink["new_layout"] == layout_dict(want) and want.world_size == 6, msg
    (resumed,) = [e for e in events if e["event"] == "resumed"]
    assert resumed["layout"] == layout_dict(want) and resumed["checkpoint"], msg
    assert 0 < resumed["fault_to_resumed_s"] < 120, msg
    assert "shrink          tp2 x pp2 x dp2 (8 ranks" in res.stdout, msg
    assert "training resumed" in res.stdout and "after the fault (attempt 2)" in res.stdout, msg
    # the global batch (8 sequences) is kept: the same data, so the first resumed step's loss
    # is the uninterrupted run's within the resharded bound too
    assert want.dp * want.micro_batches * want.micro_batch_size == 8
    got = _steps(events, after=resumed["step"] - 1)
    assert max(got) == 8, msg
    before = {e["step"] + 1: e["loss"] for e in events if e["event"] == "step"
              and e["layout"]["ranks"] == 8}
    if resumed["step"] + 1 in before:
        assert abs(before[resumed["step"] + 1] - got[resumed["step"] + 1]) <= LOSS_TOL, msg
    _fresh_run_matches(tmp_path, layout_dict(want), resumed["checkpoint"], 8, got)


@pytest.mark.parametrize("world", [2, 4])
def test_lost_node_then_it_returns_grow_back(tmp_path, world):
    """A node lost, then back once the job resumed without it: shrink (world 4 -> 2, world
    2 -> 1), then back to the full layout at a fresh checkpoint; the grown segment equals a
    fresh full-layout run from that checkpoint."""
    base = (["--tp", "2", "--pp", "1", "--dp", "2"] if world == 4 else
            ["--tp", "1", "--pp", "1", "--dp", "2"])
    rpn = world // 2
    cfg, res, events, msg = _shrink_case(tmp_path, base, rpn=rpn, steps=STEPS_GROW, grow=True)
    kinds = [e["event"] for e in events if e["event"] in ("shrink", "grow")]
    assert kinds == ["shrink", "grow"], msg
    shrink, grow = [e for e in events if e["event"] in ("shrink", "grow")]
    small = choose_layout(cfg, world // 2, ranks_per_node=rpn).cfg
    assert shrink["new_layout"] == layout_dict(small), msg
    assert grow["old_layout"] == layout_dict(small) and grow["new_layout"] == layout_dict(cfg)
    assert "grow            " in res.stdout and "after the nodes returned" in res.stdout, msg
    resumed = [e for e in events if e["event"] == "resumed"]
    assert [r["layout"]["ranks"] for r in resumed] == [world // 2, world], msg
    got = _steps(events, after=resumed[-1]["step"] - 1)
    assert max(got) == STEPS_GROW, msg
    _fresh_run_matches(tmp_path, layout_dict(cfg), resumed[-1]["checkpoint"], STEPS_GROW, got)


# ---- the choice, without processes ---------------------------------------------------------

def _cfg(*args):
    return parse_args([*TINY, *args])


def test_dp_shrinks_first_and_the_global_batch_is_kept_by_accumulation():
    cfg = _cfg("--tp", "2", "--pp", "2", "--dp", "2")
    c = choose_layout(cfg, 4, ranks_per_node=2)
    assert (c.cfg.tp, c.cfg.pp, c.cfg.dp, c.cfg.micro_batches, c.cfg.micro_batch_size) == \
        (2, 2, 1, 4, 2)
    assert c.batch_kept and c.changes == ()
    # 6 ranks: dp alone cannot change (6 / 4), so tp or pp does; the batch is still kept
    c6 = choose_layout(cfg, 6, ranks_per_node=2)
    assert c6.cfg.world_size == 6 and c6.batch_kept
    assert c6.cfg.dp * c6.cfg.micro_batches * c6.cfg.micro_batch_size == 8
    assert c6.cfg.tp <= 2  # TP stays inside a node
    assert choose_layout(cfg, 6, ranks_per_node=2) == c6  # every rank gets the same answer


def test_a_batch_no_dp_divides_is_changed_and_said():
    # 3 sequences per step on 1 layer, 1 head, 6 tokens: only dp can change, and 2 ranks
    # cannot hold 3 sequences evenly
    cfg = parse_args(["--n-layer", "1", "--n-head", "1", "--d-model", "8", "--seq-len", "6",
                      "--tp", "1", "--pp", "1", "--dp", "3", "--micro-batches", "1",
                      "--micro-batch-size", "1"])
    c = choose_layout(cfg, 2, ranks_per_node=1)
    assert (c.cfg.dp, c.cfg.micro_batches, c.cfg.micro_batch_size) == (2, 1, 1)
    assert not c.batch_kept
    assert c.changes == ("global batch 3 -> 2 sequences: no layout of 2 ranks whose dp "
                         "divides it runs this job",)


def test_no_layout_fits_is_a_clear_error():
    cfg = _cfg("--tp", "2", "--pp", "2", "--dp", "2")
    from overlap.train.shrink import load_profile

    tiny = load_profile("h100-sxm").replace(hbm_bytes=1024.0)  # nothing fits in 1 KiB
    with pytest.raises(ConfigError, match=r"no layout of this job runs on 6 ranks \(2 per "
                                          r"node.*the planner: memory"):
        choose_layout(cfg, 6, ranks_per_node=2, profile=tiny)


def test_nodes_down_reads_the_markers(tmp_path):
    assert nodes_down(str(tmp_path)) == 0
    mark_node_down(str(tmp_path), 1, float("inf"))
    mark_node_down(str(tmp_path), 2, -1.0)  # already back
    assert nodes_down(str(tmp_path)) == 1


def test_too_few_nodes_left_stops_with_a_clear_error(tmp_path):
    from overlap.train.elastic import _next_layout

    cfg = _cfg("--tp", "2", "--pp", "2", "--dp", "2", "--save", str(tmp_path),
               "--max-restarts", "1", "--ranks-per-node", "2", "--min-nodes", "3")
    mark_node_down(str(tmp_path), 0, float("inf"))
    nxt, down, _ = _next_layout(cfg)
    assert down == 1 and nxt.world_size == 6
    mark_node_down(str(tmp_path), 3, float("inf"))
    with pytest.raises(SystemExit, match=r"2 of 4 nodes \(2 ranks each\) are down and 2 "
                                         r"remain, fewer than --min-nodes 3"):
        _next_layout(cfg)


@pytest.mark.parametrize("args, match", [
    (["--min-nodes", "1", "--ranks-per-node", "2"], r"--min-nodes 1 .* needs --save DIR and "
                                                    r"--max-restarts"),
    (["--grow-back"], r"--grow-back .* needs --min-nodes N"),
    (["--min-nodes", "4", "--ranks-per-node", "2", "--max-restarts", "1", "--save", "X"],
     r"--min-nodes 4: the job has 4 node\(s\) of 2 ranks"),
    (["--ranks-per-node", "3"], r"--ranks-per-node 3 does not divide the 8 ranks"),
    (["--ranks-per-node", "1"], r"tp"),
    (["--min-nodes", "1", "--ranks-per-node", "2", "--max-restarts", "1", "--save", "X",
      "--plan-profile", "tpu-v9"], r"--plan-profile tpu-v9: .*unknown"),
])
def test_bad_elastic_flags_are_refused_before_anything_starts(tmp_path, args, match):
    args = [str(tmp_path / a) if a == "X" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "overlap.train", "--tp", "2", "--pp", "2",
                           "--dp", "2", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    import re

    assert re.search(match, proc.stderr), proc.stderr
    assert not os.path.exists(tmp_path / "X")


def test_torchrun_with_fewer_ranks_continues_on_a_planner_layout(tmp_path):
    """torchrun --nnodes MIN:MAX restarts the workers with another WORLD_SIZE after a
    membership change; the job then takes the shrink path (a planner-chosen layout, the
    checkpoint resharded) instead of refusing or hanging. Here torchrun starts 2 workers for a
    4-rank job resuming a 4-rank checkpoint."""
    from test_train_torchrun import _torchrun

    base = [*TINY, "--tp", "1", "--pp", "1", "--dp", "4", "--steps", "4"]
    full = run_train([*base, "--save", str(tmp_path / "a"), "--log-json",
                      str(tmp_path / "a.jsonl")])
    assert full.returncode == 0, full.stderr[-3000:]
    res = _torchrun([*base, "--save", str(tmp_path / "b"), "--resume", str(tmp_path / "a" /
                     "step_2"), "--min-nodes", "1", "--log-json", str(tmp_path / "b.jsonl")],
                    tmp_path)
    msg = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, msg
    want = choose_layout(parse_args(base), 2, ranks_per_node=2).cfg
    events = _log(tmp_path / "b.jsonl")
    (shrink,) = [e for e in events if e["event"] == "shrink"]
    assert shrink["new_layout"] == layout_dict(want), msg
    assert "torchrun started 2 ranks instead of 4: continuing on" in res.stderr, msg
    a, b = _steps(_log(tmp_path / "a.jsonl")), _steps(events)
    assert sorted(b) == [3, 4] and abs(a[3] - b[3]) <= LOSS_TOL, (a, b)


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _listening(port: int) -> bool:
    """Whether a socket of this machine listens on ``port`` (from /proc/net/tcp*)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    local, state = line.split()[1], line.split()[3]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        return True
        except OSError:
            pass
    return False


def test_torchrun_node_frozen_the_survivors_shrink_instead_of_hanging(tmp_path):
    """Two torchrun agents (--nnodes 1:2, 2 workers each) train one 4-rank job; one agent and
    its workers freeze (SIGSTOP: their sockets stay open, so the survivors' collectives would
    wait for --timeout, 300 s). The heartbeat finds the frozen ranks in --heartbeat-timeout,
    every survivor exits, torchrun re-forms the job on the one node left, and the job shrinks
    to the planner's 2-rank layout and finishes; its losses equal a fresh run of that layout
    from the same checkpoint."""
    from test_train_torchrun import _free_port, torchrun_env

    steps = 14
    base = [*TINY, "--tp", "2", "--pp", "1", "--dp", "2", "--steps", str(steps)]
    log = tmp_path / "log.jsonl"
    args = [*base, "--timeout", "300", "--save", str(tmp_path / "ck"), "--min-nodes", "1",
            "--heartbeat-timeout", "5", "--log-json", str(log)]
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "shrink", "--max-restarts", "2",
           "--rdzv-conf", "last_call_timeout=5,join_timeout=60", "-m", "overlap.train", *args]
    env = torchrun_env(tmp_path)
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=env)]
    # The agent that binds the endpoint hosts the rendezvous store, which every later
    # rendezvous needs: freezing it would freeze the store too (torchrun's c10d rendezvous
    # has one host). The second agent starts once the first one listens; a fixed head start
    # lost that race on a loaded machine.
    listen_deadline = time.monotonic() + 90
    while not _listening(port) and agents[0].poll() is None:
        assert time.monotonic() < listen_deadline, "the first agent never bound the endpoint"
        time.sleep(0.1)
    agents.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True, env=env))
    frozen: list[int] = []
    try:
        deadline, done = time.monotonic() + 120, []
        while time.monotonic() < deadline and agents[0].poll() is None:
            done = [e for e in (_log(log) if log.exists() else []) if e["event"] == "step"]
            if done and done[-1]["step"] >= 4:
                break
            time.sleep(0.1)
        assert done and done[0]["layout"]["ranks"] == 4, "the two agents did not form one job"
        frozen = [agents[1].pid, *_children(agents[1].pid)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        t_freeze = time.monotonic()
        out, _ = agents[0].communicate(timeout=200)
        took = time.monotonic() - t_freeze
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
            a.communicate()
    msg = out[-5000:]
    assert agents[0].returncode == 0, msg
    assert "stopped its heartbeat" in out and "its node is lost" in out, msg
    assert "torchrun started 2 ranks instead of 4: continuing on" in out, msg
    assert took < 150, (took, msg)  # far below the 300 s collective timeout
    want = choose_layout(parse_args(base), 2, ranks_per_node=2).cfg
    events = _log(log)
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed and resumed[-1]["layout"] == layout_dict(want), msg
    assert resumed[-1]["fault_to_resumed_s"] is not None and \
        0 < resumed[-1]["fault_to_resumed_s"] < 150, resumed
    got = _steps(events, after=resumed[-1]["step"] - 1)
    assert max(got) == steps, msg
    _fresh_run_matches(tmp_path, layout_dict(want), resumed[-1]["checkpoint"], steps, got)


def test_no_layout_for_the_survivors_stops_with_a_clear_error(tmp_path):
    from overlap.train.elastic import _next_layout
    from overlap.train.shrink import load_profile

    profile = tmp_path / "tiny.json"  # a device of 1 KiB: the planner fits nothing on it
    profile.write_text(load_profile("h100-sxm").replace(hbm_bytes=1024.0).to_json())
    cfg = _cfg("--tp", "2", "--pp", "2", "--dp", "2", "--save", str(tmp_path / "ck"),
               "--max-restarts", "1", "--ranks-per-node", "2", "--min-nodes", "2",
               "--plan-profile", str(profile))
    mark_node_down(str(tmp_path / "ck"), 2, float("inf"))
    with pytest.raises(SystemExit, match=r"1 of 4 nodes are down: no layout of this job runs "
                                         r"on 6 ranks \(2 per node.*the planner: memory"):
        _next_layout(cfg)


def test_the_node_of_a_rank_that_died_is_presumed_lost(tmp_path):
    """A rank that exited without a result (however it was killed) takes its node down; ranks
    that raised (their peer vanished) or were stopped by the launcher do not."""
    from overlap.dist.launch import LaunchError, RankOutcome
    from overlap.train.elastic import _mark_lost_nodes, _next_layout

    cfg = _cfg("--tp", "2", "--pp", "2", "--dp", "2", "--save", str(tmp_path),
               "--max-restarts", "1", "--ranks-per-node", "2", "--min-nodes", "2")
    status = {0: "error", 1: "error", 2: "aborted", 3: "aborted", 4: "aborted", 5: "died",
              6: "error", 7: "aborted"}
    exc = LaunchError("x", [RankOutcome(rank=r, status=s) for r, s in status.items()])
    _mark_lost_nodes(cfg, exc, 1)
    assert nodes_down(str(tmp_path)) == 1
    assert os.listdir(tmp_path / ".nodes") == ["down_a1_n2"]  # rank 5 is on node 2
    nxt, down, _ = _next_layout(cfg)
    assert down == 1 and nxt == choose_layout(cfg, 6, ranks_per_node=2).cfg
    os.unlink(tmp_path / ".nodes" / "down_a1_n2")  # the node passed its health check again
    assert _next_layout(cfg)[0] is cfg
