"""overlap-selftest: the CLI end to end (a clean run, an injected failure, torchrun), the
detection on this machine, and the pieces that merge and print results."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from harness import without_gpus
from overlap.selftest.checks import TIMEOUT_SLACK
from overlap.selftest.env import nvlink_from_topo
from overlap.selftest.report import JSON_FIELDS, merge

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")

TP = [f"tp.{op}.{be}" for op in ("all_gather_matmul", "matmul_reduce_scatter",
                                  "matmul_all_reduce") for be in ("chunked", "symmetric", "triton")]
QUANT = [f"quant.{op}.{dt}.{mode}" for op in ("all_reduce", "reduce_scatter", "all_gather")
         for dt in ("int8", "bf16") for mode in ("sync", "async")]
CPU_CHECKS = TP + QUANT + ["symm.signal_ring", "symm.signal_ring.triton", "streams.event_order",
                           "symm.poisoned_output", "pp.1f1b_step", "ep.moe.capacity",
                           "ep.moe.dropless", "ep.moe.symmetric", "ep.int8_dispatch",
                           "ep.pipeline_pairs", "cp.attention.ring", "cp.attention.allgather",
                           "cp.attention.ulysses", "timeout.missing_peer.all_gather_matmul"]
PEER_TIMEOUT = 2.0


def _selftest(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The selftest on the CPU twins, on any machine (its GPUs hidden)."""
    return subprocess.run([sys.executable, "-m", "overlap.selftest", *args], capture_output=True,
                          text=True, timeout=timeout, env=without_gpus())


def _progress(stdout: str, names: list[str]) -> list[tuple[str, str]]:
    """The progress lines, checked to come after the environment block and before the table,
    numbered 1..N in order; returns (name, pass/FAIL) per line."""
    lines = stdout.splitlines()
    rows = [(i, m) for i, ln in enumerate(lines)
            if (m := re.match(r"^\[ *(\d+)/(\d+)\] (\S+)  (pass|FAIL)  ", ln))]
    assert [m[3] for _, m in rows] == names, stdout
    assert [(int(m[1]), int(m[2])) for _, m in rows] == [(k, len(names))
                                                         for k in range(1, len(names) + 1)]
    env = lines.index("overlap-selftest: environment")
    table = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["check", "result"])
    assert env < rows[0][0] and rows[-1][0] < table, stdout
    return [(m[3], m[4]) for _, m in rows]


def test_cli_runs_every_check_and_passes(tmp_path):
    path = tmp_path / "selftest.json"
    proc = _selftest("--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(path.read_text())
    assert doc["passed"] is True
    assert (doc["device"], doc["world_size"], doc["transport"]) == ("cpu", 2, "nccl_twin")
    checks = {c["name"]: c for c in doc["checks"]}
    assert [c["name"] for c in doc["checks"]] == CPU_CHECKS
    for c in doc["checks"]:
        assert tuple(c) == JSON_FIELDS, c
        assert c["passed"] is True and c["error"] == "", c
        assert 0 < c["seconds"] < 60, c
        assert c["measured"] <= c["limit"], c
    for name in TP + ["pp.1f1b_step", "ep.moe.capacity", "ep.moe.dropless", "ep.moe.symmetric",
                      "ep.pipeline_pairs", "cp.attention.ring", "cp.attention.allgather",
                      "cp.attention.ulysses"]:
        assert (checks[name]["metric"], checks[name]["limit"]) == ("rel err", 1e-5)
    # The lossy paths lose something (so they ran quantized), and stay within their bounds.
    for name in QUANT:
        assert checks[name]["metric"] == "err/bound" and checks[name]["limit"] == 1.0
        assert 0.05 < checks[name]["measured"] <= 1.0, checks[name]
    for name in ("symm.signal_ring", "symm.signal_ring.triton", "streams.event_order",
                 "symm.poisoned_output"):
        assert (checks[name]["measured"], checks[name]["limit"]) == (0.0, 0.0)
    # The INT8 dispatch quantizes (a nonzero error) and stays within Q(M) of every value.
    ep = checks["ep.int8_dispatch"]
    assert ep["metric"] == "err/bound" and 0.05 < ep["measured"] <= ep["limit"] == 1.0, ep
    # Rank 0 (stage 0 of 2 GPT blocks) compares its parameters' gradients in both steps.
    assert checks["pp.1f1b_step"]["detail"].endswith("over 2 steps")
    timeout = checks["timeout.missing_peer.all_gather_matmul"]
    assert timeout["limit"] == PEER_TIMEOUT + TIMEOUT_SLACK
    assert PEER_TIMEOUT * 0.9 <= timeout["measured"] <= PEER_TIMEOUT + TIMEOUT_SLACK
    assert "all_gather_matmul" in timeout["detail"] and "within 2s" in timeout["detail"]
    # The printed table: one row per check, in run order, each passing.
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1]
            and line.split()[0] in checks]
    assert [r[0] for r in rows] == CPU_CHECKS and all(r[1] == "pass" for r in rows)
    # ... after a line per check as it finished, in the same order.
    assert _progress(proc.stdout, CPU_CHECKS) == [(n, "pass") for n in CPU_CHECKS]
    # The pairs formed (1F1B, m 4, one stage: F1B0, F2B1, F3B2) and changed no number.
    assert checks["ep.pipeline_pairs"]["detail"] == "EP 2, 3 pairs per step"
    assert checks["ep.pipeline_pairs"]["measured"] == 0.0
    assert checks["cp.attention.ulysses"]["detail"] == "CP 2, ulysses, causal, GQA 4/2"
    assert "35 of 35 checks passed" in proc.stdout
    env = doc["environment"]
    assert (env["nccl"], env["peer_access"], env["nvlink"]) == ("n/a", "n/a", "n/a")


INJECTED = [("tp.matmul_reduce_scatter.symmetric", "rel err"), ("pp.1f1b_step", "rel err"),
            ("ep.moe.dropless", "rel err"), ("ep.moe.symmetric", "rel err"),
            ("ep.int8_dispatch", "err/bound"), ("ep.pipeline_pairs", "rel err"),
            ("cp.attention.ring", "rel err"), ("streams.event_order", "max |err|"),
            ("symm.poisoned_output", "wrong elements"),
            ("quant.all_gather.int8.async", "err/bound")]


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    """One selftest run with every check of INJECTED corrupted, and one that is not: each case
    below reads its own check from it (one run instead of ten: CI time)."""
    path = tmp_path_factory.mktemp("inject") / "selftest.json"
    names = [n for n, _ in INJECTED]
    proc = _selftest("--only", ",".join([*names, "symm.signal_ring"]),
                     "--inject-failure", ",".join(names), "--json", str(path), "--device", "cpu")
    return proc, json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize("name, metric", INJECTED)
def test_a_failing_check_makes_the_exit_code_nonzero(injected, name, metric):
    proc, doc = injected
    assert proc.returncode == 1 and doc is not None, proc.stdout + proc.stderr
    assert doc["passed"] is False
    by_name = {c["name"]: c for c in doc["checks"]}
    assert sorted(by_name) == sorted([n for n, _ in INJECTED] + ["symm.signal_ring"])
    bad = by_name[name]
    assert bad["passed"] is False and bad["metric"] == metric
    assert bad["measured"] > 100 * bad["limit"]     # the injected error, +1e3 on one element
    assert "exceeds" in bad["error"] and bad["error"].startswith("rank ")
    assert by_name["symm.signal_ring"]["passed"] is True
    assert f"1 of {len(INJECTED) + 1} checks passed" in proc.stdout
    failed = proc.stdout.split("FAILED: ", 1)[1].splitlines()[0].split(", ")
    assert sorted(failed) == sorted(n for n, _ in INJECTED)
    # Its progress line, as it finished, said so.
    assert (name, "FAIL") in _progress(proc.stdout, [c["name"] for c in doc["checks"]])


def test_only_matching_nothing_is_one_line_naming_the_checks():
    proc = _selftest("--only", "no.such.check,nor.this", "--device", "cpu", timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout  # nothing started
    assert proc.stderr == ("overlap-selftest: error: --only 'no.such.check,nor.this' matches "
                           f"none of the {len(CPU_CHECKS)} checks on cpu: "
                           f"{', '.join(CPU_CHECKS)}\n")


@pytest.mark.parametrize("args, message", [
    (["--world-size", "1"], "--world-size must be an integer >= 2"),
    (["--peer-timeout", "90"], "--peer-timeout (90.0) must be less than --op-timeout (60.0)"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_flags_exit_2_before_any_process_starts(args, message):
    proc = _selftest(*args, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_cuda_without_gpus_is_a_clear_error():
    proc = _selftest("--device", "cuda", timeout=60)
    assert proc.returncode == 2
    assert "this machine has 0 GPU(s)" in proc.stderr


def test_under_torchrun_rank_0_reports(tmp_path):
    path = tmp_path / "selftest.json"
    only = "tp.all_gather_matmul.symmetric,quant.all_reduce.int8.sync,pp.1f1b_step"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "-m", "overlap.selftest", "--only", only, "--json", str(path)],
                          capture_output=True, text=True, timeout=240,
                          env=without_gpus(TMPDIR=str(tmp_path)))  # torchrun's log dir
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(path.read_text())
    assert (doc["mode"], doc["world_size"], doc["passed"]) == ("torchrun", 2, True)
    assert [c["name"] for c in doc["checks"]] == only.split(",")
    assert all(c["measured"] <= c["limit"] for c in doc["checks"])
    assert proc.stdout.count("overlap-selftest: environment") == 1  # only rank 0 prints
    assert _progress(proc.stdout, only.split(",")) == [(n, "pass") for n in only.split(",")]


def test_detection_without_gpus_reports_na():
    """detect() in a process that sees no GPU (on a GPU machine too: its GPUs hidden)."""
    import triton

    code = ("import json; from overlap.selftest.env import detect; e = detect(); "
            "print(json.dumps({'env': e.as_dict(), 'rows': dict(e.rows())}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=without_gpus())
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    env, rows = out["env"], out["rows"]
    assert env["num_gpus"] == 0 and env["devices"] == ["cpu"]
    for field in ("nccl", "cuda_driver", "peer_access", "p2p_atomics", "nvlink",
                  "torch_symmetric_memory"):
        assert env[field] == "n/a", field
    assert env["torch"] == torch.__version__ and env["triton"] == triton.__version__
    assert env["torch_cuda_runtime"] == (torch.version.cuda or "n/a")
    assert env["triton_mode"] == "interpreter, TRITON_INTERPRET=1"
    assert env["overlap_c_extension"] == "built"
    assert env["cpu_cores"] == os.cpu_count()
    assert rows["NCCL"] == "n/a"
    assert env["nvlink"] == "n/a"


TOPO_NVLINK = """\
\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tSYS\t0-63\t0
GPU1\tNV12\t X \tNV6\t0-63\t0
GPU2\tSYS\tNV6\t X \t64-127\t1

Legend:
  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""
TOPO_PCIE = """\
\tGPU0\tGPU1\tCPU Affinity
GPU0\t X \tPHB\t0-31
GPU1\tPHB\t X \t0-31
"""


def test_nvlink_summary_from_nvidia_smi_topo():
    assert nvlink_from_topo(TOPO_NVLINK) == "yes: NV12/NV6 on 4 of 6 GPU pairs"
    assert nvlink_from_topo(TOPO_PCIE) == "no: GPUs linked by PHB (PCIe or system)"
    assert nvlink_from_topo("No devices were found") == "unknown"


def _row(name, passed, seconds, measured=None, error=""):
    return {"name": name, "passed": passed, "seconds": seconds, "metric": "rel err",
            "measured": measured, "limit": 1e-5, "error": error, "detail": ""}


def test_merge_fails_a_check_that_failed_or_was_missing_on_any_rank():
    per_rank = [[_row("a", True, 0.5, 1e-7), _row("b", True, 0.1, 2e-7)],
                [_row("a", False, 0.7, 3.0, "rel err 3 exceeds 1e-05"), _row("b", True, 0.2, 0.0)],
                None]
    a, b = merge(["a", "b"], per_rank, [None, None, "died: exited with code 9"])
    assert (a.passed, a.seconds, a.measured) == (False, 0.7, 3.0)
    assert a.error == ("rank 1: rel err 3 exceeds 1e-05; rank 2: died: exited with code 9")
    assert (b.passed, b.seconds, b.measured) == (False, 0.2, 2e-7)
    assert b.error == "rank 2: died: exited with code 9"
    (c,) = merge(["c"], [[_row("c", True, 0.3, 1e-8)], [_row("c", True, 0.4, None)]],
                 [None, None])
    assert (c.passed, c.seconds, c.measured, c.error) == (True, 0.4, 1e-8, "")


def _run_rank_with_own_flags():
    """run_rank where the last rank selects other checks (a per-node command line)."""
    import torch.distributed as dist

    from overlap.selftest.config import SelftestConfig
    from overlap.selftest.runner import run_rank

    last = dist.get_rank() == dist.get_world_size() - 1
    cfg = SelftestConfig(only="streams.*" if last else "timeout.*", op_timeout=20.0)
    try:
        run_rank(cfg, "cpu")
    except ValueError as exc:
        return str(exc)
    return "ran"


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_select_other_checks_refuse_together(world):
    from tests.harness import run_ranks

    for rank, msg in enumerate(run_ranks(_run_rank_with_own_flags, world, timeout=60)):
        assert "overlap-selftest" in msg and "'checks'" in msg, (rank, msg)
        assert f"(rank {rank})" in msg, (rank, msg)
