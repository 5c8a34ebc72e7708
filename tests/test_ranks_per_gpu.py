"""Ranks per GPU (overlap.dist.device): the setting parses the same way everywhere, reaches the
ranks of every launcher (launch, overlap-selftest, overlap-train, torchrun's init, the benches,
the test harness) and maps each local rank to its GPU with an NCCL host id of its own. On the
CPU the GPU is asked through torch.cuda's device count and set_device, replaced by fakes."""

import json
import os
import runpy
import socket
import subprocess
import sys

import pytest
import torch

import harness
from harness import run_ranks
from overlap.dist import device
from overlap.dist.device import RANKS_PER_GPU_ENV
from overlap.dist.launch import launch

pytestmark = pytest.mark.no_delay_pass("placement and settings: no stream or twin op")

BENCHES = ("bench_cp", "bench_dp", "bench_elastic", "bench_ep_pipeline", "bench_host",
           "bench_kernels", "bench_moe", "bench_offload", "bench_parallelize_cost", "bench_pp",
           "bench_quant", "bench_recompute", "bench_tp_block", "bench_tp_ops")


@pytest.fixture
def clean_env(monkeypatch):
    for name in (RANKS_PER_GPU_ENV, "NCCL_HOSTID", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_setting_comes_from_the_flag_then_the_environment_then_1(clean_env):
    assert device.ranks_per_gpu() == 1
    clean_env.setenv(RANKS_PER_GPU_ENV, "3")
    assert device.ranks_per_gpu() == 3
    assert device.ranks_per_gpu(2) == 2 and device.ranks_per_gpu("4") == 4


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "0", "x", "1.5", ""])
def test_a_bad_setting_names_where_it_came_from(clean_env, bad):
    with pytest.raises(ValueError, match=r"--ranks-per-gpu must be a positive int .*got"):
        device.ranks_per_gpu(bad)
    if isinstance(bad, str) and bad:
        clean_env.setenv(RANKS_PER_GPU_ENV, bad)
        with pytest.raises(ValueError, match=rf"env {RANKS_PER_GPU_ENV} must be a positive int"):
            device.ranks_per_gpu()


@pytest.mark.parametrize("per_gpu,gpus,world,want", [
    (1, 4, 4, [0, 1, 2, 3]), (2, 1, 2, [0, 0]), (2, 2, 4, [0, 0, 1, 1]),
    (4, 1, 4, [0, 0, 0, 0]), (3, 2, 5, [0, 0, 0, 1, 1])])
def test_local_rank_r_runs_on_gpu_r_div_ranks_per_gpu(per_gpu, gpus, world, want):
    assert [device.gpu_index(r, per_gpu=per_gpu, gpus=gpus, local_world=world)
            for r in range(world)] == want


def test_too_many_local_ranks_for_the_gpus_is_an_error_that_says_what_to_set():
    with pytest.raises(ValueError, match=r"4 local ranks at 1 per GPU need 4 GPUs, this node "
                                         r"has 1; set OVERLAP_RANKS_PER_GPU .* at least 4"):
        device.gpu_index(0, per_gpu=1, gpus=1, local_world=4)
    with pytest.raises(ValueError, match="needs a GPU, this node has none"):
        device.gpu_index(0, per_gpu=2, gpus=0)


def test_sharing_ranks_get_their_own_nccl_host_id_and_loopback_on_one_node(clean_env):
    assert device.sharing_env(0, 1) == {}  # one rank per GPU: NCCL's own host id
    ids = [device.sharing_env(r, 2)["NCCL_HOSTID"] for r in range(4)]
    assert len(set(ids)) == 4 and all(i.startswith(socket.gethostname()) for i in ids)
    assert device.sharing_env(1, 2)["NCCL_SOCKET_IFNAME"] == "lo"
    assert "NCCL_SOCKET_IFNAME" not in device.sharing_env(1, 2, one_node=False)
    clean_env.setenv("NCCL_SOCKET_IFNAME", "eth7")  # the user's choice is kept
    assert "NCCL_SOCKET_IFNAME" not in device.sharing_env(1, 2)


def test_sharing_note_only_when_ranks_share(clean_env):
    assert device.sharing_note(1) is None
    note = device.sharing_note(2)
    assert "2 per GPU" in note and "mean nothing for speed" in note


# -- launch: what each rank sees ----------------------------------------------------------------
def _what_the_rank_sees():
    """The rank's setting, host id, and the GPU gpu_for_rank picks with 2 fake GPUs."""
    picked = []
    torch.cuda.device_count = lambda: 2
    torch.cuda.set_device = picked.append
    dev = device.gpu_for_rank()
    assert picked == [dev]
    # Every rank has joined before any returns: a rank that exits while a slow peer is still
    # connecting its gloo mesh would fail that peer's start-up.
    torch.distributed.barrier()
    return (os.environ[RANKS_PER_GPU_ENV], os.environ.get("NCCL_HOSTID"), dev.index,
            os.environ["LOCAL_WORLD_SIZE"])


@pytest.mark.parametrize("world", harness.WORLD_SIZES)
def test_launch_passes_the_setting_to_every_rank(clean_env, world):
    seen = launch(_what_the_rank_sees, world, ranks_per_gpu=2, timeout=60)
    assert [s[0] for s in seen] == ["2"] * world
    assert len({s[1] for s in seen}) == world and None not in {s[1] for s in seen}
    assert [s[2] for s in seen] == [r // 2 for r in range(world)]
    assert [s[3] for s in seen] == [str(world)] * world  # the node layout is unchanged


def test_launch_reads_the_environment_and_defaults_to_one_per_gpu(clean_env):
    assert [(s[0], s[1], s[2]) for s in launch(_what_the_rank_sees, 2, timeout=60)] == \
        [("1", None, 0), ("1", None, 1)]
    clean_env.setenv(RANKS_PER_GPU_ENV, "2")
    assert [s[2] for s in run_ranks(_what_the_rank_sees, 4)] == [0, 0, 1, 1]  # the harness too


def test_launch_refuses_a_bad_setting_before_starting_a_rank(clean_env):
    with pytest.raises(ValueError, match="launch: ranks_per_gpu must be a positive int"):
        launch(_what_the_rank_sees, 2, ranks_per_gpu=0)


def _too_many():
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda d: None
    device.gpu_for_rank()


def test_ranks_beyond_the_gpus_room_fail_on_every_rank_naming_the_setting(clean_env):
    outs = harness.run_ranks_outcomes(_too_many, 4)
    assert [o.status for o in outs] == ["error"] * 4
    assert all("4 local ranks at 1 per GPU need 4 GPUs" in o.error for o in outs)


# -- torchrun: init_from_env ----------------------------------------------------------------------
def test_init_from_env_gives_a_sharing_rank_its_host_id_before_the_group_starts(clean_env):
    import torch.distributed as dist

    from overlap.dist.envinit import init_from_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)).items():
        clean_env.setenv(k, v)
    init_from_env("gloo", timeout=30, ranks_per_gpu=2)
    try:
        assert os.environ["NCCL_HOSTID"] == device.sharing_env(0, 2)["NCCL_HOSTID"]
        assert os.environ[RANKS_PER_GPU_ENV] == "2" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    finally:
        dist.destroy_process_group()


# -- the commands ---------------------------------------------------------------------------------
def _run(args, env=None, timeout=240):
    env = {**os.environ, **(env or {})}
    env.pop(RANKS_PER_GPU_ENV, None) if env.get(RANKS_PER_GPU_ENV) is None else None
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_selftest_runs_and_reports_its_ranks_sharing_a_gpu(clean_env, tmp_path, how):
    out = tmp_path / "st.json"
    args = ["-m", "overlap.selftest", "--only", "symm.signal_ring", "--json", str(out)]
    res = _run(args + ["--ranks-per-gpu", "2"] if how == "flag" else args,
               env={RANKS_PER_GPU_ENV: "2"} if how == "env" else None)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(out.read_text())["ranks_per_gpu"] == 2
    assert "2 per GPU" in res.stdout and "mean nothing for speed" in res.stdout


def test_selftest_refuses_a_bad_setting_in_one_line(clean_env):
    res = _run(["-m", "overlap.selftest", "--ranks-per-gpu", "0"])
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "--ranks-per-gpu must be a positive int" in res.stderr


def test_selftest_places_ranks_on_one_gpu_only_when_they_may_share_it(clean_env, capsys):
    from overlap.selftest.__main__ import _placement
    from overlap.selftest.checks import plan
    from overlap.selftest.config import SelftestConfig

    auto, cuda = SelftestConfig(), SelftestConfig(device="cuda")
    assert _placement(auto, 1, 2) == ("cuda", 2, "")
    assert _placement(SelftestConfig(world_size=4), 1, 4) == ("cuda", 4, "")
    dev, world, note = _placement(auto, 1, 1)
    assert (dev, world) == ("cpu", 2) and "--ranks-per-gpu 2" in note
    with pytest.raises(SystemExit):
        _placement(cuda, 1, 1)
    assert "--ranks-per-gpu 2 makes room" in capsys.readouterr().err
    # torch's symmetric memory takes one rank per device: sharing ranks check the IPC fallback
    names = [n for n, _ in plan(torch.device("cuda"))]
    assert "symm.torch_symmetric_memory" in names and "symm.shared_gpu_memory" not in names
    clean_env.setenv(RANKS_PER_GPU_ENV, "2")
    names = [n for n, _ in plan(torch.device("cuda"))]
    assert "symm.shared_gpu_memory" in names and "symm.torch_symmetric_memory" not in names


def test_train_reaches_every_rank_and_says_its_timings_mean_nothing(clean_env):
    res = _run(["-m", "overlap.train", "--tp", "1", "--pp", "1", "--dp", "2", "--steps", "2",
                "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
                "--micro-batch-size", "2", "--micro-batches", "1", "--ranks-per-gpu", "2",
                "--log-json", "/dev/null"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "ranks share a GPU (2 per GPU" in res.stdout
    first_row = res.stdout.index("step ")  # the note comes before the first timing
    assert res.stdout.index("note: ranks share a GPU") < first_row
    from overlap.train import elastic
    from overlap.train.config import parse_args

    results = elastic.run(parse_args(["--tp", "2", "--pp", "1", "--dp", "1", "--steps", "1",
                                      "--n-layer", "1", "--d-model", "32", "--n-head", "2",
                                      "--seq-len", "16", "--micro-batch-size", "2",
                                      "--micro-batches", "1", "--ranks-per-gpu", "2"]))
    places = [r["placement"] for r in results]
    assert [p["ranks_per_gpu"] for p in places] == [2, 2]
    assert len({p["nccl_hostid"] for p in places}) == 2 and places[0]["device"] == "cpu"


def test_train_refuses_a_bad_setting(clean_env):
    res = _run(["-m", "overlap.train", "--ranks-per-gpu", "-1"])
    assert res.returncode == 2 and "--ranks-per-gpu must be an integer >= 0" in res.stderr
    res = _run(["-m", "overlap.train", "--steps", "1"], env={RANKS_PER_GPU_ENV: "two"})
    assert res.returncode == 2 and f"env {RANKS_PER_GPU_ENV} must be a positive" in res.stderr


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_takes_the_flag(name, capsys, monkeypatch):
    """Each bench as users run it (``python -m bench.<name>``), asked for its help."""
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module(f"bench.{name}", run_name="__main__")
    assert exc.value.code == 0 and "--ranks-per-gpu N" in capsys.readouterr().out


def test_a_bench_flag_reaches_the_launcher_and_every_table(clean_env, tmp_path):
    from bench.runner import Table, parse_config
    from bench.bench_moe import BenchConfig

    parse_config(BenchConfig, "", ["--ranks-per-gpu", "2"])
    assert os.environ[RANKS_PER_GPU_ENV] == "2"
    assert [s[2] for s in launch(_what_the_rank_sees, 2, timeout=60)] == [0, 0]
    t = Table("t", ["a"])
    t.add(a=1.0)
    _, md = t.write(str(tmp_path / "t"))
    text = open(md).read()
    assert "ranks_per_gpu: 2" in text and "mean nothing for speed" in text
    clean_env.setenv(RANKS_PER_GPU_ENV, "1")
    _, md = t.write(str(tmp_path / "u"))
    assert "mean nothing for speed" not in open(md).read()
    with pytest.raises(SystemExit) as exc:
        parse_config(BenchConfig, "", ["--ranks-per-gpu", "0"])
    assert exc.value.code == 2


def test_gpu_tests_size_their_world_from_the_gpus_and_the_setting(clean_env):
    clean_env.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    with pytest.raises(pytest.skip.Exception, match=f"set {RANKS_PER_GPU_ENV}=2"):
        harness.gpu_world()
    clean_env.setenv(RANKS_PER_GPU_ENV, "2")
    assert harness.gpu_world() == 2
    clean_env.setenv(RANKS_PER_GPU_ENV, "8")
    assert harness.gpu_world() == 4 and harness.gpu_world(most=8) == 8


def test_a_workspace_finds_the_ranks_that_share_a_device():
    from overlap.symm.cuda import shared_devices

    assert shared_devices(["a", "b", "c"]) == []
    assert shared_devices(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert shared_devices(["a", "b", "a"]) == [[0, 2]]


def _same_host_id_on_one_gpu(hostid):
    """Rank 0 and 1 present one NCCL host id (as a launcher that forgot sharing_env would)."""
    import torch.distributed as dist

    if hostid:
        os.environ["NCCL_HOSTID"] = "one-host"
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


@pytest.mark.parametrize("world", [2, 4])
def test_the_twin_refuses_two_ranks_of_one_host_on_one_gpu_as_nccl_does(clean_env, world):
    """Sharing ranks that keep their own host ids pass; one host id on one GPU is refused on
    every rank when the communicator is created, naming the ranks and the GPU."""
    assert run_ranks(_same_host_id_on_one_gpu, world, False, backend="nccl_twin",
                     env={RANKS_PER_GPU_ENV: "2"}) == [float(world)] * world
    outs = harness.run_ranks_outcomes(_same_host_id_on_one_gpu, world, True,
                                      backend="nccl_twin", timeout=30)
    assert [o.status for o in outs] == ["ok"] * world  # one rank per GPU: nothing shared
    clean_env.setenv(RANKS_PER_GPU_ENV, "2")
    outs = harness.run_ranks_outcomes(_same_host_id_on_one_gpu, world, True,
                                      backend="nccl_twin", timeout=30)
    assert [o.status for o in outs] == ["error"] * world
    assert all("group ranks [0, 1] both on GPU 0 with NCCL host id 'one-host'" in o.error
               for o in outs), [o.error for o in outs]
