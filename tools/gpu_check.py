"""The GPU check: every multi-rank GPU path and the kernels against the device's limits, in one
command that one GPU runs in at most ten minutes (ranks share the GPUs there are: --ranks-per-gpu).

    python tools/gpu_check.py                   # on a machine with a GPU
    python tools/gpu_check.py --device cpu      # the CPU-possible steps, on the CPU twins (CI)

Steps: build; overlap-selftest at 2 and 4 ranks; the requires_gpu tests; the main job with its
defaults and --check, then --ep 2 --moe-experts 8, --cp 2, --offload-activations all; the
kernel benches (bench/bench_kernels.py). Each step runs in a session of its own, bounded by its
timeout and by what is left of --budget: a step still running then has every one of its
processes print its Python stack (SIGUSR2, registered by overlap at import) before they are
killed. Writes one results file (the machine line, the pass/fail table, the kernel table, the
failing steps' log tails), each step's full log beside it, and prints the table last. Exit
status 0 iff every step passed. The narrative: docs/gpu-check.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import glob
import math
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
# The main job on the CPU twins: the default layout (tp2 x pp2 x dp2) at a size the CPU runs fast.
CPU_JOB = ["--steps", "2", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len",
           "16", "--micro-batch-size", "2", "--micro-batches", "2"]
GPU_JOB = ["--steps", "6"]
# overlap-selftest on the CPU twins: one check of each kind (the full list runs in CI already).
CPU_CHECKS = "tp.all_gather_matmul.*,quant.all_reduce.int8.sync,symm.*,pp.*,ep.moe.capacity"
STACK_GRACE_S = 3.0  # after SIGUSR2, before SIGKILL: time to print the stacks


@dataclasses.dataclass(slots=True)
class Step:
    name: str
    argv: list[str]
    timeout: float
    ranks: int = 1  # processes of the step that need a GPU each
    per_gpu: int = 1  # ranks per GPU it runs at: ranks over the GPUs there are, rounded up
    status: str = "not run"
    seconds: float = 0.0
    detail: str = ""
    log: str = ""


def plan(device: str, gpus: int, out_dir: str) -> list[Step]:
    """Every step, in order, with its command for ``device`` on ``gpus`` GPUs."""
    cpu = device == "cpu"
    selftest = [PY, "-m", "overlap.selftest", "--device", device]
    if cpu:
        selftest += ["--only", CPU_CHECKS]
    gpu_test_files = sorted(f for f in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))
                            if "@requires_gpu" in open(f).read())
    pytest = [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *gpu_test_files]
    if cpu:  # the twins ran them in the test suite: here, that the selection finds them
        pytest.append("--collect-only")
    job = CPU_JOB if cpu else GPU_JOB

    def train(*extra: str) -> list[str]:
        if cpu:  # overlap-train starts its own local ranks on the CPU
            return [PY, "-m", "overlap.train", *job, *extra]
        return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", "-m",
                "overlap.train", *job, *extra]

    build = ([PY, "-c", "import overlap._C, overlap.kernels.compile_check; print('overlap._C', "
                        "overlap._C.__file__)"] if cpu else
             [PY, "-c", _BUILD_GPU])
    steps = [
        Step("build", build, 240),
        Step("selftest, 2 ranks", [*selftest, "--world-size", "2"], 150, ranks=2),
        Step("selftest, 4 ranks", [*selftest, "--world-size", "4"], 180, ranks=4),
        Step("requires_gpu tests", pytest, 240, ranks=4),
        Step("main job, defaults, --check", train("--check"), 150, ranks=8),
        Step("main job, --ep 2 --moe-experts 8", train("--ep", "2", "--moe-experts", "8"), 120,
             ranks=8),
        Step("main job, --cp 2", train("--cp", "2", "--dp", "1"), 120, ranks=8),
        Step("main job, --offload-activations all", train("--offload-activations", "all"), 120,
             ranks=8),
        Step("kernel benches", [PY, "-m", "bench.bench_kernels", "--device", device, "--out",
                                os.path.join(out_dir, "kernels")], 150),
    ]
    return steps


# Build the extension in place, then compile every kernel for this GPU's architecture as the
# runtime compiles it (NVRTC, Triton).
_BUILD_GPU = """
import subprocess, sys, torch
subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], check=True)
major, minor = torch.cuda.get_device_capability(0)
subprocess.run([sys.executable, "-m", "overlap.kernels.compile_check", "--nvrtc", "--triton",
                "--arch", f"{major}{minor}"], check=True)
"""


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            pids.append(int(entry))
    return pids


def run_step(step: Step, env: dict[str, str], log_path: str, limit: float) -> None:
    """Run ``step`` for at most ``limit`` seconds; its output goes to ``log_path``."""
    step.log = log_path
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(step.argv)}\n")
        log.flush()
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            step.status = "pass" if rc == 0 else "FAIL"
            step.detail = "" if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            pids = _session_pids(proc.pid)  # the step's session: its id is the leader's pid
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGUSR2)
                except ProcessLookupError:
                    pass
            time.sleep(STACK_GRACE_S)
            for pid in _session_pids(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            step.status = "FAIL"
            step.detail = (f"hung: still running after {limit:.0f} s; the Python stacks of its "
                           f"{len(pids)} processes are in the log")
    step.seconds = time.monotonic() - t0


def machine_line() -> dict[str, str]:
    """GPU, driver, torch, Triton, NCCL, cupy: what the results were measured on."""
    from overlap.selftest.env import detect

    env = detect()
    return {"gpu": "; ".join(env.devices) or "none", "driver": env.cuda_driver,
            "torch": env.torch, "cuda runtime": env.torch_cuda_runtime, "triton": env.triton,
            "nccl": env.nccl, "cupy": env.cupy, "host cpu cores": str(env.cpu_cores)}


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def table(steps: list[Step]) -> str:
    rows = [("step", "result", "seconds", "ranks/GPU", "detail")]
    rows += [(s.name, s.status, f"{s.seconds:.1f}", s.per_gpu, s.detail) for s in steps]
    widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in rows)


def write_results(path: str, steps: list[Step], machine: dict[str, str], device: str,
                  seconds: float, kernels_md: str) -> None:
    failed = [s for s in steps if s.status != "pass"]
    lines = [f"# GPU check ({'CPU twins' if device == 'cpu' else device})", "",
             "Machine: " + ", ".join(f"{k}: {v}" for k, v in machine.items()) + ".", "",
             f"Run {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC by `python "
             f"tools/gpu_check.py{' --device cpu' if device == 'cpu' else ''}`: "
             f"{len(steps) - len(failed)} of {len(steps)} steps passed in {seconds:.0f} s.", "",
             "| step | result | seconds | ranks per GPU | detail |", "|---|---|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.1f} | {s.per_gpu} | {s.detail} |"
              for s in steps]
    if any(s.per_gpu > 1 for s in steps):
        lines += ["", "Ranks sharing a GPU run for correctness: their timings mean nothing for "
                      "speed (the kernel benches run at one rank)."]
    if kernels_md:
        lines += ["", "## Kernel benches", "", kernels_md.split("\n", 1)[1].strip()]
    for s in failed:
        if s.log:
            lines += ["", f"## {s.name}: last lines of {os.path.basename(s.log)}", "", "```",
                      _tail(s.log).rstrip(), "```"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: the GPUs there are; cpu: the CPU-possible steps on the twins "
                        "(default: cuda where torch sees a GPU)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="the results file (default: bench/results/gpu/gpu_check.md, or "
                        "gpu_check_cpu.md with --device cpu); step logs go beside it")
    p.add_argument("--budget", type=float, default=600.0, metavar="S",
                   help="seconds for the whole check (default 600); a step gets at most what "
                        "is left")
    p.add_argument("--only", default=None, metavar="NAMES",
                   help="run only the steps whose name contains one of these comma-separated "
                        "words")
    a = p.parse_args(argv)
    from overlap.dist.device import RANKS_PER_GPU_ENV, gpu_present

    device = a.device if a.device != "auto" else ("cuda" if gpu_present() else "cpu")
    if device == "cuda" and not gpu_present():
        p.error("--device cuda, but this machine has no CUDA GPU (--device cpu runs the "
                "CPU-possible steps)")
    if not a.budget > 0:
        p.error(f"--budget must be > 0 seconds, got {a.budget}")
    out = a.out or os.path.join(ROOT, "bench", "results", "gpu",
                                "gpu_check_cpu.md" if device == "cpu" else "gpu_check.md")
    out_dir = os.path.dirname(os.path.abspath(out))
    logs = os.path.splitext(os.path.abspath(out))[0] + "_logs"
    os.makedirs(logs, exist_ok=True)
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 1
    steps = plan(device, gpus, logs)
    if a.only:
        words = [w.strip() for w in a.only.split(",") if w.strip()]
        steps = [s for s in steps if any(w in s.name for w in words)]
        if not steps:
            p.error(f"--only {a.only!r} matches no step; the steps: "
                    + "; ".join(s.name for s in plan(device, gpus, logs)))
    t0 = time.monotonic()
    deadline = t0 + a.budget
    for i, step in enumerate(steps):
        step.per_gpu = max(1, math.ceil(step.ranks / gpus))
        env = dict(os.environ, PYTHONUNBUFFERED="1", OVERLAP_STACKS_ON_SIGUSR2="1",
                   **{RANKS_PER_GPU_ENV: str(step.per_gpu)})
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        left = deadline - time.monotonic()
        if left <= 1:
            step.status, step.detail = "FAIL", f"not run: the {a.budget:.0f} s budget was spent"
            continue
        print(f"gpu_check: [{i + 1}/{len(steps)}] {step.name} ...", flush=True)
        run_step(step, env, os.path.join(logs, f"{i + 1:02d}.log"), min(step.timeout, left))
        print(f"gpu_check: [{i + 1}/{len(steps)}] {step.name}: {step.status} "
              f"({step.seconds:.1f} s){': ' + step.detail if step.detail else ''}", flush=True)
    seconds = time.monotonic() - t0
    kernels_md = ""
    if os.path.exists(os.path.join(logs, "kernels.md")):
        with open(os.path.join(logs, "kernels.md")) as f:
            kernels_md = f.read()
    write_results(out, steps, machine_line(), device, seconds, kernels_md)
    failed = [s.name for s in steps if s.status != "pass"]
    print(f"\ngpu_check: wrote {os.path.relpath(out, os.getcwd())} (logs: "
          f"{os.path.relpath(logs, os.getcwd())})\n")
    print(table(steps))
    print(f"\n{len(steps) - len(failed)} of {len(steps)} steps passed in {seconds:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
