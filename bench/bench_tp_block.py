"""One transformer block, forward + backward: overlap TP layers vs DTensor TP vs unsharded.

    python -m bench.bench_tp_block                        # CPU: 2 gloo ranks -> bench/results/tp_block.*
    python -m bench.bench_tp_block --device cuda --dtype bfloat16 --backends auto chunked symmetric triton
                                                          # GPU: NCCL, one GPU per rank

The block is overlap's GPT ``Block`` (pre-norm attention + MLP). Every variant runs in the same
process group, round-robin, one timed iteration of each in turn (so all see the same machine
load), barrier-synced; the table reports medians. Variants:

- ``unsharded``: the whole block on every rank, no communication (the reference the tests use).
- ``dtensor``: torch ``parallelize_module`` with ColwiseParallel (q/k/v, fc1) and
  RowwiseParallel (o, fc2): replicated activations, all-reduce after each row layer.
- ``overlap``: ``parallelize()`` with the shipped GPT plan, per backend, without sequence
  parallelism (column: async dgrad all-reduce under the wgrad GEMM; row: matmul_all_reduce)
  and with it (input and output are sequence shards; column: all_gather_matmul, row:
  matmul_reduce_scatter; the norms run on t/tp tokens). ``check_inputs``: whether the fused
  ops compare shapes across ranks on each call (the default; "chunked" pays one small
  all-gather per op for it, the workspace backends only when they create a context).

``vs_unsharded`` = unsharded median / this median (> 1: faster than one rank doing it all);
``vs_dtensor`` = dtensor median / this median.

``--compare-no-overlap`` (writes ``<out>_compare.*`` instead): the same block per fused
backend and with backend "unfused" (whole collective, waited, then the whole GEMM: the
no-overlap baseline), with and without sequence parallelism, measured steps interleaved.
``exposed_ms``: median per-step time the training thread spent blocked in the runtime's
communication waits (``overlap.profile.timers.comm_wait``); ``vs_unfused`` = unfused median step
/ this median step; ``exposed_vs_unfused`` = this exposed / unfused exposed.

``--profile DIR`` / ``--nsys`` add ``trace_overlap%`` (hidden / communication time, from the
traces of the measured steps, by overlap-analyze's code; bench.runner.TraceOptions):

    python -m bench.bench_tp_block --profile runs/tp_block_prof
    nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop \
        -o bench/results/tp_block_gpu python -m bench.bench_tp_block --device cuda \
        --dtype bfloat16 --nsys --out bench/results/tp_block_gpu
    python -m bench.runner fill bench/results/tp_block_gpu      # after nsys wrote its report
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.runner import (Table, Timing, TraceOptions, Tracer, check_trace_options,
                          command_line, finish_trace_column, parse_config, trace_columns)
from overlap.dist.communicator import CommOptions
from overlap.dist.device import rank_device
from overlap.dist.launch import launch
from overlap.models import GPT, GPTConfig
from overlap.tp.comm import owned_comm


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig(TraceOptions):
    tp: int = 2
    batch: int = 4
    seq_len: int = 128
    d_model: int = 256
    n_head: int = 8
    backends: tuple[str, ...] = ("chunked", "symmetric")
    dtype: str = "float32"
    warmup: int = 2
    iters: int = 10
    device: str = "cpu"
    out: str = "bench/results/tp_block"
    compare_no_overlap: bool = False


def _model(cfg: BenchConfig, device, dtype) -> GPT:
    torch.manual_seed(0)
    gpt_cfg = GPTConfig(vocab_size=64, seq_len=cfg.seq_len, d_model=cfg.d_model, n_layer=1,
                        n_head=cfg.n_head)
    return GPT(gpt_cfg).to(device=device, dtype=dtype)


def _dtensor_block(block, tp: int, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh(device.type, (tp,))
    block.attn.num_heads //= tp
    plan = {f"attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan.update({"attn.o_proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(),
                 "mlp.fc2": RowwiseParallel()})
    return parallelize_module(block, mesh, plan)


def _variants(cfg: BenchConfig, device, dtype):
    """[(name, backend, sp, check_inputs, block, x, dy)]: x, dy as the block sees them here."""
    from overlap.nn.parallelize import parallelize

    group, tp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (cfg.batch, cfg.seq_len, cfg.d_model)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    x_s, dy_s = x.chunk(tp, 1)[rank].contiguous(), dy.chunk(tp, 1)[rank].contiguous()

    def ours(backend: str, sp: bool, check: bool):
        comm = owned_comm(group, CommOptions(backend=backend, check_inputs=check))
        model = parallelize(_model(cfg, device, dtype), comm=comm, sequence_parallel=sp)
        return ("overlap", backend, sp, check, model.blocks[0], x_s if sp else x,
                dy_s if sp else dy)

    if cfg.compare_no_overlap:
        return [ours(b, sp, True) for b in (*cfg.backends, "unfused") for sp in (False, True)]
    out = [("unsharded", "-", False, "-", _model(cfg, device, dtype).blocks[0], x, dy),
           ("dtensor", "-", False, "-", _dtensor_block(_model(cfg, device, dtype).blocks[0],
                                                        tp, device), x, dy)]
    for backend in cfg.backends:
        # Only "chunked" compares shapes across ranks on every call; the workspace backends
        # do it once per cached context.
        for check in ((True, False) if backend == "chunked" else (True,)):
            for sp in (False, True):
                out.append(ours(backend, sp, check))
    return out


def _key(v) -> str:
    return f"{v[0]}_{v[1]}_sp{int(v[2])}_check{v[3]}"


def _bench_rank(cfg: BenchConfig) -> list[dict]:
    from overlap.profile.timers import exposed_seconds
    from overlap.tp import close_default_comms

    device = rank_device()
    dtype = getattr(torch, cfg.dtype)
    variants = _variants(cfg, device, dtype)
    tracer = Tracer(cfg, rank=dist.get_rank(), device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def step(block, x, dy):
        xi = x.detach().requires_grad_()
        block(xi).backward(dy)
        block.zero_grad(set_to_none=True)

    samples: list[list[float]] = [[] for _ in variants]
    exposed: list[list[float]] = [[] for _ in variants]
    try:
        for _ in range(cfg.warmup):
            for *_, block, x, dy in variants:
                sync()
                step(block, x, dy)
        # Variants round-robin, one timed step each in turn, so machine load hits all alike.
        with tracer.region("measured"):
            for _ in range(cfg.iters):
                for i, v in enumerate(variants):
                    *_, block, x, dy = v
                    sync()
                    e0, t0 = exposed_seconds(), time.perf_counter()
                    with tracer.sample(_key(v)):
                        step(block, x, dy)
                    sync()
                    samples[i].append(time.perf_counter() - t0)
                    exposed[i].append(exposed_seconds() - e0)
        tracer.close()
    finally:
        close_default_comms()
    return [dict(variant=v[0], backend=v[1], sp=v[2], check=v[3], timing=Timing(s),
                 exposed_s=statistics.median(e), **tracer.info(_key(v)))
            for v, s, e in zip(variants, samples, exposed)]


def _launch(cfg: BenchConfig, prog: str) -> tuple[list[dict], str]:
    cuda = cfg.device == "cuda" and torch.cuda.is_available()
    check_trace_options(cfg, prog, cuda=cuda)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    load_before = os.getloadavg()[0]
    rows = launch(_bench_rank, cfg.tp, args=(cfg,), backend=backend, timeout=3600,
                  preload=["torch.distributed.tensor.parallel"])[0]
    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    return rows, load


def _setup_note(cfg: BenchConfig) -> str:
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    return (f"overlap GPT Block: batch {cfg.batch}, seq {cfg.seq_len}, d_model {cfg.d_model}, "
            f"{cfg.n_head} heads, MLP 4x, {cfg.dtype}; forward + backward (input grad and all "
            f"parameter grads); tp={cfg.tp} ranks on {cfg.device} ({backend}), 1 thread per "
            "rank.")


def _trace_note(cfg: BenchConfig) -> list[str]:
    if not (cfg.profile or cfg.nsys):
        return []
    return [f"trace_overlap% = 100 * hidden / communication time over the timed steps of the "
            f"variant on every rank, from {'torch.profiler traces (all threads) in ' + cfg.profile if cfg.profile else 'the Nsight Systems report'}"
            " by overlap-analyze's code (overlap/profile/metrics.py); '-' = no communication. "
            "The step times of a traced run include the profiler's overhead."]


def main(cfg: BenchConfig) -> None:
    if cfg.compare_no_overlap:
        return compare_main(cfg)
    prog = "bench_tp_block"
    rows, load = _launch(cfg, prog)
    base = next(r["timing"].median for r in rows if r["variant"] == "unsharded")
    dt = next(r["timing"].median for r in rows if r["variant"] == "dtensor")
    notes = [
        _setup_note(cfg),
        f"Median of {cfg.iters} iterations after {cfg.warmup} warm-up, variants round-robin, "
        f"barrier-synced; {load} (on {os.cpu_count()} cores: other jobs shared the machine "
        "when above ~0.5).",
        "check_inputs=False: the fused ops skip the per-call cross-rank shape check.",
        "vs_unsharded = unsharded median / median (the unsharded block runs on every rank at "
        "once, one core each); vs_dtensor = DTensor TP median / median.",
        *_trace_note(cfg),
        "Command: " + command_line("bench.bench_tp_block", cfg),
    ]
    table = Table("Transformer block forward+backward: overlap TP vs DTensor TP vs unsharded",
                  trace_columns(["variant", "backend", "sequence_parallel", "check_inputs",
                                 "median_ms", "spread", "vs_unsharded", "vs_dtensor"], cfg,
                                after="spread"), notes=notes)
    out = []
    for r in rows:
        t = r["timing"]
        out.append(dict(variant=r["variant"], backend=r["backend"], sequence_parallel=r["sp"],
                        check_inputs=r["check"], median_ms=t.median_ms, spread=t.spread,
                        vs_unsharded=base / t.median, vs_dtensor=dt / t.median,
                        **{k: r[k] for k in ("trace_region", "trace_steps") if k in r}))
    finish_trace_column(cfg, out, cfg.out, prog)
    for row in out:
        table.add(**row)
    table.publish(cfg.out)


def compare_main(cfg: BenchConfig) -> None:
    """--compare-no-overlap: fused backends vs "unfused", interleaved, into <out>_compare."""
    prog = "bench_tp_block --compare-no-overlap"
    rows, load = _launch(cfg, prog)
    unfused = {r["sp"]: r for r in rows if r["backend"] == "unfused"}
    notes = [
        _setup_note(cfg),
        f"Median of {cfg.iters} steps after {cfg.warmup} warm-up per variant; the variants take "
        f"turns step by step (one timed step each, barrier-synced) so machine load hits all "
        f"alike; {load} (on {os.cpu_count()} cores: other jobs shared the machine when above "
        "~0.5).",
        "unfused: parallelize(comm=TPComm(group, backend='unfused')): every TP op runs its whole collective, waits, "
        "then its whole GEMM (or GEMM then collective): the no-overlap baseline. Not covered "
        "by it: ColumnParallelLinear's backward without sequence parallelism still launches "
        "its dgrad all-reduce before the wgrad GEMM (overlap.nn.layers), whatever the backend.",
        "exposed_ms: median per step of the time rank 0's training thread spent blocked in the "
        "runtime's communication waits (overlap.profile.timers.comm_wait: collective waits, "
        "ring exchanges, userbuffer signal waits); exposed% = exposed / step. vs_unfused = "
        "unfused median step / this one (> 1: overlap is faster); exposed_vs_unfused = "
        "exposed / the unfused variant's exposed (same sequence_parallel). On GPUs NCCL waits "
        "do not block the host, so there read the trace_overlap% column (--nsys/--profile).",
        *_trace_note(cfg),
        "Command: " + command_line("bench.bench_tp_block", cfg),
    ]
    table = Table("Transformer block forward+backward: overlapped TP ops vs no overlap "
                  "(backend 'unfused')",
                  trace_columns(["backend", "sequence_parallel", "step_ms", "spread",
                                 "exposed_ms", "exposed%", "vs_unfused",
                                 "exposed_vs_unfused"], cfg, after="exposed%"), notes=notes)
    out = []
    for r in rows:
        t, base = r["timing"], unfused[r["sp"]]
        ex, ex_base = r["exposed_s"], base["exposed_s"]
        out.append(dict(backend=r["backend"], sequence_parallel=r["sp"], step_ms=t.median_ms,
                        spread=t.spread, exposed_ms=1e3 * ex, **{"exposed%": 100 * ex / t.median},
                        vs_unfused=base["timing"].median / t.median,
                        exposed_vs_unfused=ex / ex_base if ex_base > 0 else "-",
                        **{k: r[k] for k in ("trace_region", "trace_steps") if k in r}))
    out_stem = cfg.out + "_compare"
    finish_trace_column(cfg, out, out_stem, prog)
    for row in out:
        table.add(**row)
    table.publish(out_stem)


if __name__ == "__main__":
    main(parse_config(BenchConfig, __doc__.splitlines()[0]))
