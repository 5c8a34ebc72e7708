"""``overlap-selftest`` / ``python -m overlap.selftest``: the first command on a new machine.

Prints what the machine has (devices, versions, peer access, NVLink, symmetric memory) first,
runs every check on the available devices with a line as each finishes, then prints a table
(check, result, time, measured, error), writes it all as JSON with ``--json PATH`` and exits 0
iff every check passed.

Without torchrun it starts its own local ranks: one per GPU with NCCL when there are at least
two GPUs (``--ranks-per-gpu N``: N per GPU, so one GPU runs them too), else 2 CPU ranks
(``--world-size``) on nccl_twin (gloo with NCCL's ordering rules).
Under torchrun (RANK/WORLD_SIZE set) or an srun step of >= 2 tasks (``overlap.dist.slurm``)
every process runs its rank and rank 0 reports.
"""

from __future__ import annotations

import os
import sys
import time

from overlap.selftest.config import SelftestConfig, parse_args

__all__ = ["main"]


def _placement(cfg: SelftestConfig, num_gpus: int, per_gpu: int) -> tuple[str, int, str]:
    """(device type, world size, a note for the report) for a local run; exits 2 if the
    requested placement cannot work. ``per_gpu`` ranks share each GPU."""
    device = cfg.device
    room = num_gpus * per_gpu
    note = ""
    if device == "auto":
        device = "cuda" if room >= 2 else "cpu"
        if num_gpus == 1 and room < 2:
            note = ("1 GPU found: the checks need >= 2 ranks, so the CPU twins ran; "
                    "--ranks-per-gpu 2 runs two ranks on it and checks the GPU paths")
    if device == "cuda":
        world = cfg.world_size or room
        if room < 2 or world > room:
            print(f"overlap-selftest: error: --device cuda needs >= 2 ranks and a GPU for each; "
                  f"this machine has {num_gpus} GPU(s) at {per_gpu} rank(s) per GPU"
                  + (f", --world-size asks for {world}" if cfg.world_size else "")
                  + (f" (--ranks-per-gpu {-(-max(world, 2) // num_gpus)} makes room)"
                     if num_gpus else ""), file=sys.stderr)
            sys.exit(2)
        return device, world, note
    return device, cfg.world_size or 2, note


def _announce(env, *, device: str, world: int, mode: str) -> None:
    """The environment block and the run's line, before any check runs (flushed: the ranks'
    progress lines follow on the same stream)."""
    from overlap.dist.device import ranks_per_gpu
    from overlap.selftest.report import format_environment

    per_gpu = ranks_per_gpu()
    transport = "nccl" if device == "cuda" else "nccl_twin"
    print("overlap-selftest: environment")
    print(format_environment(env.rows()))
    print(f"\nchecks on {world} {device} ranks ({mode}, {transport}"
          + (f", {per_gpu} per GPU" if per_gpu > 1 else "") + "):", flush=True)


def _report(cfg: SelftestConfig, env, results, *, device: str, world: int, mode: str,
            seconds: float, note: str) -> bool:
    from overlap.selftest.report import format_table, write_json

    passed = bool(results) and all(r.passed for r in results)
    from overlap.dist.device import ranks_per_gpu, sharing_note

    transport = "nccl" if device == "cuda" else "nccl_twin"
    per_gpu = ranks_per_gpu()
    print()
    print(format_table(results))
    for line in (note, sharing_note(per_gpu)):
        if line:
            print(f"\nnote: {line}")
    failed = [r.name for r in results if not r.passed]
    summary = f"{len(results) - len(failed)} of {len(results)} checks passed in {seconds:.1f} s"
    if failed:
        summary += f"; FAILED: {', '.join(failed)}"
    print(f"\n{summary}")
    if cfg.json:
        write_json(cfg.json, environment=env.as_dict(),
                   run={"device": device, "world_size": world, "transport": transport,
                        "ranks_per_gpu": per_gpu, "mode": mode, "seconds": round(seconds, 3),
                        "note": note},
                   results=results)
        print(f"wrote {cfg.json}")
    return passed


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    from overlap.dist.device import RANKS_PER_GPU_ENV, ranks_per_gpu
    from overlap.dist.slurm import adopt_or_exit
    from overlap.selftest.env import detect
    from overlap.selftest.runner import no_match_error, run_local, run_torchrun, under_torchrun

    t0 = time.monotonic()
    try:  # the flag, else the environment's; the ranks read it from their environment
        per_gpu = ranks_per_gpu(cfg.ranks_per_gpu)
    except ValueError as exc:
        print(f"overlap-selftest: error: {exc}", file=sys.stderr)
        return 2
    os.environ[RANKS_PER_GPU_ENV] = str(per_gpu)
    srun = adopt_or_exit("overlap-selftest", tp=None) is not None  # sets torchrun's variables
    if under_torchrun():
        mode, env = "srun" if srun else "torchrun", None

        def announce(device: str, world: int) -> None:  # rank 0, once its device is set
            nonlocal env
            env = detect()
            _announce(env, device=device, world=world, mode=mode)

        results, passed, device, world = run_torchrun(cfg, announce)
        if results is not None:  # rank 0 reports
            _report(cfg, env, results, device=device, world=world, mode=mode,
                    seconds=time.monotonic() - t0, note="")
        return 0 if passed else 1
    env = detect()
    device, world, note = _placement(cfg, env.num_gpus, per_gpu)
    error = no_match_error(cfg, device)
    if error:  # a bad flag: nothing starts
        print(error, file=sys.stderr)
        return 2
    _announce(env, device=device, world=world, mode="local processes")
    results = run_local(cfg, device, world)
    passed = _report(cfg, env, results, device=device, world=world, mode="local processes",
                     seconds=time.monotonic() - t0, note=note)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
