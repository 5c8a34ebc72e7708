"""Pipeline schedules: step time and bubble fraction, overlap.pp vs torch.distributed.pipelining.

    python -m bench.bench_pp                       # CPU: 2 ranks on the NCCL-ordering twin
                                                   # of gloo, writes bench/results/pp.*
    python -m bench.bench_pp --pp 4 --device cuda  # GPU: NCCL, one GPU per rank

Both implementations run the same split GPT (same chunks, same micro-batches) in the same
process group, one after the other, for the schedules both have (GPipe, 1F1B, interleaved
1F1B); ZB-H1 is ours only. Columns:

- ``step_ms``: median step time (forward + backward of all micro-batches), barrier-synced;
  the two implementations alternate step by step so both see the same machine load.
- ``bubble``: 1 - busy/window per rank, averaged over ranks (median over steps). The window
  spans the earliest start to the latest end of the step over all ranks; busy is the time in
  stage compute, excluding waits for received tensors. Ours comes from the executor's
  timeline; torch's from probes around each chunk (forward pre/post, and backward from the
  gradient reaching the chunk output to the last of: gradient reaching its input, last
  parameter gradient accumulated).
- ``bubble_ideal``: the schedule's simulated bubble with F=1, B=2 (I=W=1): (p-1)/(m+p-1),
  (p-1)/(v*m+p-1), ZB-H1 (p-1)/(3m+p-1).

On GPU the step times are synchronised but the per-action timestamps are host times of
asynchronous launches, so read the GPU bubble from an Nsight trace instead of this column.

``--profile DIR`` / ``--nsys`` add ``trace_overlap%``: 100 * hidden / communication time (P2P
sends, receives and their waits vs stage compute) over the row's timed steps on every rank,
from torch.profiler traces of the timed steps (``DIR/<schedule>_m<m>/trace_rank<r>.json``) or
the Nsight Systems report, by overlap-analyze's code (bench.runner.TraceOptions). On GPUs:

    nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop \
        -o bench/results/pp_gpu python -m bench.bench_pp --pp 4 --device cuda --nsys \
        --out bench/results/pp_gpu
    python -m bench.runner fill bench/results/pp_gpu         # after nsys wrote its report
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.runner import (Table, Timing, TraceOptions, Tracer, check_trace_options, command_line,
                          finish_trace_column, parse_config, time_fn, trace_columns)
from overlap.dist.device import rank_device
from overlap.dist.launch import launch
from overlap.models import GPT, GPTConfig, gpt_loss, pipeline_piece_costs
from overlap.pp import Pipeline, build_schedule, pipeline_stages, simulate

TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
               "interleaved_1f1b": "ScheduleInterleaved1F1B"}


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig(TraceOptions):
    pp: int = 2
    microbatches: tuple[int, ...] = (4, 8)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
    num_virtual: int = 2
    microbatch_size: int = 4
    seq_len: int = 64
    d_model: int = 192
    n_layer: int = 8
    vocab_size: int = 512
    warmup: int = 1
    iters: int = 5
    device: str = "cpu"
    transport: str = "nccl_twin"  # CPU: gloo with NCCL's ordering rules, or plain "gloo"
    out: str = "bench/results/pp"


class _Probe(torch.autograd.Function):
    """Identity whose backward logs the time gradient reaches it (start or end of a stage's
    backward, depending on where it sits)."""

    @staticmethod
    def forward(ctx, x, log, tag):
        ctx.log, ctx.tag = log, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append((ctx.tag, time.perf_counter()))
        return grad, None, None


class _Timed(torch.nn.Module):
    """Wraps a chunk for torch.distributed.pipelining so its compute shows up on a timeline:
    forward = [pre, post]; backward = [gradient reaches the output, last of (gradient reaches
    the input, last parameter gradient accumulated)]."""

    def __init__(self, inner: torch.nn.Module, log: list):
        super().__init__()
        self.inner, self.log = inner, log
        self.handles = [q.register_post_accumulate_grad_hook(
            lambda _q: log.append(("b_end", time.perf_counter()))) for q in inner.parameters()]

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def forward(self, x):
        t0 = time.perf_counter()
        if x.is_floating_point():
            x = _Probe.apply(x, self.log, "b_end")
        out = _Probe.apply(self.inner(x), self.log, "b_start")
        self.log.append(("f", t0, time.perf_counter()))
        return out


def _busy(log: list) -> float:
    busy, b_start, b_end = 0.0, None, None
    for ev in log + [("f", 0.0, 0.0)]:
        if ev[0] in ("f", "b_start") and b_start is not None:
            busy += b_end - b_start
            b_start = None
        if ev[0] == "f":
            busy += ev[2] - ev[1]
        elif ev[0] == "b_start":
            b_start = b_end = ev[1]
        elif b_start is not None:
            b_end = max(b_end, ev[1])
    return busy


def _bench_rank(cfg: BenchConfig) -> list[dict]:
    from torch.distributed import pipelining

    g, p = dist.group.WORLD, dist.get_world_size()
    dev = rank_device()
    sync = (lambda: (torch.cuda.synchronize(), dist.barrier())) if dev.type == "cuda" else (
        lambda: dist.barrier())
    torch.manual_seed(0)
    gcfg = GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model,
                     n_layer=cfg.n_layer, n_head=4)
    model = GPT(gcfg).to(dev)
    costs = pipeline_piece_costs(gcfg)
    tracer = Tracer(cfg, rank=dist.get_rank(), device=dev)
    rows = []
    for m in cfg.microbatches:
        batch = m * cfg.microbatch_size
        gen = torch.Generator().manual_seed(m)
        idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen).to(dev)
        tgt = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen).to(dev)
        for name in cfg.schedules:
            v = cfg.num_virtual if name == "interleaved_1f1b" else 1
            if m < p or (v > 1 and m % p):
                continue
            stages = pipeline_stages(model, pp_group=g, num_virtual=v, costs=costs)
            sched = build_schedule(name, pp_size=p, num_microbatches=m, num_virtual=v)
            pipe = Pipeline(stages, sched, loss_fn=gpt_loss, pp_group=g, timeout=300)
            runs = {"overlap": ([], [])}  # impl -> (Timing samples, (start, end, busy))

            def ours():
                model.zero_grad(set_to_none=True)
                tl = pipe.step(idx, tgt).timeline
                runs["overlap"][1].append((tl.start, tl.end, tl.busy))

            steps = {"overlap": ours}
            if name in TORCH_NAMES:
                log: list = []
                theirs = [pipelining.PipelineStage(_Timed(s.module, log), s.stage_index,
                                                   p * v, dev, group=g) for s in stages]
                tsched = getattr(pipelining, TORCH_NAMES[name])(
                    theirs if v > 1 else theirs[0], m, loss_fn=gpt_loss)
                has_first = any(s.is_first for s in stages)
                has_last = any(s.is_last for s in stages)
                runs["torch.pipelining"] = ([], [])

                def torch_step():
                    model.zero_grad(set_to_none=True)
                    log.clear()
                    kw = {"target": tgt, "losses": []} if has_last else {}
                    t0 = time.perf_counter()
                    tsched.step(idx, **kw) if has_first else tsched.step(**kw)
                    runs["torch.pipelining"][1].append((t0, time.perf_counter(), _busy(log)))

                steps["torch.pipelining"] = torch_step
            # Alternate the implementations step by step so both see the same machine load.
            for _ in range(cfg.warmup):
                for fn in steps.values():
                    time_fn(fn, warmup=0, iters=1, sync=sync)
            with tracer.region(f"{name}_m{m}"):
                for _ in range(cfg.iters):
                    for impl, fn in steps.items():
                        traced = tracer.wrap(f"{impl}_{name}_m{m}", fn)
                        runs[impl][0].extend(time_fn(traced, warmup=0, iters=1, sync=sync).samples)
            if name in TORCH_NAMES:
                for st in theirs:
                    st.submod.close()
            for impl, (samples, spans) in runs.items():
                gathered: list = [None] * p
                dist.all_gather_object(gathered, spans[cfg.warmup:])
                bubbles = []
                for i in range(cfg.iters):
                    per_rank = [gathered[r][i] for r in range(p)]
                    window = max(e for _, e, _ in per_rank) - min(s for s, _, _ in per_rank)
                    bubbles.append(statistics.mean(1 - b / window for _, _, b in per_rank))
                t = Timing(samples)
                rows.append(dict(impl=impl, schedule=name, p=p, v=v, m=m, step_s=t.median,
                                 spread=t.spread, bubble=statistics.median(bubbles),
                                 bubble_ideal=simulate(sched).bubble_fraction,
                                 **tracer.info(f"{impl}_{name}_m{m}")))
    tracer.close()
    return rows


def main(cfg: BenchConfig) -> None:
    check_trace_options(cfg, "bench_pp", cuda=cfg.device == "cuda" and torch.cuda.is_available())
    backend = "nccl" if cfg.device == "cuda" else cfg.transport
    load_before = os.getloadavg()[0]
    rows = launch(_bench_rank, cfg.pp, args=(cfg,), backend=backend, timeout=3600,
                  preload=["torch.distributed.pipelining"])[0]
    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    notes = [
        f"GPT d_model={cfg.d_model} n_layer={cfg.n_layer} vocab={cfg.vocab_size} "
        f"seq_len={cfg.seq_len}, micro-batch size {cfg.microbatch_size}, fp32, split by "
        f"FLOP cost; {cfg.pp} ranks on {cfg.device} ({backend}), 1 thread per rank; "
        f"median of {cfg.iters} steps after {cfg.warmup} warm-up, implementations alternating; "
        f"{load} (on {os.cpu_count()} cores: other jobs shared the machine when above ~0.5).",
        "bubble: 1 - busy/window per rank (compute time on the rank's timeline, excluding "
        "waits for data), mean over ranks; bubble_ideal: simulated with F=1, B=2 (I=W=1).",
        "Command: " + command_line("bench.bench_pp", cfg),
    ]
    if cfg.profile or cfg.nsys:
        notes.insert(-1, "trace_overlap% = 100 * hidden / communication time over the row's "
                     "timed steps on every rank, from " +
                     (f"torch.profiler traces (all threads) in {cfg.profile}/<schedule>_m<m>/"
                      if cfg.profile else "the Nsight Systems report")
                     + " by overlap-analyze's code; step times of a traced run include the "
                     "profiler's overhead.")
    table = Table("Pipeline schedules: overlap.pp vs torch.distributed.pipelining",
                  trace_columns(["schedule", "p", "v", "m", "impl", "step_ms", "spread",
                                 "bubble", "bubble_ideal", "speedup_vs_torch"], cfg,
                                after="bubble_ideal"), notes=notes)
    torch_ms = {(r["schedule"], r["m"]): r["step_s"] for r in rows
                if r["impl"] == "torch.pipelining"}
    out = []
    for r in rows:
        base = torch_ms.get((r["schedule"], r["m"]))
        out.append(dict(schedule=r["schedule"], p=r["p"], v=r["v"], m=r["m"], impl=r["impl"],
                        step_ms=1e3 * r["step_s"], spread=r["spread"], bubble=r["bubble"],
                        bubble_ideal=r["bubble_ideal"],
                        speedup_vs_torch="-" if base is None else base / r["step_s"],
                        **{k: r[k] for k in ("trace_region", "trace_steps") if k in r}))
    finish_trace_column(cfg, out, cfg.out, "bench_pp")
    for row in out:
        table.add(**row)
    table.publish(cfg.out)


if __name__ == "__main__":
    main(parse_config(BenchConfig, __doc__.splitlines()[0]))
