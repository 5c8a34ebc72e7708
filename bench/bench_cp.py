"""Context-parallel attention, forward + backward, causal: ring, all-gather and Ulysses vs the
unoverlapped reference (gather all KV, then attend), at CP 2 and 4.

    python -m bench.bench_cp                                   # CPU: 2 and 4 local gloo ranks
    torchrun --nproc-per-node 8 -m bench.bench_cp --seqs 32768 65536 131072 \\
        --heads 32 --kv-heads 8 --head-dim 128 --skip-dense   # GPUs: NCCL, bf16 (not run here)

Per rank: q (b, h, S / cp, d), k/v (b, h_kv, S / cp, d), zig-zag pieces of a causal sequence of
S tokens. Rows, each timed once per round in turn (so drift hits them alike), ``rounds``
rounds, medians reported: ``reference`` = the kv all-gather waited for, then one SDPA call of
the local rows over the whole gathered sequence with the zig-zag causal mask (torch's fused
kernel, every masked entry computed); backward: SDPA's, then the dK/dV reduce-scatter waited
for. ``reference (blocks)``: the same transfers, waited for, around the methods' own block
kernel over the causal blocks only (the methods' work, nothing overlapped). ``ring``,
``allgather``, ``ulysses``: overlap.cp's methods; ``auto``: ``cp_attention(method="auto")``
(its choice measured before the timed rounds). ``ratio`` = reference ms / row ms (higher is
faster); ``vs_blocks`` the same against ``reference (blocks)``. ``--skip-dense`` drops the
dense-mask reference (its mask and scores do not fit a GPU at 64k+ tokens; ratio then uses
the blocks). ``sent_MB``: bytes one rank's data must reach the others per forward + backward;
``comm_ms``: the row's transfers alone; ``exposed_ms``: time blocked in its waits
(overlap.profile.timers); ``hidden%`` = 100 * (1 - exposed / comm). On CPU the ranks share 2
cores with gloo's threads: these numbers say nothing about a GPU. On CUDA the backward is the
fp32 math recomputation (a block's s x s scores in fp32): at 128k tokens lower ``--heads`` or
raise cp if it does not fit.
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
from overlap.dist.device import apply_sharing, gpu_for_rank

METHODS = ("ring", "allgather", "ulysses")
COLUMNS = ["seq", "cp", "method", "ms", "ratio", "vs_blocks", "spread", "sent_MB", "comm_ms", "exposed_ms",
           "hidden%", "auto_choice"]


@dataclasses.dataclass
class BenchConfig(TraceOptions):
    world_sizes: tuple[int, ...] = (2, 4)  # local ranks on CPU (ignored under torchrun)
    seqs: tuple[int, ...] = (2048, 4096, 8192)
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "auto"  # float32 on CPU, bfloat16 on GPU
    rounds: int = 5
    skip_dense: bool = False  # drop the dense-mask SDPA reference (long sequences on GPUs)
    warmup: int = 1
    timeout: float = 1200.0
    out: str = ""  # default bench/results/cp (CPU), cp_<gpu> (GPU)


# ---------------------------------------------------------------- the reference

class _GatherThenAttend(torch.autograd.Function):
    """All-gather kv (waited), one SDPA over the whole sequence with the zig-zag causal mask;
    backward: SDPA's backward, then the dK/dV reduce-scatter (waited). Nothing overlaps."""

    @staticmethod
    def forward(ctx, q, k, v, comm, mask):
        op = "reference"
        cp, (b, hk, s, d) = comm.world, k.shape
        every = k.new_empty(cp, 2, b, hk, s, d)
        comm.wait_collective(comm.collective("all_gather", every.flatten(0, 1),
                                             torch.stack([k, v]), op=op, what="kv"),
                             op=op, what="kv")
        kv = every.permute(1, 2, 3, 0, 4, 5).reshape(2, b, hk, cp * s, d)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, kv)]
            g = q.shape[1] // hk
            k_all, v_all = (t.repeat_interleave(g, dim=1) for t in leaves[1])
            out = torch.nn.functional.scaled_dot_product_attention(leaves[0], k_all, v_all,
                                                                   attn_mask=mask)
        ctx.comm, ctx.graph = comm, (leaves, out)
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        op, comm = "reference", ctx.comm
        (q, kv), out = ctx.graph
        dq, dkv = torch.autograd.grad(out, (q, kv), dout)
        two, b, hk, n, d = dkv.shape
        send = dkv.view(2, b, hk, comm.world, n // comm.world, d).permute(3, 0, 1, 2, 4, 5)
        mine = dkv.new_empty(2, b, hk, n // comm.world, d)
        comm.wait_collective(comm.collective("reduce_scatter", mine,
                                             send.contiguous().flatten(0, 1), op=op,
                                             what="dk/dv"), op=op, what="dk/dv")
        return dq, mine[0], mine[1], None, None


class _GatherThenBlocks(torch.autograd.Function):
    """The same reference with the methods' block kernel: all-gather kv (waited), back in
    natural order; each local chunk attends its own chunk under the causal mask and every
    earlier row whole (no masked entry computed); backward: the blocks' gradients, then the
    dK/dV reduce-scatter (waited). Same work as the methods, nothing overlaps."""

    @staticmethod
    def forward(ctx, q, k, v, comm):
        from overlap.cp.blocks import block_forward, merge, pick_kernel
        from overlap.cp.ulysses import _to_sequence

        op, cp, rank, (b, hk, s, d) = "reference", comm.world, comm.rank, k.shape
        every = k.new_empty(cp, 2, b, hk, s, d)
        comm.wait_collective(comm.collective("all_gather", every.flatten(0, 1),
                                             torch.stack([k, v]), op=op, what="kv"),
                             op=op, what="kv")
        kernel = pick_kernel("auto", q)
        kv = _to_sequence(every, causal=True)  # (2, b, hk, S, d)
        kv = kv.float() if kernel == "math" else kv
        q5 = q.reshape(b, hk, q.shape[1] // hk, s, d)
        q5 = q5.float() if kernel == "math" else q5
        o, lse = [], []
        for rows, keys, diag in _chunk_plan(s, cp, rank):
            o_blk, lse_blk = block_forward(q5[..., rows, :], kv[0, :, :, keys].unsqueeze(2),
                                           kv[1, :, :, keys].unsqueeze(2), comm_scale(q), diag,
                                           kernel)
            if diag:
                o.append(o_blk)
                lse.append(lse_blk)
            else:
                merge(o[-1], lse[-1], o_blk, lse_blk)
        o, lse = torch.cat(o, dim=3), torch.cat(lse, dim=3)
        ctx.comm, ctx.kernel = comm, kernel
        ctx.save_for_backward(q5, kv, o, lse)
        return o.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        from overlap.cp.blocks import backward_kernel, block_backward
        from overlap.cp.ulysses import _to_pieces

        op, comm = "reference", ctx.comm
        q5, kv, o5, lse = ctx.saved_tensors
        q5, kv = q5.float(), kv.float()
        do5 = dout.reshape(q5.shape).float()
        delta = (do5 * o5).sum(-1)
        kernel = backward_kernel(ctx.kernel, dout)
        dq5, dkv = torch.zeros_like(q5), torch.zeros_like(kv)
        for rows, keys, diag in _chunk_plan(q5.shape[3], comm.world, comm.rank):
            dq, dk, dv = block_backward(q5[..., rows, :], kv[0, :, :, keys].unsqueeze(2),
                                        kv[1, :, :, keys].unsqueeze(2), do5[..., rows, :],
                                        lse[..., rows], delta[..., rows], comm_scale(dout),
                                        diag, kernel, o5[..., rows, :])
            dq5[..., rows, :] += dq
            dkv[0, :, :, keys] += dk
            dkv[1, :, :, keys] += dv
        two, b, hk, n, d = dkv.shape
        send = dkv.new_empty(comm.world, 2, b, hk, n // comm.world, d)
        _to_pieces(dkv, send, causal=True)
        mine = dkv.new_empty(2, b, hk, n // comm.world, d)
        comm.wait_collective(comm.collective("reduce_scatter", mine, send.flatten(0, 1), op=op,
                                             what="dk/dv"), op=op, what="dk/dv")
        dtype = dout.dtype
        return dq5.reshape(dout.shape).to(dtype), mine[0].to(dtype), mine[1].to(dtype), None


def comm_scale(t: torch.Tensor) -> float:
    return t.shape[-1] ** -0.5


def _chunk_plan(s: int, cp: int, rank: int) -> list[tuple[slice, slice, bool]]:
    """(local rows, keys of the natural-order sequence, causal within) per local chunk: its
    own chunk under the mask first, then every earlier row whole."""
    c, plan = s // 2, []
    for j, t in enumerate((rank, 2 * cp - 1 - rank)):
        rows = slice(j * c, (j + 1) * c)
        plan.append((rows, slice(t * c, (t + 1) * c), True))
        if t:
            plan.append((rows, slice(0, t * c), False))
    return plan


def _zigzag_mask(s: int, cp: int, rank: int, device) -> torch.Tensor:
    """(s, cp * s) bool: local row i may see gathered key j (gathered in CP-rank order)."""
    c = s // 2

    def positions(r):
        return torch.cat([torch.arange(r * c, (r + 1) * c),
                          torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])

    keys = torch.cat([positions(r) for r in range(cp)])
    return (positions(rank)[:, None] >= keys[None, :]).to(device)


# ---------------------------------------------------------------- transfers alone

def _transfers(method: str, comm, q, k) -> tuple:
    """(run the method's transfers alone, bytes this rank's data must reach the others)."""
    cp, (b, h, s, d), hk = comm.world, q.shape, k.shape[1]
    kv = torch.stack([k, k])
    kv32 = kv.float()
    es = k.element_size()
    kv_bytes, kv32_bytes, q_bytes = kv.numel() * es, kv32.numel() * 4, q.numel() * es
    del b, h, d

    def coll(kind, out, inp):
        comm.wait_collective(comm.collective(kind, out, inp, op="alone", what=kind),
                             op="alone", what=kind)

    if method == "ring":
        def hops(t, n):
            for _ in range(n):
                recv = torch.empty_like(t)
                works = [comm.post(recv, send=False, op="alone", what="hop"),
                         comm.post(t, send=True, op="alone", what="hop")]
                for w, send in zip(works, (False, True)):
                    comm.wait(w, op="alone", what="hop", send=send)

        def run():
            hops(kv, cp - 1)
            hops(kv, cp - 1)
            hops(kv32, cp)
        return run, 2 * (cp - 1) * kv_bytes + cp * kv32_bytes
    if method == "ulysses":
        rep = max(1, cp // hk)
        kv_rep = kv_bytes * rep
        # q + kv, the output, dO, then dq + dk/dv (fp32 when kv heads were repeated)
        sizes = [q_bytes + kv_rep, q_bytes, q_bytes, q_bytes + kv_rep * (4 // es if rep > 1
                                                                        else 1)]
        bufs = [torch.empty(cp, n // cp, dtype=torch.uint8, device=q.device) for n in sizes]

        def run():
            for t in bufs:
                coll("all_to_all", torch.empty_like(t), t)
        return run, sum(sizes) * (cp - 1) // cp
    if method == "allgather":
        halves = [kv[:, :, :, :s // 2].contiguous(), kv[:, :, :, s // 2:].contiguous()]

        def run():
            for _ in range(2):
                for t in halves:
                    coll("all_gather", t.new_empty(cp * 2, *t.shape[1:]), t)
            for t in halves:
                coll("reduce_scatter", t.float(), t.float().repeat(cp, 1, 1, 1, 1))
        return run, 2 * (cp - 1) * kv_bytes + (cp - 1) * kv32_bytes

    def run():  # the reference: one gather, one reduce-scatter (in the inputs' dtype)
        coll("all_gather", kv.new_empty(cp * 2, *kv.shape[1:]), kv)
        coll("reduce_scatter", kv.clone(), kv.repeat(cp, 1, 1, 1, 1))
    return run, 2 * (cp - 1) * kv_bytes


# ---------------------------------------------------------------- one rank

def _rank(cfg: BenchConfig) -> list[dict] | None:
    from overlap.cp import CPComm, cp_attention, ulysses_fits
    from overlap.profile.timers import exposed_seconds, reset_exposed

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, cfg.dtype if cfg.dtype != "auto" else
                    ("bfloat16" if cuda else "float32"))
    cp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // cp))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tracer = Tracer(cfg, rank=rank, device=device, prefix=f"cp{cp}_")
    rows = []
    for seq in cfg.seqs:
        s, b, h, hk, d = seq // cp, cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
        gen = torch.Generator().manual_seed(rank)
        q, k, v, do = (torch.randn(b, n, s, d, generator=gen).to(device, dtype)
                       for n in (h, hk, hk, h))
        comm = CPComm(group, timeout=cfg.timeout)
        mask = None if cfg.skip_dense else _zigzag_mask(s, cp, rank, device)
        steps = {} if cfg.skip_dense else {
            "reference": lambda q, k, v: _GatherThenAttend.apply(q, k, v, comm, mask)}
        steps["reference (blocks)"] = lambda q, k, v: _GatherThenBlocks.apply(q, k, v, comm)
        for m in METHODS:
            if m != "ulysses" or ulysses_fits(h, hk, cp):
                steps[m] = (lambda m: lambda q, k, v: cp_attention(
                    q, k, v, comm=comm, causal=True, method=m))(m)
        t0 = time.perf_counter()
        cp_attention(q, k, v, comm=comm, causal=True, method="auto")  # measured once here
        sync()
        choose_s = time.perf_counter() - t0
        (choice,) = comm.cp_choices.values()
        steps["auto"] = lambda q, k, v: cp_attention(q, k, v, comm=comm, causal=True,
                                                     method="auto")

        def step(fn):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            fn(*leaves).backward(do)
            sync()

        alone = {m: _transfers(m, comm, q, k) for m in steps if m not in ("auto",
                                                                       "reference (blocks)")}
        alone["reference (blocks)"] = _transfers("reference", comm, q, k)
        alone["auto"] = alone[choice]
        for fn in steps.values():
            for _ in range(cfg.warmup):
                step(fn)
        for run, _ in alone.values():
            run()
        samples = {m: [] for m in steps}
        exposed = {m: [] for m in steps}
        comm_alone = {m: [] for m in alone}
        with tracer.region(f"seq{seq}"):
            for _ in range(cfg.rounds):
                for m, fn in steps.items():
                    dist.barrier(group=group)
                    reset_exposed()
                    with tracer.sample(f"{seq} {m}"):
                        t0 = time.perf_counter()
                        step(fn)
                        samples[m].append(time.perf_counter() - t0)
                    exposed[m].append(exposed_seconds("cp"))
                for m, (run, _) in alone.items():
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    run()
                    sync()
                    comm_alone[m].append(time.perf_counter() - t0)
        # A step takes as long as its slowest rank. A rank's waits also absorb its peers' lag
        # (ranks time-share the cores here), so the rank that waited least shows best what
        # the transfers themselves left exposed.
        for table, how in ((samples, dist.ReduceOp.MAX), (exposed, dist.ReduceOp.MIN)):
            for m, values in table.items():
                t = torch.tensor(values, dtype=torch.float64)
                dist.all_reduce(t, op=how, group=group)
                table[m] = t.tolist()
        base = statistics.median(samples["reference" if "reference" in samples else
                                         "reference (blocks)"])
        same_work = statistics.median(samples["reference (blocks)"])
        for m in steps:
            med = statistics.median(samples[m])
            t_comm = statistics.median(comm_alone[m])
            t_exp = statistics.median(exposed[m])
            rows.append({"seq": seq, "cp": cp, "method": m, "ms": 1e3 * med,
                         "ratio": base / med, "vs_blocks": same_work / med,
                         "spread": (max(samples[m]) - min(samples[m])) / med,
                         "sent_MB": alone[m][1] / 1e6, "comm_ms": 1e3 * t_comm,
                         "exposed_ms": 1e3 * t_exp,
                         "hidden%": 100 * (1 - t_exp / t_comm) if t_comm else 0.0,
                         "auto_choice": f"{choice} (chosen in {choose_s:.1f} s)"
                         if m == "auto" else "",
                         **tracer.info(f"{seq} {m}")})
        comm.close()
    tracer.close()
    return rows if rank == 0 else None


def _notes(cfg: BenchConfig, cuda: bool, dtype: str) -> list[str]:
    return [f"command: {command_line('bench.bench_cp', cfg)}",
            f"b {cfg.batch}, h {cfg.heads}, h_kv {cfg.kv_heads}, d {cfg.head_dim}, {dtype}, "
            f"causal, zig-zag; median of {cfg.rounds} rounds, every row once per round; "
            "ratio = reference ms / row ms (same cp and seq, same run)",
            "reference: all-gather kv (waited), one SDPA with the zig-zag mask (torch's fused "
            "kernel, every masked entry computed); backward: SDPA's, then reduce-scatter "
            "dK/dV (waited)",
            "reference (blocks): the same gather and reduce-scatter, waited for, around the "
            "methods' own block kernel over the causal blocks only (no masked entry "
            "computed): the same work as the methods with nothing overlapped; vs_blocks = its "
            "ms / row ms",
            "ms: per round the slowest rank's time; sent_MB: bytes of this rank's data that "
            "must reach other ranks per forward + backward (ring: kv hops and fp32 dK/dV hops; "
            "allgather: two gathers and an fp32 reduce-scatter; ulysses: four all-to-alls); "
            "comm_ms: those transfers alone; exposed_ms: per round the least time any rank was "
            "blocked in the row's waits (overlap.profile.timers; a rank's waits also absorb "
            "its peers' lag, which is large when ranks time-share cores); hidden% = 100 * (1 - "
            "exposed_ms / comm_ms)",
            "auto: cp_attention(method=\"auto\"); its one-time measurement (every method "
            "once untimed and 3 times timed) ran before the timed rounds; auto_choice is what "
            "every rank picked and how long choosing took",
            ("transport: NCCL" if cuda else
             "transport: gloo on TCP loopback; the ranks share the machine's 2 cores with "
             "gloo's threads, so a transfer competes with the compute it should hide under; "
             "nothing here says anything about a GPU")]


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(BenchConfig, __doc__.splitlines()[0], argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_trace_options(cfg, "bench_cp", cuda=torchrun and torch.cuda.is_available())
    cuda = torchrun and torch.cuda.is_available()
    if torchrun:  # this process is a rank
        if cuda:  # before NCCL starts: the rank's GPU, its host id when ranks share one
            apply_sharing()
            gpu_for_rank()
        dist.init_process_group("nccl" if cuda else "gloo")
        rows = _rank(cfg)
        last = dist.get_rank() != 0
        dist.destroy_process_group()
        if last:
            return
    else:
        from overlap.dist.launch import launch

        rows = []
        for world in cfg.world_sizes:
            rows += launch(_rank, world, args=(cfg,), timeout=cfg.timeout, backend="gloo")[0]
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
    out = cfg.out or ("bench/results/cp" if not cuda else "bench/results/cp_" +
                      torch.cuda.get_device_name(0).replace(" ", "_").lower())
    table = Table("Context-parallel attention forward + backward: ring, all-gather, Ulysses "
                  "vs gather-then-attend", trace_columns(COLUMNS, cfg, after="hidden%"),
                  notes=_notes(cfg, cuda, dtype))
    finish_trace_column(cfg, rows, out, "bench_cp")
    for row in rows:
        table.add(**row)
    table.publish(out)


if __name__ == "__main__":
    main()
