"""Run the checks on every rank: as local processes this command starts, or under torchrun.

Each rank runs the same list of checks in the same order. Before each check the ranks meet on
a control group (plain gloo, outside every communicator under test), so a check's time is its
own, and a rank that fell behind is named instead of hanging the next check. A check's
failure is caught and recorded on that rank; the other ranks of that check are released by
the ops' own timeouts (``--op-timeout``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from overlap.selftest.checks import CheckFailed, RankContext, plan
from overlap.selftest.config import SelftestConfig
from overlap.selftest.report import CheckResult, Progress, RankResult, merge

__all__ = ["run_rank", "run_local", "run_torchrun", "under_torchrun", "check_names",
           "no_match_error"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def check_names(cfg: SelftestConfig, device_type: str) -> list[str]:
    return [name for name, _ in plan(torch.device(device_type)) if cfg.selects(name)]


def no_match_error(cfg: SelftestConfig, device_type: str) -> str | None:
    """The one-line error when ``--only`` selects none of this device's checks, naming them."""
    if check_names(cfg, device_type):
        return None
    names = [name for name, _ in plan(torch.device(device_type))]
    return (f"overlap-selftest: error: --only {cfg.only!r} matches none of the {len(names)} "
            f"checks on {device_type}: {', '.join(names)}")


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        from overlap.dist.device import gpu_for_rank

        return gpu_for_rank()  # cuda:(LOCAL_RANK // ranks per GPU)
    return torch.device("cpu")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_rank(cfg: SelftestConfig, device_type: str,
             control: dist.ProcessGroup | None = None) -> list[dict]:
    """Run every selected check on this rank (the default group is initialised); returns
    RankResult dicts in run order."""
    device = _device(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    if control is None:
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.op_timeout))
    meet_timeout = timedelta(seconds=2 * cfg.op_timeout)

    def meet() -> None:
        dist.monitored_barrier(group=control, timeout=meet_timeout, wait_all_ranks=True)

    results: list[RankResult] = []
    checks = [(name, fn) for name, fn in plan(device) if cfg.selects(name)]
    progress = Progress(len(checks)) if rank == 0 else None

    def meet_and_report() -> None:
        """Meet; then rank 0 prints the check every rank has just finished, merged."""
        meet()
        if results:
            rows: list | None = [None] * world if rank == 0 else None
            dist.gather_object(dataclasses.asdict(results[-1]), rows, dst=0, group=control)
            if progress is not None:
                progress(merge([results[-1].name], [[r] for r in rows], [None] * world)[0])

    # Under torchrun or srun each node parses its own flags: ranks that would run other checks
    # in the same slot refuse together, naming the difference (one all-gather of a digest).
    from overlap.dist.device import ranks_per_gpu
    from overlap.dist.stamp import agree_on

    agree_on("overlap-selftest", {"checks": [n for n, _ in checks], "device": device_type,
                                  "ranks_per_gpu": ranks_per_gpu(),
                                  "op_timeout": cfg.op_timeout,
                                  "peer_timeout": cfg.peer_timeout,
                                  "inject_failure": cfg.inject_failure},
             torch.device("cpu"), group=control)
    for i, (name, fn) in enumerate(checks):
        try:
            meet_and_report()
        except Exception as exc:  # noqa: BLE001 - a rank stuck in an earlier check
            why = f"not run: the ranks lost step before it ({_describe(exc)})"
            results += [RankResult(name=n, passed=False, seconds=0.0, error=why)
                        for n, _ in checks[i:]]
            break
        ctx = RankContext(check=name, rank=rank, world=world, device=device,
                          op_timeout=cfg.op_timeout, peer_timeout=cfg.peer_timeout,
                          corrupt=cfg.corrupts(name), barrier=meet)
        t0 = time.perf_counter()
        try:
            m = fn(ctx)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            if m is None:
                results.append(RankResult(name=name, passed=True, seconds=seconds))
                continue
            error = "" if m.passed else f"{m.metric} {m.value:.3g} exceeds {m.limit:g}"
            results.append(RankResult(name=name, passed=m.passed, seconds=seconds,
                                      metric=m.metric, measured=m.value, limit=m.limit,
                                      error=error, detail=m.detail))
        except Exception as exc:  # noqa: BLE001 - every failure is a result, not a crash
            seconds = time.perf_counter() - t0
            msg = str(exc) if isinstance(exc, CheckFailed) else _describe(exc)
            results.append(RankResult(name=name, passed=False, seconds=seconds, error=msg))
    try:
        meet_and_report()  # leave together: a rank tearing down its groups early stalls a peer
    except Exception:  # noqa: BLE001 - the results are in; a straggler was reported above
        pass
    if progress is not None:
        progress.close()
    return [dataclasses.asdict(r) for r in results]


def preload_for(device_type: str) -> tuple[str, ...]:
    """What the launcher's fork server imports for the selftest's ranks, beyond its own list:
    the ops, which saves each CPU rank their import; on GPUs launch's minimum, so that no
    import initialises CUDA before the ranks fork."""
    if device_type == "cuda":
        return ()
    return ("overlap.selftest.runner", "overlap.tp", "overlap.pp", "overlap.comm.quant")


def run_local(cfg: SelftestConfig, device_type: str, world: int) -> list[CheckResult]:
    """Start ``world`` local ranks (nccl_twin on CPU, NCCL on GPUs) and merge their results."""
    from overlap.dist.launch import LaunchError, launch

    backend = "nccl" if device_type == "cuda" else "nccl_twin"
    # The ranks come from a fork server that inherits this environment when it starts.
    if device_type == "cuda":
        # It imports torch and overlap, which asks torch.cuda.is_available(); the NVML-based
        # check answers without initialising CUDA in the process that then forks the ranks.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    else:
        # CPU twins on a machine that has a GPU: Triton must interpret, and it decides at import.
        os.environ["TRITON_INTERPRET"] = "1"
    preload = preload_for(device_type)
    teardown: list[CheckResult] = []
    try:
        outcomes = launch(run_rank, world, args=(cfg, device_type), timeout=cfg.timeout,
                          backend=backend, raise_on_error=False, preload=preload)
    except LaunchError as exc:  # every rank returned, but something left /dev/shm segments
        outcomes = exc.outcomes
        teardown.append(CheckResult(name="teardown", passed=False, seconds=0.0, metric="",
                                    measured=None, limit=None, error=str(exc), detail=""))
    per_rank = [o.value if o.status == "ok" else None for o in outcomes]
    errors = [None if o.status == "ok" else f"{o.status}: {o.error}" for o in outcomes]
    return merge(check_names(cfg, device_type), per_rank, errors) + teardown


def run_torchrun(cfg: SelftestConfig, announce: Callable[[str, int], None] | None = None
                 ) -> tuple[list[CheckResult] | None, bool, str, int]:
    """Run this process's rank; rank 0 calls ``announce(device type, world size)`` before the
    checks start. Returns (the merged results on rank 0, else None; whether every check
    passed, on every rank; the device type; the world size)."""
    device_type = "cpu" if cfg.device == "cpu" or not torch.cuda.is_available() else "cuda"
    if cfg.device == "cuda" and device_type != "cuda":
        raise SystemExit("overlap-selftest: error: --device cuda, but torch sees no GPU")
    error = no_match_error(cfg, device_type)
    if error:  # every rank, before any process group forms
        print(error, file=sys.stderr)
        sys.exit(2)
    if device_type == "cuda":
        from overlap.dist.device import apply_sharing

        apply_sharing()  # ranks sharing a GPU: their own NCCL host ids, before NCCL starts
        _device(device_type)  # before NCCL initialises: cuda:(LOCAL_RANK // ranks per GPU)
        backend = "nccl"
    else:
        from overlap.dist import nccl_twin

        if "triton" not in sys.modules:  # CPU twins: Triton interprets (decided at import)
            os.environ["TRITON_INTERPRET"] = "1"
        nccl_twin.register()
        backend = nccl_twin.BACKEND
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout))
    try:
        world = dist.get_world_size()
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.op_timeout))
        if announce is not None and dist.get_rank() == 0:
            announce(device_type, world)
        if world < 2:
            mine, error = None, "torchrun started 1 process; the checks need >= 2"
        else:
            try:
                mine, error = run_rank(cfg, device_type, control), None
            except Exception as exc:  # noqa: BLE001
                mine, error = None, _describe(exc)
        gathered: list | None = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object((mine, error), gathered, dst=0, group=control)
        results = None
        if gathered is not None:
            per_rank, errors = zip(*gathered)
            results = merge(check_names(cfg, device_type), list(per_rank), list(errors))
        verdict = [results is not None and all(r.passed for r in results)]
        dist.broadcast_object_list(verdict, src=0, group=control)  # one exit code everywhere
        return results, bool(verdict[0]), device_type, world
    finally:
        dist.destroy_process_group()
