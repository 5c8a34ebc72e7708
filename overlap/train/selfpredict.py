"""``python -m overlap.train.selfpredict --profile local.json [--measure]``: the CPU
self-prediction table of docs/planner.md for ``overlap.plan.selfpredict.CONFIGS``.

Each configuration's flags are parsed here, by the training job's own parser, and handed to the
planner as a ``TrainConfig`` (``overlap.plan.selfpredict.predict``); with ``--measure`` each
job runs too (one at a time) and the table compares. The planner does not import the training
job: this command, above both, joins them.
"""

from __future__ import annotations

import argparse
import os
import time

from overlap.plan.hardware import DeviceProfile
from overlap.plan.selfpredict import CONFIGS, measure, predict
from overlap.train.config import parse_args

__all__ = ["main"]


def _name(conf: tuple[str, ...]) -> str:
    return " ".join(conf) or "default (--tp 2 --pp 2 --dp 2)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m overlap.train.selfpredict",
                                description="Predict the step time of python -m "
                                            "overlap.train on this machine, and compare.")
    p.add_argument("--profile", required=True, help="a profile from overlap-plan --calibrate")
    p.add_argument("--measure", action="store_true", help="also run each job and compare")
    args = p.parse_args(argv)
    profile = DeviceProfile.load(args.profile)
    print(f"profile {args.profile}: {profile.host_cores:.2f} cores when calibrated; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    if not args.measure:
        print("| configuration | predicted step | CPU-bound |")
        print("|---|---:|---|")
        for conf in CONFIGS:
            est = predict(parse_args(list(conf)), profile)
            print(f"| {_name(conf)} | {est.step_time_s * 1e3:.0f} ms | "
                  f"{'yes' if est.cpu_bound else 'no'} |")
        return 0
    from overlap.plan.calibrate import measure_cores

    print("| configuration | cores free (before/after) | predicted step | measured step | "
          "error | load avg |")
    print("|---|---:|---:|---:|---:|---:|")
    for conf in CONFIGS:
        cfg = parse_args(list(conf))
        before = measure_cores(cfg.world_size)
        secs = measure(conf)
        after = measure_cores(cfg.world_size)
        # The other tenants' load changes by the minute: the one profile number that is
        # re-measured around each run is how many cores were free.
        est = predict(cfg, profile.replace(host_cores=(before + after) / 2))
        print(f"| {_name(conf)} | {before:.2f} / {after:.2f} | {est.step_time_s * 1e3:.0f} ms | "
              f"{secs * 1e3:.0f} ms | {100 * (est.step_time_s / secs - 1):+.0f}% | "
              f"{os.getloadavg()[0]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
