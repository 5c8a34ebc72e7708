"""Fused TP ops vs their sequential reference (collective, then GEMM), per backend.

    python -m bench.bench_tp_ops                      # CPU: 2 local gloo ranks, shapes / 16
    python -m bench.bench_tp_ops --world 4 --scale 32
    torchrun --nproc-per-node 8 -m bench.bench_tp_ops # GPUs: NCCL, full shapes, bf16

Shapes are the per-rank GEMMs of Llama-3-70B (hidden 8192, FFN 28672, 64 q / 8 kv heads of
128; 4096 tokens) and GPT-3-175B (hidden 12288, FFN 49152, 96 heads; 2048 tokens) at TP = 8,
each dim divided by ``scale`` (16 on CPU, 1 on GPU). M is the token count (all ranks' rows):

    op                     layer      x             w          output
    all_gather_matmul      qkv, fc1   [M/world, K]  [K, N]     [M, N]
    matmul_reduce_scatter  out, fc2   [M, K]        [K, N]     [M/world, N]
    matmul_all_reduce      out, fc2   [M, K]        [K, N]     [M, N]

For every shape, in one run: ``t_gemm`` (the whole local GEMM alone), ``t_comm`` (the plain
torch.distributed collective alone: all_gather_into_tensor / reduce_scatter_tensor /
all_reduce), ``t_seq`` (collective then GEMM: the unfused reference of the tests) and
``t_fused`` per backend. A sample is ``inner`` back-to-back calls between two barriers (so the
barrier's cost is amortised), divided by ``inner``; each of ``iters`` rounds takes one sample of
every one of them in turn (interleaved), and the table shows rank 0's median sample.
``speedup = t_seq / t_fused``; ``overlap_eff = (t_comm + t_gemm - t_fused) / min(t_comm,
t_gemm)``: 1 = the shorter of the two is fully hidden, 0 = no overlap, < 0 = the fused op is
slower than the two parts back to back. A backend with a faster transport than the reference
collective (symmetric: shared-memory copies vs gloo's TCP) can exceed 1. ``spread`` = (max -
min) / median of the fused samples. Each row's fused op runs on a communicator of its own
(``TPComm(chunks="auto")``, the CUDA default), called until its race has chosen how to run that
shape (the ``chunks`` column) before the timed samples; its named first-call check runs once.

Triton runs under its interpreter on CPU, thousands of times slower than a CPU GEMM, so it is
timed only on three shapes divided by ``triton_scale`` with ``triton_iters`` iterations: those
rows check that the kernels run across processes, and say nothing about GPU speed.
NVTX ranges mark every chunk's comm and GEMM (overlap.profile.nvtx); ``--trace DIR`` writes a
torch.profiler trace of one call per op and backend on rank 0 (all threads, for the copier).

``--profile DIR`` / ``--nsys`` add ``trace_overlap%``: 100 * hidden / communication time over
the timed fused calls of the row on every rank (a sample = one step range), from per-rank
torch.profiler traces of the timed samples (``DIR/<row>/trace_rank<r>.json``) or from the
Nsight Systems report, by overlap-analyze's code (bench.runner.TraceOptions). On GPUs:

    nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop \
        -o bench/results/tp_ops_gpu torchrun --nproc-per-node 8 -m bench.bench_tp_ops \
        --nsys --out bench/results/tp_ops_gpu
    python -m bench.runner fill bench/results/tp_ops_gpu     # after nsys wrote its report
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from overlap.dist.device import apply_sharing, gpu_for_rank
from overlap.tp.autochunk import MAX_RACE

from bench.runner import (Table, TraceOptions, Tracer, apply_sharing_flag, check_trace_options,
                          finish_trace_column, sharing_flag, time_fn, time_interleaved,
                          trace_columns)

COLUMNS = ["op", "shape", "backend", "chunks", "t_fused_ms", "t_seq_ms", "t_comm_ms", "t_gemm_ms",
           "speedup", "overlap_eff", "spread"]


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig(TraceOptions):
    world: int = 2                  # local gloo ranks (ignored under torchrun)
    scale: int = 0                  # divide every dim by this; 0 = 16 on CPU, 1 on GPU
    triton_scale: int = 64          # triton under the interpreter: smaller shapes
    dtype: str = "auto"             # auto = float32 on CPU, bfloat16 on GPU
    backends: tuple[str, ...] = ("chunked", "symmetric", "triton")
    iters: int = 10                 # timed samples (median reported)
    inner: int = 5                  # back-to-back calls per sample (amortises the barrier)
    warmup: int = 2
    triton_iters: int = 2
    out: str = ""                   # default bench/results/tp_ops (CPU), tp_ops_<gpu> (GPU)
    trace: str = ""                 # directory for a torch.profiler trace (rank 0)


# (model, layer, op, M, K, N) per rank at TP = 8, before scaling.
SHAPES = [
    ("Llama-3-70B", "qkv", "all_gather_matmul", 4096, 8192, 1280),
    ("Llama-3-70B", "fc1", "all_gather_matmul", 4096, 8192, 7168),
    ("Llama-3-70B", "out", "matmul_reduce_scatter", 4096, 1024, 8192),
    ("Llama-3-70B", "fc2", "matmul_reduce_scatter", 4096, 3584, 8192),
    ("Llama-3-70B", "out", "matmul_all_reduce", 4096, 1024, 8192),
    ("Llama-3-70B", "fc2", "matmul_all_reduce", 4096, 3584, 8192),
    ("GPT-3-175B", "qkv", "all_gather_matmul", 2048, 12288, 4608),
    ("GPT-3-175B", "fc1", "all_gather_matmul", 2048, 12288, 6144),
    ("GPT-3-175B", "out", "matmul_reduce_scatter", 2048, 1536, 12288),
    ("GPT-3-175B", "fc2", "matmul_reduce_scatter", 2048, 6144, 12288),
    ("GPT-3-175B", "out", "matmul_all_reduce", 2048, 1536, 12288),
    ("GPT-3-175B", "fc2", "matmul_all_reduce", 2048, 6144, 12288),
]
TRITON_SHAPES = [s for s in SHAPES if s[0] == "Llama-3-70B" and s[1] in ("fc1", "fc2")]


def _scaled(shape, scale: int, world: int):
    model, layer, op, m, k, n = shape
    m = max(world, m // scale // world * world)
    return model, layer, op, m, max(1, k // scale), max(1, n // scale)


def _inputs(op: str, m: int, k: int, n: int, world: int, dtype, device):
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    rows = m // world if op == "all_gather_matmul" else m
    x = torch.randn(rows, k, generator=gen, dtype=dtype, device=device)
    w = torch.randn(k, n, generator=gen, dtype=dtype, device=device) / k ** 0.5
    return x, w


def _reference(op: str, x, w, group):
    """(comm alone, gemm alone, collective-then-GEMM) callables: the unfused reference."""
    from overlap.nn.regions import all_gather_dim, reduce_scatter_dim

    if op == "all_gather_matmul":
        x_full = all_gather_dim(x, 0, group=group)
        return (lambda: all_gather_dim(x, 0, group=group), lambda: x_full @ w,
                lambda: all_gather_dim(x, 0, group=group) @ w)
    y = x @ w
    if op == "matmul_reduce_scatter":
        return (lambda: reduce_scatter_dim(y, 0, group=group), lambda: x @ w,
                lambda: reduce_scatter_dim(x @ w, 0, group=group))
    return (lambda: dist.all_reduce(y, group=group), lambda: x @ w,
            lambda: dist.all_reduce(x @ w, group=group))


def _bench_rank(cfg: BenchConfig) -> list[dict] | None:
    from overlap import tp
    from overlap.tp.backends import have_triton_tp

    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = torch.cuda.is_available() and dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, cfg.dtype if cfg.dtype != "auto" else
                    ("bfloat16" if cuda else "float32"))
    scale = cfg.scale or (1 if cuda else 16)
    interp = not cuda

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=group)

    tracer = Tracer(cfg, rank=rank, device=device)

    def timed(fn, iters: int, warmup: int, inner: int, trace=None):
        t = time_fn(_repeat(fn, inner), warmup=warmup, iters=iters, sync=sync, trace=trace)
        return t.median * 1e3 / inner, t.spread

    fused = {"all_gather_matmul": tp.all_gather_matmul,
             "matmul_reduce_scatter": tp.matmul_reduce_scatter,
             "matmul_all_reduce": tp.matmul_all_reduce}
    backends = [b for b in cfg.backends if b != "triton" or have_triton_tp()]
    plans = [(_scaled(s, scale, world), [b for b in backends if b != "triton" or not interp])
             for s in SHAPES]
    if interp and "triton" in backends:
        plans += [(_scaled(s, cfg.triton_scale, world), ["triton"]) for s in TRITON_SHAPES]
    rows = []
    for (model, layer, op, m, k, n), names in plans:
        x, w = _inputs(op, m, k, n, world, dtype, device)
        comm, gemm, seq = _reference(op, x, w, group)
        slow = names == ["triton"] and interp
        iters, warmup, inner = (cfg.triton_iters, 1, 1) if slow else (cfg.iters, cfg.warmup,
                                                                       cfg.inner)
        calls = {"comm": comm, "gemm": gemm, "seq": seq}
        comms, chosen = {}, {}
        for backend in names:
            # A communicator per row: its chunks="auto" race sees this shape alone.
            tpc = comms[backend] = tp.TPComm(group, backend=backend, chunks="auto")
            fused[op](x, w, comm=tpc)  # creates contexts, checks ranks
            chosen[backend] = _settle_chunks(lambda tpc=tpc: fused[op](x, w, comm=tpc), tpc,
                                             op, x, w)
            calls[backend] = lambda tpc=tpc: fused[op](x, w, comm=tpc)
        # Every round times the reference, its parts and each backend in turn: a slow stretch
        # of a shared machine hits them all alike.
        times = time_interleaved({name: _repeat(fn, inner) for name, fn in calls.items()},
                                 warmup=warmup, iters=iters, sync=sync)
        t_comm, t_gemm, t_seq = (times[k].median * 1e3 / inner for k in ("comm", "gemm", "seq"))
        for backend in names:
            key = f"r{len(rows):02d}_{op}_{model}_{layer}_{backend}"
            t, spread = times[backend].median * 1e3 / inner, times[backend].spread
            if tracer.on:  # the trace column from traced samples of their own
                timed(calls[backend], iters, warmup, inner, trace=tracer.row(key))
            comms[backend].close()
            eff = (t_comm + t_gemm - t) / min(t_comm, t_gemm) if min(t_comm, t_gemm) > 0 else 0
            rows.append(dict(op=op, shape=f"{model} {layer}: M={m} K={k} N={n}",
                             backend=backend, chunks=chosen[backend], t_fused_ms=t,
                             t_seq_ms=t_seq, t_comm_ms=t_comm, t_gemm_ms=t_gemm,
                             speedup=t_seq / t if t > 0 else 0.0,
                             overlap_eff=eff, spread=spread, **tracer.info(key)))
    tracer.close()
    if cfg.trace:
        _trace(cfg, plans, fused, group, world, dtype, device)
    tp.close_default_comms()
    if tracer.on:
        dist.barrier(group=group)  # every rank's trace is on disk before rank 0 reads them
    return rows if rank == 0 else None


def _repeat(fn, inner: int):
    def many() -> None:
        for _ in range(inner):
            fn()
    return many


def _settle_chunks(call, comm, op: str, x, w) -> str:
    """Run ``call`` until the communicator's ``chunks="auto"`` race for ``op`` has decided
    (overlap.tp.autochunk; before the timed samples, like a training warm-up); returns the
    piece count the timed calls use, as the table shows it."""
    if comm.auto is None:  # no race: triton (pieces do not apply) or a fixed count
        return "-" if comm.backend == "triton" else str(comm.chunks)
    for _ in range(2 * MAX_RACE):
        if comm.auto.choice(op, x, w) is not None:
            break
        call()
    return f"auto: {comm.auto.choice(op, x, w)}"


def _trace(cfg, plans, fused, group, world, dtype, device) -> None:
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=acts,
                   experimental_config=_ExperimentalConfig(profile_all_threads=True))
    seen = set()
    with prof if dist.get_rank() == 0 else contextlib.nullcontext():
        for (model, layer, op, m, k, n), names in plans:
            for backend in names:
                if (op, backend) in seen:
                    continue
                seen.add((op, backend))
                x, w = _inputs(op, m, k, n, world, dtype, device)
                fused[op](x, w, group=group, backend=backend, check_inputs=False)
    if dist.get_rank() == 0:
        os.makedirs(cfg.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(cfg.trace, "tp_ops_rank0.json"))


def _notes(cfg: BenchConfig, world: int, cuda: bool) -> list[str]:
    scale = cfg.scale or (1 if cuda else 16)
    notes = [f"{world} ranks ({'NCCL, GPUs' if cuda else 'gloo, local processes on this CPU'}); "
             f"dtype {cfg.dtype if cfg.dtype != 'auto' else ('bfloat16' if cuda else 'float32')}"
             f"; shapes: the TP=8 per-rank GEMMs of Llama-3-70B (4096 tokens) and GPT-3-175B "
             f"(2048 tokens), every dim divided by {scale}.",
             f"Times: rank 0's median over {cfg.iters} rounds, per call; a round times "
             f"{cfg.inner} back-to-back calls between barriers of each of t_seq, t_comm, t_gemm "
             "and every backend's fused op in turn (interleaved: a slow stretch of the machine "
             "hits them all alike); t_seq "
             "is collective-then-GEMM (the unfused reference), t_comm and t_gemm are measured "
             "alone. speedup = t_seq / t_fused; overlap_eff = (t_comm + t_gemm - t_fused) / "
             "min(t_comm, t_gemm). spread = (max - min) / median of the fused samples: how "
             "noisy that row was.",
             "chunks: the piece count the timed calls used. The fused ops run with "
             "chunks='auto' (the CUDA default): before the timed samples each op's "
             "communicator races 1 piece (the whole collective then the whole GEMM, stamped) "
             "against world x 1, 2, 4 pieces on "
             "that shape and keeps the fastest by the slowest rank's lower-quartile call (pieces "
             "must beat whole by 5%, a larger piece count a smaller one by 15%; "
             "overlap/tp/autochunk.py), as a training run's first steps would.",
             "t_comm is the plain torch.distributed collective. The fused backends move data "
             "their own way (chunked: ring send/recv; symmetric: shared-memory copies), so "
             "overlap_eff > 1 means that way was faster than the collective (gloo's "
             "reduce_scatter and all_reduce are slow here), not more than full overlap."]
    if not cuda:
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        notes += [f"CPU: {world} ranks share {os.cpu_count()} cores with single-threaded GEMMs; "
                  "the copy thread and gloo's threads compete with the GEMMs for cores, so these "
                  "numbers show that chunking/pipelining works and what it costs here, not what "
                  "a GPU with copy engines and NVLink would gain. Load average (1, 5, 15 min) "
                  f"when the table was written: {load} (other jobs shared the machine).",
                  f"triton rows: the kernels under TRITON_INTERPRET=1 on shapes divided by "
                  f"{cfg.triton_scale}; interpreter time says nothing about GPU kernels."]
    if cfg.profile or cfg.nsys:
        notes.append("trace_overlap% = 100 * hidden / communication time over the row's timed "
                     "fused calls on every rank, from "
                     + (f"torch.profiler traces (all threads) in {cfg.profile}/<row>/"
                        if cfg.profile else "the Nsight Systems report")
                     + " by overlap-analyze's code (overlap/profile/metrics.py). The times of "
                     "a traced run include the profiler's overhead.")
    return notes


def main(cfg: BenchConfig) -> None:
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_trace_options(cfg, "bench_tp_ops", cuda=torchrun and torch.cuda.is_available())
    if torchrun:  # this process is a rank
        cuda = torch.cuda.is_available()
        if cuda:  # before NCCL starts: the rank's GPU, its host id when ranks share one
            apply_sharing()
            gpu_for_rank()
        owned = not dist.is_initialized()
        if owned:
            dist.init_process_group("nccl" if cuda else "gloo")
        rows, world, rank = _bench_rank(cfg), dist.get_world_size(), dist.get_rank()
        if owned:
            dist.destroy_process_group()
        if rank != 0:
            return
    else:
        from overlap.dist.launch import launch

        cuda, world = False, cfg.world
        rows = launch(_bench_rank, world, args=(cfg,), timeout=3600)[0]
    table = Table("Fused TP ops vs collective-then-GEMM",
                  trace_columns(COLUMNS, cfg, after="overlap_eff"),
                  notes=_notes(cfg, world, cuda))
    out = cfg.out or ("bench/results/tp_ops" if not cuda else "bench/results/tp_ops_" +
                      torch.cuda.get_device_name(0).replace(" ", "_").lower())
    finish_trace_column(cfg, rows, out, "bench_tp_ops")
    for row in rows:
        table.add(**row)
    paths = table.write(out)
    print(table.markdown({}))
    print("wrote", *paths)


def _parse(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(BenchConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", default=f.default)
        elif isinstance(f.default, tuple):
            p.add_argument(flag, default=",".join(f.default), help=f"comma list ({f.default})")
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    sharing_flag(p)
    ns = vars(p.parse_args(argv))
    apply_sharing_flag(p, ns)
    for f in dataclasses.fields(BenchConfig):
        if isinstance(f.default, tuple):
            ns[f.name] = tuple(s for s in ns[f.name].split(",") if s)
    return BenchConfig(**ns)


if __name__ == "__main__":
    main(_parse())
