"""``python -m overlap.train`` / ``overlap-train``: GPT training over tp x cp x pp x dp (x ep)
with every overlap on.

Without torchrun it starts tp*pp*dp local processes itself (CPU; gloo with NCCL's ordering
rules by default, see ``overlap.dist.nccl_twin``). Under torchrun (RANK/WORLD_SIZE set) or
an srun step of >= 2 tasks (``overlap.dist.slurm``) every process runs one rank: NCCL on GPUs,
gloo otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from overlap.dist.device import sharing_note
from overlap.dist.envinit import init_from_env
from overlap.dist.heartbeat import Heartbeat
from overlap.dist.launch import LaunchError
from overlap.dist.slurm import adopt_or_exit
from overlap.profile.plot import plot_timeline
from overlap.profile.progress import Progress
from overlap.profile.trace import OverlapMetrics, exposed_percent, load_events, overlap_metrics
from overlap.train import elastic
from overlap.train.config import ConfigError, TrainConfig, parse_args
from overlap.train.elastic import root_cause
from overlap.train.events import log_event
from overlap.train.loop import PROFILED_STEPS, reference_model, train_rank
from overlap.train.shrink import choose_layout, describe_layout, layout_dict, layout_name

__all__ = ["main", "BF16_CHECK_REL", "MOE_CHECK_REL"]

# --check with --dtype bf16: per-step loss within this fraction of the fp32 reference's. Measured
# on the main job with warm-up, cosine decay and clipping: at most 1.9% over 30 steps (one
# process, bf16 parameters and activations with fp32 masters and main grads, vs fp32).
BF16_CHECK_REL = 0.03
# --check with MoE blocks: per-step loss within max(--check-tolerance, this fraction of the
# reference's). Top-k routing is discrete: a token whose two best experts score within the
# runs' rounding difference (~1e-7 relative: TP sums in another order) can take another expert
# in one run; from then on the two runs are two trajectories from nearby parameters and drift
# apart as such (no bound follows from the arithmetic). Measured on the default job
# (--ep 2 --moe-experts 8, 30 steps): 1e-7 until a flip at step 7 (1.4e-5), then 3.7e-3
# (0.15% of the loss) at step 30; 1% leaves room for another machine's summation order while
# a wrong gradient (a factor, a missing reduction) still moves the loss by more within steps.
MOE_CHECK_REL = 0.01


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _run(cfg: TrainConfig) -> list[dict]:
    """Every rank's result (under torchrun only this rank's, and only rank 0 reports)."""
    launcher = "srun" if adopt_or_exit("overlap-train", tp=cfg.tp) else "torchrun"  # sets RANK...
    if _under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        rpn = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world != cfg.world_size:
            cfg = _membership_changed(cfg, world, rpn, launcher)
        # the store keys of each torchrun attempt apart (a restart reuses the job's store)
        store = init_from_env("nccl" if torch.cuda.is_available() else "gloo",
                              timeout=cfg.timeout, ranks_per_gpu=cfg.ranks_per_gpu or None)
        beat = (Heartbeat(store, int(os.environ["RANK"]), world, rpn,
                          timeout=cfg.heartbeat_timeout, label="overlap-train",
                          fault_file=os.path.join(cfg.save, "fault_time") if cfg.save else None)
                if cfg.heartbeat_timeout > 0 else contextlib.nullcontext())
        try:
            with beat:
                result = train_rank(cfg)
        finally:
            dist.destroy_process_group()
        result["final_cfg"] = cfg
        return [result] if int(os.environ["RANK"]) == 0 else []
    return elastic.run(cfg)


def _membership_changed(cfg: TrainConfig, world: int, rpn: int, launcher: str) -> TrainConfig:
    """torchrun --nnodes MIN:MAX restarted the workers on another number of ranks (``rpn`` per
    node): with --min-nodes, continue on a planner-chosen layout of them (every rank chooses
    the same); without, refuse."""
    if not cfg.min_nodes:
        raise SystemExit(f"overlap-train: error: {launcher} started {world} processes but "
                         f"tp*cp*pp*dp = {cfg.world_size} (pass --min-nodes N to continue "
                         "on a planner-chosen layout of the ranks there are)")
    if world // rpn < cfg.min_nodes:
        raise SystemExit(f"overlap-train: error: {launcher} started {world // rpn} node(s) of "
                         f"{rpn} ranks, fewer than --min-nodes {cfg.min_nodes}")
    try:
        choice = choose_layout(cfg, world, ranks_per_node=rpn)
    except ConfigError as exc:
        raise SystemExit(f"overlap-train: error: {exc}") from None
    if int(os.environ["RANK"]) == 0:
        print(f"overlap-train: {launcher} started {world} ranks instead of {cfg.world_size}: "
              f"continuing on {layout_name(choice.cfg)} (planner's choice of {choice.ranked})"
              + "".join(f"; {c}" for c in choice.changes), file=sys.stderr, flush=True)
        log_event(cfg, "shrink" if world < cfg.world_size else "grow",
                  old_layout=layout_dict(cfg), new_layout=layout_dict(choice.cfg),
                  why=f"{launcher} membership")
    return choice.cfg


def _events_report(events: list[dict]) -> str:
    """One line per fault or layout change of the job."""
    name = describe_layout
    lines = []
    for e in events:
        resumed = (f"resumed at step {e['resumed_step']}" if "resumed_step" in e
                   else "did not resume (the next attempt failed too)")
        took = (f", training resumed {e['fault_to_resumed_s']:.2f} s after the "
                f"{'fault' if e['kind'] != 'grow' else 'nodes returned'}"
                if e.get("fault_to_resumed_s") is not None else "") + f" (attempt {e['attempt']})"
        change = (f"{name(e['old_layout'])} -> {name(e['new_layout'])}"
                  if e["old_layout"] != e["new_layout"] else f"same layout {name(e['old_layout'])}")
        lines.append(f"{e['kind']:<15} {change}; {resumed}{took}")
    return "\n".join(lines)


def _summary(cfg: TrainConfig, records: list[dict], exposed_pct: float | None = None) -> str:
    """The run in a few lines. ``exposed_pct``: the exposed communication of the traces
    (``--profile``), the number the profile table and ``overlap-analyze`` print."""
    steady = records[1:] or records  # step 0 pays for warm-up (shape exchange, bucket rebuild)
    med = statistics.median
    lines = ["", "summary", "-------",
             f"layout          tp={cfg.tp} x {f'cp={cfg.cp} x ' if cfg.cp > 1 else ''}"
             f"pp={cfg.pp} x dp={cfg.dp} "
             f"({cfg.world_size} ranks), schedule {cfg.schedule}, {cfg.micro_batches} "
             "micro-batches",
             *([f"context         each sequence in 2 x {cfg.cp} zig-zag chunks, "
                f"{cfg.cp_method} attention over cp, dense gradients reduced over dp x cp"]
               if cfg.cp > 1 else []),
             f"overlap         sequence-parallel fused TP ops ({cfg.tp_backend}) "
             f"{'on' if cfg.sequence_parallel else 'off'}, async P2P, bucketed DP reduction "
             f"({cfg.comm_dtype}), sharded optimizer {'on' if cfg.sharded_optimizer else 'off'}",
             *([f"experts         {cfg.moe_experts} per MoE block (every {cfg.moe_every}), "
                f"top-{cfg.moe_top_k}, "
                + (f"capacity factor {cfg.capacity_factor:g}" if cfg.capacity_factor
                   else "dropless")
                + f", {cfg.moe_shared_experts} shared; ep={cfg.ep} ({cfg.ep_backend} "
                  "exchange under the expert GEMMs)"] if cfg.moe_experts else []),
             f"precision       {cfg.dtype}" + (" parameters and activations, fp32 gradient "
                                               "buffers and master weights"
                                               if cfg.dtype == "bf16" else ""),
             f"steps           {len(records)}"
             + (f" (resumed at step {records[0]['step']})" if records[0]["step"] else ""),
             f"loss            {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}",
             f"step time       {1e3 * med(r['step_s'] for r in steady):.1f} ms (median, step >= 2)",
             f"tokens/s        {med(r['tokens_per_s'] for r in steady):.0f} (median)",
             f"comm wait       {100 * med(r['exposed_fraction'] for r in steady):.1f}% of the step "
             "(median over steps >= 2, mean over ranks: host time blocked in communication)"]
    if exposed_pct is not None:
        lines.append(f"exposed comm    {exposed_pct:.1f}% of the step (the traces of the last "
                     f"{PROFILED_STEPS} steps, all ranks: what overlap-analyze prints)")
    return "\n".join(lines)


def _check(cfg: TrainConfig, records: list[dict]) -> bool:
    if cfg.dropout > 0:
        # Dropout masks of a TP-sharded run are drawn per TP rank: they cannot equal the one
        # process's, so the losses agree only statistically.
        tol_of = lambda ref: max(cfg.check_tolerance, 0.05 * abs(ref))  # noqa: E731
        what = (f"the same model trained on one process with dropout {cfg.dropout} (its own "
                "masks); tolerance max(--check-tolerance, 5% of the loss)")
    elif cfg.dtype == "bf16":
        # bf16 rounds every activation and parameter copy (to ~3 significant digits); the
        # fp32 masters and gradients keep the update itself accurate, so the curves stay
        # close but not equal.
        tol_of = lambda ref: max(cfg.check_tolerance, BF16_CHECK_REL * abs(ref))  # noqa: E731
        what = (f"the same model trained on one process in fp32; bf16 tolerance "
                f"max(--check-tolerance, {BF16_CHECK_REL:.0%} of the loss)")
    elif cfg.moe_experts:
        tol_of = lambda ref: max(cfg.check_tolerance, MOE_CHECK_REL * abs(ref))  # noqa: E731
        what = (f"the same model trained on one process (same seed, data and optimizer); MoE "
                f"tolerance max(--check-tolerance, {MOE_CHECK_REL:.0%} of the loss): a router "
                "near-tie can send a token to another expert in one run, after which the runs "
                "drift apart")
    else:
        tol_of = lambda ref: cfg.check_tolerance  # noqa: E731
        what = "the same model trained on one process (same seed, data and optimizer)"
    print(f"\ncheck: training the one-process reference ({cfg.steps} steps, "
          f"{cfg.dp * cfg.micro_batches} micro-batches each)", flush=True)
    bar = Progress("check: one-process reference", stream=sys.stdout)
    try:
        _, ref_all = reference_model(cfg, dropout=cfg.dropout, on_step=bar)
    finally:
        bar.close()
    ref = ref_all[records[0]["step"]:]
    diffs = [abs(r["loss"] - x) for r, x in zip(records, ref)]
    worst = max(diffs)
    print(f"check: the job ({layout_name(cfg)}) against {what}")
    print(f"{'step':>5} {'job loss':>10} {'1-proc loss':>12} {'|diff|':>10}")
    for r, x, d in zip(records, ref, diffs):
        print(f"{r['step'] + 1:>5} {r['loss']:>10.5f} {x:>12.5f} {d:>10.2e}")
    ok = all(d <= tol_of(x) for d, x in zip(diffs, ref))
    worst_rel = max(d / tol_of(x) for d, x in zip(diffs, ref))
    print(f"check: max |loss difference| {worst:.2e}, {worst_rel:.2f} x the step's tolerance "
          f"(--check-tolerance {cfg.check_tolerance:.1e}): {'PASS' if ok else 'FAIL'}")
    return ok


def _read_profile(cfg: TrainConfig, results: list[dict]) -> tuple[list, list[OverlapMetrics]]:
    """Every rank's trace events and its ``overlap_metrics``: the one exposed-communication
    definition (overlap.profile.metrics), as ``overlap-analyze`` computes it."""
    traces = [r["trace"] for r in results if r.get("trace")]
    mb = sum(os.path.getsize(t) for t in traces) / 2**20
    print(f"profile: reading {len(traces)} traces ({mb:.0f} MB)", flush=True)
    events = [load_events(t) for t in traces]
    return events, [overlap_metrics(e) for e in events]


def _profile_report(cfg: TrainConfig, events: list, metrics: list[OverlapMetrics]) -> None:
    rows = [m.as_dict() for m in metrics]
    for rank, m in enumerate(rows):
        m["rank"] = rank
        m["main_tid"] = str(m["main_tid"])
    png = os.path.join(cfg.profile, "timeline.png")
    plot_timeline(events, png, title=f"overlap-train tp={cfg.tp} "
                                     f"{f'cp={cfg.cp} ' if cfg.cp > 1 else ''}"
                                     f"pp={cfg.pp} dp={cfg.dp}")
    out = os.path.join(cfg.profile, "overlap_metrics.json")
    with open(out, "w") as f:
        json.dump({"ranks": rows, "exposed_percent": exposed_percent(metrics)}, f, indent=1)
    print(f"\nprofile: {len(rows)} traces of the last {PROFILED_STEPS} steps (at most), "
          f"{png}, {out}")
    print(f"{'rank':>4} {'step ms':>8} {'comm ms':>8} {'exposed ms':>10} {'exposed %':>9} "
          f"{'hidden %':>9}")
    for m in rows:
        print(f"{m['rank']:>4} {1e3 * m['step_s']:>8.1f} {1e3 * m['comm_s']:>8.1f} "
              f"{1e3 * m['exposed_comm_s']:>10.1f} {100 * m['exposed_fraction']:>9.1f} "
              f"{100 * m['hidden_fraction']:>9.1f}")
    step = sum(m["step_s"] for m in rows)
    comm = sum(m["comm_s"] for m in rows)
    exposed = sum(m["exposed_comm_s"] for m in rows)
    print(f"{'all':>4} {1e3 * step:>8.1f} {1e3 * comm:>8.1f} {1e3 * exposed:>10.1f} "
          f"{exposed_percent(metrics) or 0.0:>9.1f} "
          f"{100 * (comm - exposed) / comm if comm else 0.0:>9.1f}")


def _comparison(on: list[dict], off: list[dict]) -> str:
    """--compare-no-overlap: the two interleaved runs side by side (medians over step >= 1)."""
    med = statistics.median
    rows = []
    for name, recs in (("every overlap on", on), ("every overlap off", off)):
        steady = recs[1:] or recs
        rows.append((name, 1e3 * med(r["step_s"] for r in steady),
                     100 * med(r["exposed_fraction"] for r in steady),
                     med(r["tokens_per_s"] for r in steady)))
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(on, off))
    lines = ["", "overlap on vs off (same model, data and seed; steps interleaved)",
             f"{'':20s} {'step ms':>9s} {'comm wait':>13s} {'tokens/s':>9s}"]
    lines += [f"{n:20s} {ms:9.1f} {ex:12.1f}% {tok:9.0f}" for n, ms, ex, tok in rows]
    lines.append(f"speed-up           {rows[1][1] / rows[0][1]:.2f}x step time with overlap "
                 f"(off / on), comm wait {rows[1][2]:.1f}% -> {rows[0][2]:.1f}%")
    lines.append(f"max |loss difference| between the two runs: {loss_diff:.2e} (same math, "
                 "other summation order)")
    return "\n".join(lines)


def _ep_comparison(on: list[dict], off: list[dict]) -> str:
    """--compare-ep-overlap: exposed EP all-to-all time with and without the in-schedule pairs
    (medians over step >= 1 of the mean over ranks)."""
    med = statistics.median
    rows = []
    for name, recs in (("EP pairs on", on), ("EP pairs off", off)):
        steady = recs[1:] or recs
        rows.append((name, 1e3 * med(r["ep_exposed_s"] for r in steady),
                     1e3 * med(r["step_s"] for r in steady)))
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(on, off))
    lines = ["", "in-schedule EP overlap on vs off (same model, data and seed; steps "
             "interleaved)", f"{'':14s} {'exposed EP all-to-all ms':>25s} {'step ms':>9s}"]
    lines += [f"{n:14s} {ep:25.2f} {ms:9.1f}" for n, ep, ms in rows]
    ratio = rows[1][1] / rows[0][1] if rows[0][1] > 0 else float("inf")
    lines.append(f"exposed EP all-to-all: {ratio:.2f}x less with the pairs (off / on); step "
                 f"time {rows[1][2] / rows[0][2]:.2f}x (off / on)")
    lines.append(f"max |loss difference| between the two runs: {loss_diff:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.export:
        # torch.distributed.checkpoint is 0.4 s of import, paid only by the export
        from overlap.train.checkpoint import export_model, latest_checkpoint

        path = latest_checkpoint(cfg.resume)
        keys = export_model(path, cfg.export)
        print(f"overlap-train: wrote the unsharded model of {path} ({len(keys)} tensors) to "
              f"{cfg.export}")
        return 0
    try:
        results = _run(cfg)
    except LaunchError as exc:
        print(f"overlap-train: error: the job failed; root cause:\n{root_cause(exc)}",
              file=sys.stderr)
        return 1
    if not results:  # a non-zero torchrun rank
        return 0
    cfg = results[0].get("final_cfg", cfg)  # after a shrink: the layout the job ended on
    records = results[0]["records"]
    if not records:
        print(f"overlap-train: nothing to do: the checkpoint is at step "
              f"{results[0]['start_step']} of --steps {cfg.steps}")
        return 0
    profiled = _read_profile(cfg, results) if cfg.profile else None
    print(_summary(cfg, records, exposed_percent(profiled[1]) if profiled else None))
    r0 = results[0]
    shared = (r0.get("placement") or {}).get("ranks_per_gpu", 1)
    if shared > 1:
        print(f"note            {sharing_note(shared)}")
    if r0.get("resumed_from"):
        saved, now = r0.get("checkpoint_layout") or {}, layout_dict(cfg)
        other = {k: v for k, v in saved.items() if v != now.get(k)}
        print(f"resumed         from {r0['resumed_from']} at step {r0['start_step']}"
              + (f", written by {' '.join(f'{k}={v}' for k, v in saved.items())} (resharded)"
                 if other else ""))
    if r0.get("events"):
        print(_events_report(r0["events"]))
    elif r0.get("fault_to_resumed_s") is not None:  # under torchrun: this attempt's own
        print(f"restart         training resumed {r0['fault_to_resumed_s']:.2f} s after the "
              f"fault (attempt {r0.get('attempts', 1)})")
    if cfg.moe_experts and cfg.ep > 1:
        state = ("off (--no-ep-pipeline-overlap)" if not cfg.ep_pipeline_overlap else
                 "forward and backward of two micro-batches under each other's all-to-alls, "
                 "where the schedule's cost model says it pays")
        print(f"in-schedule EP pairs {r0.get('ep_pairs', 0)} per step on pp rank 0 ({state})")
    for (shape, method), timings in zip(r0.get("cp_choices", []), r0.get("cp_timings", [])):
        measured = ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in timings.items())
        print(f"cp attention    auto chose {method} for (b, h, h_kv, s_local, d) = {shape} on "
              f"rank 0's CP group (slowest rank's forward + backward: {measured})")
    if r0.get("offload"):
        o, steps = r0["offload"], len(records)
        exposed = statistics.median(r["offload_exposed_s"] for r in records[1:] or records)
        print(f"offload         {cfg.offload_activations} blocks per chunk: "
              f"{o['offloaded_bytes'] / steps / 2**20:.2f} MiB per step to host on rank 0 "
              f"({o['offloaded'] // steps} tensors), reloaded one block ahead; waiting for "
              f"reloads {exposed * 1e3:.1f} ms per step (median, mean over ranks)")
    if r0.get("saved"):
        print(f"checkpoints     {', '.join(r0['saved'])}")
    if cfg.compare_no_overlap:
        print(_comparison(records, r0["records_no_overlap"]))
    if cfg.compare_ep_overlap:
        print(_ep_comparison(records, r0["records_no_overlap"]))
    if profiled:
        _profile_report(cfg, *profiled)
    if cfg.check and not _check(cfg, records):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
