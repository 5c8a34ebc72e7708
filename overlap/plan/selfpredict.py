"""Predict the step time of ``python -m overlap.train`` on this machine, and compare.

``plan_inputs`` maps a job's settings (a ``TrainConfig``'s plain values; the planner does not
import the training job) to the planner's model and layout, ``predict`` estimates its step with
the calibrated profile (all ranks on this machine, sharing ``host_cores`` cores), ``measure``
runs the job and reads the median step time it prints. ``python -m overlap.train.selfpredict
--profile local.json [--measure]`` prints the CPU self-prediction table of docs/planner.md
for ``CONFIGS``. Nothing measured from the job feeds the prediction: the profile comes only
from ``overlap-plan --calibrate``'s micro-benchmarks, except the number of free cores, which
other jobs on a shared machine change by the minute and which is therefore measured again (the
same micro-benchmark) just before and just after each run.
"""

from __future__ import annotations

import re
import subprocess
import sys

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
    moe = dict(num_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k,
               num_shared_experts=cfg.moe_shared_experts, moe_every=cfg.moe_every,
               moe_ffn=4 * cfg.d_model) if cfg.moe_experts else {}
    model = ModelSpec(name="overlap-train", num_layers=cfg.n_layer, hidden=cfg.d_model,
                      num_heads=cfg.n_head, vocab=cfg.vocab_size, seq_len=cfg.seq_len,
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


def predict(cfg, profile: DeviceProfile) -> Estimate:
    """The planner's step of the job ``cfg`` (a ``TrainConfig``) on this machine."""
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
