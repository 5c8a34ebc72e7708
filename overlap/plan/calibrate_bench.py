"""Rank-side micro-benchmarks of ``overlap-plan --calibrate`` (run through ``launch``).

Every benchmark runs on all ranks at once, in pairs (ranks 0-1, 2-3, ...), so host costs are
measured under the contention of as many busy processes as the jobs to predict. Each timing is
the median of three repeats; CPU time is the whole process's (``time.process_time``: the
backend's worker threads count).

The runtime's own stack (GPT stages in its pipeline executor, with its data-parallel hooks and,
with tensor parallelism, its fused ops) is measured at a size where arithmetic is negligible
(d_model 16, 8 tokens), so what is left is host cost: dispatch, autograd, hooks, the executor,
the fused ops' and small collectives' machinery.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

__all__ = ["OPS_2", "bench_gemms", "bench_elementwise", "bench_collectives", "bench_tp_ops",
           "bench_pipeline"]

# (steps, bandwidth factor) of each measured op on 2 ranks, as overlap.plan.comm models them.
OPS_2 = {"all_reduce": (2, 1.0), "all_gather": (1, 0.5), "reduce_scatter": (1, 0.5),
         "p2p": (1, 1.0)}
TINY = dict(vocab_size=16, seq_len=8, d_model=16, n_head=2)


def _pair_group():
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    return groups[rank // 2], rank % 2


def _measure(fn, iters: int, trials: int = 3, per: int = 1) -> tuple[float, float]:
    """(wall, CPU) seconds per call, each the median over ``trials`` loops of ``iters``: the
    typical cost on this machine as it is shared, which is what the jobs to predict see."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    walls, cpus = [], []
    for _ in range(trials):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(iters):
            fn()
        walls.append((time.perf_counter() - t0) / (iters * per))
        cpus.append((time.process_time() - c0) / (iters * per))
    return statistics.median(walls), statistics.median(cpus)


def bench_gemms(dims: tuple[int, ...], iters: int) -> list[tuple[int, int, int, float]]:
    """CPU seconds per fp32 ``a @ b`` for every (M, N, K) in ``dims``^3, while every other rank
    runs the same sweep (the caches and memory bus are shared, as in a job)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.barrier()
    out = []
    for m in dims:
        for n in dims:
            for k in dims:
                a, b = torch.randn(m, k), torch.randn(k, n)
                reps = max(1, min(iters * 8, int(2e8 / (2 * m * n * k))))
                a @ b
                runs = []
                for _ in range(3):
                    c0 = time.process_time()
                    for _ in range(reps):
                        a @ b
                    runs.append((time.process_time() - c0) / reps)
                out.append((m, n, k, statistics.median(runs)))
    return out


def bench_elementwise(iters: int, tokens: int = 1024, h: int = 64,
                      vocab: int = 256) -> tuple[float, float, float, float]:
    """(bytes, CPU seconds) of a layer's element-wise work on (tokens, h) fp32 activations,
    forward and backward: two layer norms, two residual adds and a GeLU on the (tokens, 4h)
    MLP activation; then (bytes, CPU seconds) of the cross-entropy on (tokens, vocab) fp32
    logits. The bytes are what overlap.plan counts for them (fp32; the layer's backward twice
    its forward, 12 bytes per logit), so bytes / seconds is the bandwidth to use."""
    torch.set_num_threads(1)
    x = torch.randn(tokens, h, requires_grad=True)
    act = torch.randn(tokens, 4 * h, requires_grad=True)
    ln1, ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)

    def fb() -> None:
        y = ln1(x) + x
        z = ln2(y) + y
        (z.sum() + torch.nn.functional.gelu(act).sum()).backward()

    seconds = _measure(fb, iters)[1]
    fwd_bytes = (tokens * h * 20.0 + tokens * 4 * h * 4.0) * 2  # fp32: twice the bf16 count
    logits = torch.randn(tokens, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    ce = _measure(lambda: torch.nn.functional.cross_entropy(logits, target).backward(), iters)
    return 3 * fwd_bytes, seconds, 12.0 * tokens * vocab, ce[1]


def bench_collectives(sizes: tuple[int, ...], iters: int) -> dict[str, list]:
    """{op: [(bytes, wall, CPU) per size]} for all-reduce, all-gather, reduce-scatter and one
    P2P transfer (a ping-pong counts two)."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor names: as the runtime
    torch.set_num_threads(1)
    group, me = _pair_group()
    peer = dist.get_global_rank(group, 1 - me)
    out: dict[str, list] = {op: [] for op in OPS_2}
    for nb in sizes:
        n = max(nb // 4, 2) // 2 * 2
        full, half = torch.ones(n), torch.ones(n // 2)

        def p2p() -> None:
            for src in (0, 1):
                op = dist.P2POp(dist.isend if me == src else dist.irecv, full, peer, group)
                for w in dist.batch_isend_irecv([op]):
                    w.wait()

        ops = {"all_reduce": lambda: dist.all_reduce(full, group=group),
               "all_gather": lambda: dist.all_gather_into_tensor(full, half, group=group),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(half, full, group=group),
               "p2p": p2p}
        for name, fn in ops.items():
            out[name].append((nb, *_measure(fn, iters, per=2 if name == "p2p" else 1)))
    return out


def bench_tp_ops(shapes: tuple[tuple[int, int], ...], iters: int) -> list[tuple]:
    """Per (tokens, hidden): (gathered bytes, extra wall, extra CPU) per fused op, from forward
    + backward of all_gather_matmul and of matmul_reduce_scatter (two fused ops each: the
    backward of one is the other) minus the same GEMMs alone."""
    from overlap.tp import all_gather_matmul, close_default_comms, matmul_reduce_scatter

    torch.set_num_threads(1)
    group, _ = _pair_group()
    out = []
    for tokens, h in shapes:
        x_shard = torch.randn(tokens // 2, 1, h, requires_grad=True)
        x = torch.randn(tokens, 1, h, requires_grad=True)
        w = torch.randn(h, h, requires_grad=True)
        ag = _measure(lambda: all_gather_matmul(x_shard, w, group=group).sum().backward(), iters)
        rs = _measure(lambda: matmul_reduce_scatter(x, w, group=group).sum().backward(), iters)
        gemm = _measure(lambda: (x @ w).sum().backward(), iters)
        out.append((4.0 * tokens * h, (ag[0] + rs[0] - 2 * gemm[0]) / 4,
                    (ag[1] + rs[1] - 2 * gemm[1]) / 4))
    close_default_comms()
    return out


def bench_pipeline(iters: int, tp: int) -> dict[tuple[int, int], float]:
    """CPU seconds per step of this rank running the runtime's own stack at negligible size:
    GPT stages of ``layers`` layers each (2 stages, 1F1B, ``m`` micro-batches), tensor-parallel
    with sequence parallelism and the fused ops when ``tp`` > 1, the data-parallel gradient
    hooks attached (accumulating locally). Keys (layers per stage, m) in {1, 3} x {2, 6}: the
    differences separate the cost per layer, per compute action and per step."""
    import torch.distributed as dist

    from overlap.dist.dims import ParallelDims
    from overlap.dp.grad_reducer import GradReducer
    from overlap.models.gpt import GPT, GPTConfig, gpt_loss
    from overlap.pp import Pipeline, build_schedule, pipeline_stages

    torch.set_num_threads(1)
    dims = ParallelDims.build(tp=tp, pp=2)
    loss_fn = gpt_loss
    if tp > 1:
        from overlap.models.tp_plans import gpt_plan
        from overlap.nn import parallelize, vocab_parallel_cross_entropy

        def tp_loss(logits, targets):
            return vocab_parallel_cross_entropy(logits, targets, comm=comm)

        loss_fn = tp_loss
        comm = dims.tp_comm()
    x = torch.randint(0, TINY["vocab_size"], (1, TINY["seq_len"]))
    first, last = dims.pp_rank == 0, dims.pp_rank == 1
    out = {}
    for layers in (1, 3):
        for m in (2, 6):
            torch.manual_seed(0)
            model = GPT(GPTConfig(n_layer=2 * layers, **TINY))
            if tp > 1:
                parallelize(model, comm=comm, plan=gpt_plan(loss_parallel=True),
                            sequence_parallel=True)
            stages = pipeline_stages(model, pp_group=dims.pp_group, num_virtual=1)
            reducers = []
            if dims.dp > 1:
                for st in stages:
                    red = GradReducer(st.module, dp_group=dims.dp_group)
                    red.sync_if(lambda: False)
                    reducers.append(red)
            pipe = Pipeline(stages, build_schedule("1f1b", pp_size=2, num_microbatches=m),
                            loss_fn=loss_fn, pp_group=dims.pp_group, timeout=120)
            xs = [x] * m
            try:
                out[(layers, m)] = _measure(lambda: pipe.step(xs if first else None,
                                                              xs if last else None), iters)[1]
            finally:
                pipe.close()
                for red in reducers:
                    red.close()
            dist.barrier()
    if tp > 1:
        from overlap.tp import close_default_comms

        close_default_comms()
    return out
