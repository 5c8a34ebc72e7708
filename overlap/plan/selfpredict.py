"""Predict the step time of ``python -m overlap.train`` on this machine, and compare.

``python -m overlap.plan.selfpredict --profile local.json [--measure]`` maps each
configuration's ``TrainConfig`` to the planner's model and layout, estimates its step with the
calibrated profile (all ranks on this machine, sharing ``host_cores`` cores), and with
``--measure`` runs the job (one at a time) and reads the median step time it prints. The table
it prints is the CPU self-prediction table of docs/planner.md. Nothing measured from the job feeds the
prediction: the profile comes only from ``overlap-plan --calibrate``'s micro-benchmarks, except
the number of free cores, which other jobs on a shared machine change by the minute and which
is therefore measured again (the same micro-benchmark) just before and just after each run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from overlap.plan.estimate import Estimate, estimate
from overlap.plan.hardware import ClusterSpec, DeviceProfile
from overlap.plan.layout import Layout
from overlap.plan.models import ModelSpec

__all__ = ["CONFIGS", "plan_inputs", "predict", "measure"]

# The default configuration and two others (each is a list of overlap.train flags).
CONFIGS: tuple[tuple[str, ...], ...] = ((), ("--tp", "1", "--pp", "2", "--dp", "4"),
                                        ("--tp", "2", "--pp", "1", "--dp", "4"))
_SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zb-h1": "zb-h1"}


def plan_inputs(cfg) -> tuple[ModelSpec, Layout]:
    """The planner's view of a ``TrainConfig``: overlap's GPT (untied head, learned positions,
    biases, no dropout) with the job's degrees, batch split, recomputation, offloading and
    dtype, and the runtime's overlaps on."""
    from overlap.train.config import VOCAB_SIZE

    moe = dict(num_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k,
               num_shared_experts=cfg.moe_shared_experts, moe_every=cfg.moe_every,
               moe_ffn=4 * cfg.d_model) if cfg.moe_experts else {}
    model = ModelSpec(name="overlap-train", num_layers=cfg.n_layer, hidden=cfg.d_model,
                      num_heads=cfg.n_head, vocab=VOCAB_SIZE, seq_len=cfg.seq_len,
                      tied_embeddings=False, dropout=False, **moe)
    moe_layout = (dict(ep=cfg.ep, capacity_factor=cfg.capacity_factor or None)
                  if cfg.moe_experts else {})
    layout = Layout(tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, cp_method=cfg.cp_method,
                    global_batch=cfg.dp * cfg.micro_batches * cfg.micro_batch_size,
                    micro_batch=cfg.micro_batch_size,
                    schedule=_SCHEDULES[cfg.schedule],
                    virtual=cfg.virtual_stages if cfg.schedule == "interleaved" else 1,
                    recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel,
                    flash_attention=True, zero=1 if cfg.sharded_optimizer else 0,
                    comm_dtype=cfg.comm_dtype, fp32_main_grads=True,
                    dtype_bytes=2 if cfg.dtype == "bf16" else 4,
                    bucket_bytes=cfg.bucket_mb * 2**20, offload=cfg.offload_activations,
                    **moe_layout)
    return model, layout


def predict(argv: tuple[str, ...], profile: DeviceProfile) -> Estimate:
    from overlap.train.config import parse_args

    cfg = parse_args(list(argv))
    model, layout = plan_inputs(cfg)
    return estimate(model, ClusterSpec.local(profile, cfg.world_size), layout)


_STEP = re.compile(r"step time\s+([0-9.]+) ms \(median")


def measure(argv: tuple[str, ...], timeout: float = 900.0) -> float:
    """Run ``python -m overlap.train`` with ``argv`` and return its median step time (s)."""
    proc = subprocess.run([sys.executable, "-m", "overlap.train", *argv], capture_output=True,
                          text=True, timeout=timeout)
    found = _STEP.search(proc.stdout)
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise RuntimeError(f"overlap.train {' '.join(argv)} failed (exit {proc.returncode}):\n"
                           f"{tail}")
    return float(found.group(1)) / 1e3


def _name(conf: tuple[str, ...]) -> str:
    return " ".join(conf) or "default (--tp 2 --pp 2 --dp 2)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m overlap.plan.selfpredict",
                                description=__doc__.split("\n")[0])
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
            est = predict(conf, profile)
            print(f"| {_name(conf)} | {est.step_time_s * 1e3:.0f} ms | "
                  f"{'yes' if est.cpu_bound else 'no'} |")
        return 0
    from overlap.plan.calibrate import measure_cores
    from overlap.train.config import parse_args

    print("| configuration | cores free (before/after) | predicted step | measured step | "
          "error | load avg |")
    print("|---|---:|---:|---:|---:|---:|")
    for conf in CONFIGS:
        ranks = parse_args(list(conf)).world_size
        before = measure_cores(ranks)
        secs = measure(conf)
        after = measure_cores(ranks)
        # The other tenants' load changes by the minute: the one profile number that is
        # re-measured around each run is how many cores were free.
        est = predict(conf, profile.replace(host_cores=(before + after) / 2))
        print(f"| {_name(conf)} | {before:.2f} / {after:.2f} | {est.step_time_s * 1e3:.0f} ms | "
              f"{secs * 1e3:.0f} ms | {100 * (est.step_time_s / secs - 1):+.0f}% | "
              f"{os.getloadavg()[0]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
