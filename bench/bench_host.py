"""Host overhead per fused TP op: microseconds per call on tiny shapes vs the plain
torch.distributed collective + torch.matmul, per backend, measured in one run.

    python -m bench.bench_host                     # CPU: 2 gloo ranks -> bench/results/host.*
    python -m bench.bench_host --device cuda       # GPU: NCCL, one GPU per rank

Shapes are tiny (default M=8 rows, K=16, N=16) so the GEMM and the bytes cost next to nothing
and what remains is the host's work per call: argument checks, the communicator and context
lookup, autograd, chunk bookkeeping, launches. On a GPU this decides whether the host can run
ahead of the device (host time per op below the op's device time); here it is measurable.

    op                     ours                             baseline (same run)
    all_gather_matmul      x_shard [M/world, K] @ w [K, N]  all_gather_into_tensor, then x @ w
    matmul_reduce_scatter  x [M, K] @ w [K, N]              x @ w, then reduce_scatter_tensor
    matmul_all_reduce      x [M, K] @ w [K, N]              x @ w, then all_reduce

Every op runs on an explicit ``TPComm(group, backend=...)`` with its defaults (check_inputs=True:
ranks compare shapes by name on the first call, stamps on every call; local checks run once per
call signature). Inputs do not require grad, as the baseline has no autograd, so the ops skip
their autograd Function (a training call pays its ``apply``, about 5 us here, on top). The
baseline posts its collective async and waits inside the same ``comm_wait`` accounting the
runtime uses. A round times
``inner`` back-to-back calls of each (op, impl) in turn (barrier before and after), so load hits
all alike, each op's impls in an order rotated every round (so no impl always follows the same
one); the table shows the median over rounds and both ranks of the per-call times:

- ``wall_us``: wall time per call. On CPU the device is the host, so this includes the
  collective's transfer and the op's blocking waits; on GPU (no sync inside the timed calls)
  it is the host's issue time per call, the number that says whether the host runs ahead.
- ``nowait_us``: wall minus the time the calling thread spent blocked in the runtime's
  communication waits (``overlap.profile.timers.comm_wait``, the ``comm_wait:*`` ranges that
  torch.profiler and Nsight show): host work per call excluding waits.
- ``cpu_us``: CPU time of the calling thread per call (``time.thread_time``): excludes time
  blocked in the kernel and time the thread was descheduled (the least load-sensitive of the
  three), includes spin-waits.
- ``*_x``: this impl / the baseline of the same op (1.0 on the baseline row).

``--without-stamps`` adds rows "<backend> (no stamps)": the same backend on a communicator
whose per-call agreement stamps are switched off (and its first-call check, which the stamped
one runs only once), so the stamps' own cost is read in the same run.

Triton runs under its interpreter on CPU (seconds per call, nothing to do with a GPU launch);
its rows use ``triton_inner`` calls per round. ``--profile DIR`` / ``--nsys`` add
``trace_overlap%`` of each (op, impl)'s timed calls (bench.runner.TraceOptions).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.runner import (Table, TraceOptions, Tracer, check_trace_options, command_line,
                          finish_trace_column, parse_config, trace_columns)
from overlap.dist.device import rank_device
from overlap.dist.launch import launch
from overlap.tp.autochunk import MAX_RACE

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
BASELINE = "torch.distributed + matmul"

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig(TraceOptions):
    world: int = 2
    m: int = 8
    k: int = 16
    n: int = 16
    backends: tuple[str, ...] = ("chunked", "symmetric", "triton", "unfused")
    rounds: int = 20
    inner: int = 50
    triton_inner: int = 1
    warmup: int = 3
    device: str = "cpu"
    out: str = "bench/results/host"
    without_stamps: bool = False


def _baseline(op: str, x: torch.Tensor, w: torch.Tensor, group):
    from overlap.profile.timers import comm_wait

    world = dist.get_world_size(group)

    def wait(work) -> None:
        with comm_wait("bench.baseline"):
            work.wait()

    if op == "all_gather_matmul":
        def call():
            full = x.new_empty((world * x.shape[0], x.shape[1]))
            wait(_all_gather(full, x, group=group, async_op=True))
            return full @ w
    elif op == "matmul_reduce_scatter":
        def call():
            y = x @ w
            out = y.new_empty((y.shape[0] // world, y.shape[1]))
            wait(_reduce_scatter(out, y, group=group, async_op=True))
            return out
    else:
        def call():
            y = x @ w
            wait(dist.all_reduce(y, group=group, async_op=True))
            return y
    return call


def _rotated(calls: list[tuple], r: int) -> list[tuple]:
    """Round ``r``'s order: the ops in turn, and each op's impls (baseline included) rotated by
    ``r``, so every impl takes every place in its op's sequence. A fixed order measured the
    same configuration (``chunks='auto'`` picking pieces, and the forced '(pieces)' row) at
    141 and 185 us per call, by its place alone."""
    out = []
    for op in dict.fromkeys(c[0] for c in calls):
        group = [c for c in calls if c[0] == op]
        k = r % len(group)
        out += group[k:] + group[:k]
    return out


def _bench_rank(cfg: BenchConfig) -> list[dict]:
    from overlap import tp
    from overlap.profile.timers import exposed_seconds
    from overlap.tp.backends import have_triton_tp

    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    device = rank_device()
    gen = torch.Generator().manual_seed(rank)
    x_full = torch.randn(cfg.m, cfg.k, generator=gen).to(device)
    x_shard = x_full[: cfg.m // world].contiguous()
    w = (torch.randn(cfg.k, cfg.n, generator=gen) / cfg.k ** 0.5).to(device)
    backends = [b for b in cfg.backends if b != "triton" or have_triton_tp()]
    comms = {b: tp.TPComm(group, backend=b, chunks="auto") for b in backends}
    for b in [b for b in backends if b in ("chunked", "symmetric")]:
        # the same backend always in pieces (chunks=world), whatever "auto" picks at this size
        comms[f"{b} (pieces)"] = tp.TPComm(group, backend=b, chunks=world)
    headers = []
    if cfg.without_stamps:  # the same backends with the per-call stamps switched off
        for b in [b for b in backends if b != "unfused"]:
            comm = comms[f"{b} (no stamps)"] = tp.TPComm(group, backend=b, check_inputs=False,
                                                          chunks=world)
            headers.append(comm.header)
            comm.agree = comm.header = None  # private: what the stamps cost, nothing else
    backends = list(comms)
    fused = {"all_gather_matmul": tp.all_gather_matmul,
             "matmul_reduce_scatter": tp.matmul_reduce_scatter,
             "matmul_all_reduce": tp.matmul_all_reduce}
    calls = []  # (op, impl, fn, calls per round)
    for op in OPS:
        x = x_shard if op == "all_gather_matmul" else x_full
        calls.append((op, BASELINE, _baseline(op, x, w, group), cfg.inner))
        for b in backends:
            slow = b.startswith("triton") and device.type == "cpu"
            inner = cfg.triton_inner if slow else cfg.inner
            calls.append((op, b, lambda op=op, x=x, b=b: fused[op](x, w, comm=comms[b]), inner))
    tracer = Tracer(cfg, rank=rank, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=group)

    samples = {(op, impl): ([], [], []) for op, impl, _, _ in calls}
    try:
        for op, impl, fn, inner in calls:  # contexts, shape agreement, allocator, interpreter
            for _ in range(cfg.warmup if inner > 1 else 1):
                fn()
        for name, comm in comms.items():  # chunks="auto": race until every comm has chosen
            for _ in range(2 * MAX_RACE):
                if comm.auto is None or comm.auto.kind is not None:
                    break
                for op, impl, fn, inner in calls:
                    if impl == name:
                        fn()
        sync()
        with tracer.region("rounds"):
            for r in range(cfg.rounds):
                for op, impl, fn, inner in _rotated(calls, r):
                    sync()
                    with tracer.sample(f"{op}_{impl}"):
                        e0, c0, t0 = exposed_seconds(), time.thread_time(), time.perf_counter()
                        for _ in range(inner):
                            fn()
                        t1, c1, e1 = time.perf_counter(), time.thread_time(), exposed_seconds()
                    wall, cpu, waited = samples[(op, impl)]
                    wall.append((t1 - t0) / inner)
                    cpu.append((c1 - c0) / inner)
                    waited.append((e1 - e0) / inner)
                sync()
        tracer.close()
    finally:
        for c in comms.values():
            c.close()
        for h in headers:
            if h is not None:
                h.close(wait_for_peers=True)
    def ran(op: str, impl: str) -> str:
        comm = comms.get(impl)
        if comm is not None and comm.auto is not None:
            picked = comm.auto.choice(op, x_shard if op == "all_gather_matmul" else x_full, w)
            return f"auto: {comm.auto.kind}" + ("" if picked in (None, 1) else f" ({picked})")
        if comm is None or comm.backend not in ("chunked", "symmetric") or comm.world == 1:
            return "-"
        return str(comm.chunks)

    return [dict(op=op, impl=impl, chunks=ran(op, impl), wall=s[0], cpu=s[1], waited=s[2],
                 **tracer.info(f"{op}_{impl}")) for (op, impl), s in samples.items()]


def main(cfg: BenchConfig) -> None:
    prog = "bench_host"
    check_trace_options(cfg, prog, cuda=cfg.device == "cuda" and torch.cuda.is_available())
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    per_rank = launch(_bench_rank, cfg.world, args=(cfg,), backend=backend, timeout=3600)
    elapsed = time.perf_counter() - t_start
    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    rows, base = [], {}
    for i, r in enumerate(per_rank[0]):
        wall = [v for pr in per_rank for v in pr[i]["wall"]]
        cpu = [v for pr in per_rank for v in pr[i]["cpu"]]
        nowait = [v - e for pr in per_rank for v, e in zip(pr[i]["wall"], pr[i]["waited"])]
        med = {k: 1e6 * statistics.median(v) for k, v in
               (("wall", wall), ("nowait", nowait), ("cpu", cpu))}
        if r["impl"] == BASELINE:
            base[r["op"]] = med
        b = base[r["op"]]
        rows.append(dict(op=r["op"], impl=r["impl"], chunks=r["chunks"], wall_us=med["wall"],
                         wall_x=med["wall"] / b["wall"], nowait_us=med["nowait"],
                         nowait_x=med["nowait"] / b["nowait"], cpu_us=med["cpu"],
                         cpu_x=med["cpu"] / b["cpu"],
                         spread=(max(wall) - min(wall)) / statistics.median(wall),
                         **{k: r[k] for k in ("trace_region", "trace_steps") if k in r}))
    notes = [
        f"{cfg.world} ranks on {cfg.device} ({backend}), 1 thread per rank; float32; M={cfg.m} "
        f"rows (all_gather_matmul shard: {cfg.m // cfg.world}), K={cfg.k}, N={cfg.n}; every "
        "op on a TPComm with default settings (local checks once per call signature); inputs "
        "do not require grad (nor does the baseline's), so no autograd Function runs.",
        f"Median over {cfg.rounds} rounds x {cfg.world} ranks of the per-call time of "
        f"{cfg.inner} back-to-back calls ({cfg.triton_inner} for triton on CPU), each (op, "
        f"impl) in turn per round (each op's impls rotated by one place every round, so every "
        f"impl, the baseline too, takes every place) after {cfg.warmup} warm-up calls; {load} (on "
        f"{os.cpu_count()} cores: other jobs shared the machine when above ~0.5); the run took "
        f"{elapsed:.0f} s.",
        "wall_us: wall time per call; on CPU the device is the host, so it includes the "
        "transfer and the op's blocking waits (the GEMM is negligible at this size). "
        "nowait_us: wall minus the calling thread's time blocked in the runtime's "
        "communication waits (overlap.profile.timers.comm_wait; the baseline waits inside the "
        "same accounting): host work per call excluding waits. cpu_us: the calling thread's "
        "CPU time per call (time.thread_time: no blocked or descheduled time, spin-waits "
        "included). *_x = this impl / the baseline of the same op.",
        "unfused runs the same collectives as the baseline through the runtime (checks, "
        "communicator, call counting, timeout-bounded waits), so its ratio is the "
        "runtime's own overhead. chunked and symmetric rows run with "
        "chunks='auto' (the CUDA default), raced before the timed rounds (the chunks column: the kind it chose "
        "and, for pieces, the piece count of the op's shape; whole = the whole collective "
        "then the GEMM, stamped); the '(pieces)' rows force "
        "chunks=world: chunked splits each op into world pieces with one exchange each, "
        "symmetric copies through shared memory on a copy thread and waits on signals; "
        "triton rows are the interpreter (TRITON_INTERPRET=1), seconds of Python per "
        "call that say nothing about a GPU launch.",
        "Command: " + command_line("bench.bench_host", cfg),
    ]
    if cfg.without_stamps:
        notes.insert(-1, "Rows '<backend> (no stamps)': the same backend on a communicator "
                     "with the per-call agreement stamps switched off (and its first-call "
                     "check); the difference from the stamped row is what the stamps cost. "
                     "spread: (max - min) / median of the wall times over the rounds.")
    if cfg.profile or cfg.nsys:
        notes.insert(-1, "trace_overlap% = 100 * hidden / communication time over the timed "
                     "calls on every rank, by overlap-analyze's code; times of a traced run "
                     "include the profiler's overhead.")
    table = Table("Host overhead per fused TP op vs torch.distributed collective + matmul",
                  trace_columns(["op", "impl", "chunks", "wall_us", "wall_x", "nowait_us",
                                 "nowait_x", "cpu_us", "cpu_x", "spread"], cfg, after="cpu_x"),
                  notes=notes)
    finish_trace_column(cfg, rows, cfg.out, prog)
    for row in rows:
        table.add(**row)
    table.publish(cfg.out)


if __name__ == "__main__":
    main(parse_config(BenchConfig, __doc__.splitlines()[0]))
