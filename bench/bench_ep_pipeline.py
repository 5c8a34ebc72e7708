"""EP all-to-all inside the pipeline schedules: the main job's exposed all-to-all time and step
time with the in-schedule pairs (a forward and a backward of two micro-batches under each
other's all-to-alls) vs without, per schedule, in the same run.

    python -m bench.bench_ep_pipeline              # CPU: 8 local ranks, tp2 x (pp x dp = 4), ep2
    torchrun --nproc-per-node 8 -m bench.bench_ep_pipeline   # GPUs: NCCL, one GPU per rank

Writes bench/results/ep_pipeline.json and ep_pipeline.md (``--out`` to change).

Each repetition is one ``overlap-train --compare-ep-overlap`` job: the pairs-on and pairs-off
jobs train the same model from the same seed on the same ranks, taking turns step by step, so
both see the same machine load. ``exposed_ep_ms`` is the time the ranks spent blocked in EP
waits (all-to-alls and the dropless counts), mean over ranks, median over steps >= 1, then the
median over repetitions; ``ratio`` is off / on (above 1: the pairs hid some of it).
"""

from __future__ import annotations

import dataclasses
import os
import statistics

from bench.runner import Table, command_line, parse_config


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig:
    runs: str = "1f1b:1,1f1b:2,interleaved:2,zb-h1:2"  # schedule:pp (dp = 4 / pp, tp 2)
    repeats: int = 3
    steps: int = 8
    micro_batches: int = 4
    micro_batch_size: int = 4
    seq_len: int = 64
    d_model: int = 64
    n_layer: int = 4
    moe_experts: int = 8
    capacity_factor: float = 0.0
    out: str = "bench/results/ep_pipeline"


def _job(cfg: BenchConfig, schedule: str, pp: int) -> tuple[list[dict], list[dict], int]:
    from overlap.train.__main__ import _run
    from overlap.train.config import parse_args

    args = ["--steps", str(cfg.steps), "--schedule", schedule, "--pp", str(pp), "--dp",
            str(4 // pp), "--tp", "2", "--micro-batches",
            str(cfg.micro_batches), "--micro-batch-size", str(cfg.micro_batch_size),
            "--seq-len", str(cfg.seq_len), "--d-model", str(cfg.d_model), "--n-layer",
            str(cfg.n_layer), "--moe-experts", str(cfg.moe_experts), "--ep", "2",
            "--capacity-factor", str(cfg.capacity_factor), "--compare-ep-overlap"]
    results = _run(parse_args(args))
    if not results:  # a non-zero rank under torchrun: rank 0 reports
        return [], [], 0
    r0 = results[0]
    return r0["records"], r0["records_no_overlap"], r0["ep_pairs"]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(BenchConfig, __doc__.splitlines()[0], argv)
    table = Table("EP all-to-all inside the pipeline schedules: pairs on vs off",
                  ["schedule", "layout", "pairs_rank0", "exposed_ep_ms_on", "exposed_ep_ms_off", "ratio",
                   "step_ms_on", "step_ms_off", "step_ratio", "max_loss_diff"])
    load0 = os.getloadavg()[0]
    for run in cfg.runs.split(","):
        schedule, pp = run.split(":")[0], int(run.split(":")[1])
        ep_on, ep_off, st_on, st_off, diffs, pairs = [], [], [], [], [], 0
        for _ in range(cfg.repeats):
            on, off, pairs = _job(cfg, schedule, pp)
            if not on:
                return 0
            med = statistics.median
            ep_on.append(1e3 * med(r["ep_exposed_s"] for r in on[1:]))
            ep_off.append(1e3 * med(r["ep_exposed_s"] for r in off[1:]))
            st_on.append(1e3 * med(r["step_s"] for r in on[1:]))
            st_off.append(1e3 * med(r["step_s"] for r in off[1:]))
            diffs.append(max(abs(a["loss"] - b["loss"]) for a, b in zip(on, off)))
        med = statistics.median
        table.add(schedule=schedule, layout=f"tp2 pp{pp} dp{4 // pp}", pairs_rank0=pairs, exposed_ep_ms_on=med(ep_on),
                  exposed_ep_ms_off=med(ep_off), ratio=med(ep_off) / max(med(ep_on), 1e-9),
                  step_ms_on=med(st_on), step_ms_off=med(st_off),
                  step_ratio=med(st_off) / med(st_on), max_loss_diff=max(diffs))
    table.notes += [
        f"overlap-train on 8 ranks (tp2 x pp x dp) with ep2, {cfg.n_layer} blocks, every one MoE "
        f"({cfg.moe_experts} experts, top-2, "
        + (f"capacity factor {cfg.capacity_factor:g}" if cfg.capacity_factor else "dropless")
        + f"), d_model {cfg.d_model}, seq {cfg.seq_len}, {cfg.micro_batches} micro-batches of "
        f"{cfg.micro_batch_size}; chunked EP exchange (2 pieces) in both runs; "
        f"{cfg.steps} steps per job, step 0 excluded, {cfg.repeats} jobs per schedule; 1-min "
        f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after (on 2 cores).",
        "exposed_ep_ms: time blocked in EP waits per step (mean over ranks); ratio = off / on; "
        "step_ratio = off / on (above 1: faster with the pairs). On this CPU the 8 ranks share "
        "2 cores, so a rank's compute and its peers' compete for the same cores: the numbers "
        "show the mechanism, not a GPU's gain.",
        "Command: " + command_line("bench.bench_ep_pipeline", cfg)]
    table.publish(cfg.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
