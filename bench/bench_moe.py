"""One MoE layer, forward + backward, at EP 2 and 4: the chunked exchange vs the sequential one.

    python -m bench.bench_moe                        # CPU: 2 and 4 local gloo ranks
    python -m bench.bench_moe --world-sizes 2 --rounds 31

Shapes, scaled down so a CPU runs them (tokens per rank ``T``; hidden ``d``; expert FFN ``f``;
``E`` experts, top ``k``): Mixtral-8x7B-like (d 4096 -> 256, f 14336 -> 512, E 8, k 2) and
DeepSeek-V3-like (d 7168 -> 256, f 2048 -> 128, E 256 -> 32, k 8 -> 4, one shared expert of
f 2048 -> 128). Variants, all on the same routed tokens, each round timing every variant once
in turn (so drift hits them alike), ``rounds`` rounds, the median reported:

- ``torch``: torch's differentiable functional ``all_to_all_single`` and one GEMM pair per
  expert (a loop): what a user writes with torch alone;
- ``sequential``: overlap's layer with ``chunks=1`` (dispatch, wait, experts, combine, wait);
- ``chunked c``: the same layer with the exchange in ``c`` pieces; ``chunked 2 int8`` also
  sends the dispatch as blockwise INT8 (128 values per fp32 scale; its wire_MB counts fp32);
- ``symmetric``: rows written into the owners' shared-memory userbuffers, each source's
  rows computed as soon as they are signalled (``symmetric int8``: INT8 dispatch);
- capacity mode (``capacity_factor`` 1.25) and dropless.

``ratio`` = sequential / variant (higher is faster). ``comm_ms``: the same four exchanges
alone over gloo (the symmetric rows move through shared memory instead, so their ratio also
holds the cheaper transport); ``best``: the ratio a perfect overlap could reach, sequential / max(sequential -
comm_ms, comm_ms). ``wire_MB`` = bytes one rank sends to others per forward + backward
(capacity mode sends its empty slots too). On this machine the ranks share 2 cores: the question these numbers answer is whether
the pieces' transfers hide under the other pieces' GEMMs when the transport (gloo over TCP
loopback) and the compute compete for the same cores; they say nothing about a GPU.
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

SHAPES = {
    # name: (tokens per rank, d, f, E, k, shared f or None)
    "mixtral-like": (512, 256, 512, 8, 2, None),
    "deepseek-like": (512, 256, 128, 32, 4, 128),
}


@dataclasses.dataclass
class BenchConfig(TraceOptions):
    world_sizes: tuple[int, ...] = (2, 4)
    shapes: tuple[str, ...] = tuple(SHAPES)
    chunks: tuple[int, ...] = (2, 4)
    rounds: int = 15
    warmup: int = 3
    capacity_factor: float = 1.25
    timeout: float = 600.0
    out: str = "bench/results/moe"


def _torch_layer(layer):
    """The same layer with the exchange written with torch alone: differentiable
    all_to_all_single (torch's functional collectives) and a loop of per-expert GEMMs."""
    import torch.nn.functional as F
    from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

    group = layer.comm.group

    def experts_loop(x, offsets_list):
        outs, start = [], 0
        w1, w2 = layer.experts.w_gate_up, layer.experts.w_down
        f = w2.shape[1]
        for j, end in enumerate(offsets_list):
            h = x[start:end] @ w1[j]
            outs.append((F.silu(h[:, :f]) * h[:, f:]) @ w2[j])
            start = end
        return torch.cat(outs)

    def static(slots, c, x2, w):
        el, ep, d = layer.num_local, layer.ep, layer.d_model
        recv = a2a(slots, None, None, group)
        grouped = recv.reshape(ep, el, c, d).transpose(0, 1).reshape(el * ep * c, d)
        y = experts_loop(grouped, [(j + 1) * ep * c for j in range(el)])
        y = y.reshape(el, ep, c, d).transpose(0, 1).reshape(ep * el * c, d)
        return a2a(y, None, None, group), None  # the layer adds its shared expert itself

    layer._experts_static = static
    return layer


def _rank(cfg: BenchConfig, world: int) -> list[dict] | None:
    from overlap.moe import EPComm, MoE

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    rank, group = dist.get_rank(), dist.group.WORLD
    tracer = Tracer(cfg, rank=rank, device=torch.device("cpu"), prefix=f"ep{world}_")
    rows = []
    for shape in cfg.shapes:
        t, d, f, e, k, shared = SHAPES[shape]
        x = torch.randn(t, d, generator=torch.Generator().manual_seed(rank))
        g = torch.randn(t, d, generator=torch.Generator().manual_seed(100 + rank))
        variants = {}
        for mode, cf in (("capacity", cfg.capacity_factor), ("dropless", None)):
            for chunks in (1, *cfg.chunks):
                torch.manual_seed(0)
                name = "sequential" if chunks == 1 else f"chunked {chunks}"
                variants[(mode, name)] = MoE(d, f, e, k, capacity_factor=cf, shared_d_ff=shared,
                                             comm=EPComm(group, chunks=chunks))
            for name, dispatch in (("symmetric", "same"), ("symmetric int8", "int8")):
                torch.manual_seed(0)
                variants[(mode, name)] = MoE(
                    d, f, e, k, capacity_factor=cf, shared_d_ff=shared,
                    comm=EPComm(group, backend="symmetric", max_tokens=t, dispatch=dispatch))
            if cf is not None:
                torch.manual_seed(0)
                variants[(mode, "chunked 2 int8")] = MoE(
                    d, f, e, k, capacity_factor=cf, shared_d_ff=shared,
                    comm=EPComm(group, chunks=2, dispatch="int8"))
                torch.manual_seed(0)
                variants[(mode, "torch")] = _torch_layer(
                    MoE(d, f, e, k, capacity_factor=cf, shared_d_ff=shared,
                        comm=EPComm(group, chunks=1)))

        def step(layer):
            xx = x.clone().requires_grad_()
            y = layer(xx)
            (y * g).sum().backward()
            return layer.aux.dropped

        for layer in variants.values():
            for _ in range(cfg.warmup):
                step(layer)
        # The transfers alone: the four exchanges of one sequential forward + backward
        # (dispatch, combine, and their gradients) with nothing to hide them under.
        wire = {mode: _wire_rows(variants[(mode, "sequential")], t, mode, cfg)
                for mode in ("capacity", "dropless")}
        samples = {key: [] for key in variants}
        comm = {mode: [] for mode in wire}
        dropped = {}
        with tracer.region(shape):
            for _ in range(cfg.rounds):
                for key, layer in variants.items():
                    dist.barrier(group=group)
                    with tracer.sample(f"{shape} {key}"):
                        t0 = time.perf_counter()
                        dropped[key] = step(layer)
                        dist.barrier(group=group)
                        samples[key].append(time.perf_counter() - t0)
                for mode, rows_out in wire.items():
                    buf = torch.randn(rows_out, d)
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    for _ in range(4):
                        dist.all_to_all_single(torch.empty_like(buf), buf, group=group)
                    dist.barrier(group=group)
                    comm[mode].append(time.perf_counter() - t0)
        for (mode, name), layer in variants.items():
            med = statistics.median(samples[(mode, name)])
            base = statistics.median(samples[(mode, "sequential")])
            spread = (max(samples[(mode, name)]) - min(samples[(mode, name)])) / med
            t_comm = statistics.median(comm[mode])
            rows.append(dict(shape=shape, ep=world, mode=mode, variant=name,
                             ms=1e3 * med, ratio=base / med, spread=spread,
                             comm_ms=1e3 * t_comm, best=base / max(base - t_comm, t_comm),
                             wire_MB=4 * wire[mode] * d * 4 * (world - 1) / world / 1e6,
                             dropped=int(dropped[(mode, name)]),
                             **tracer.info(f"{shape} {(mode, name)}")))
        for layer in variants.values():
            layer.comm.close()
    tracer.close()
    return rows if rank == 0 else None


def _wire_rows(layer, tokens: int, mode: str, cfg: BenchConfig) -> int:
    """Rows one exchange sends (fp32, d wide): capacity mode every slot, empty ones too;
    dropless every assignment (of which 1/ep stays local under uniform routing)."""
    from overlap.moe import capacity

    if mode == "capacity":
        return layer.num_experts * capacity(tokens, layer.top_k, layer.num_experts,
                                            cfg.capacity_factor)
    return tokens * layer.top_k


def main(argv: list[str] | None = None) -> None:
    from overlap.dist.launch import launch

    cfg = parse_config(BenchConfig, __doc__.splitlines()[0], argv)
    check_trace_options(cfg, "bench_moe", cuda=False)
    notes = []
    if cfg.profile:
        notes.append(f"trace_overlap% = 100 * hidden / communication time over the row's timed "
                     f"steps on every rank, from torch.profiler traces in {cfg.profile} by "
                     "overlap-analyze's code (the moe.<backend>.comm/gemm ranges); on CPU "
                     "gloo's own threads carry no range, so it counts issue and wait time")
    table = Table("MoE layer forward + backward: chunked exchange vs sequential",
                  trace_columns(["shape", "ep", "mode", "variant", "ms", "ratio", "spread",
                                 "comm_ms", "best", "wire_MB", "dropped"], cfg, after="best"),
                  notes=[f"command: {command_line('bench.bench_moe', cfg)}",
                         f"median of {cfg.rounds} rounds, every variant once per round; "
                         "ratio = sequential ms / variant ms (same mode, same run)",
                         "comm_ms: the four exchanges of one step (dispatch, combine, their "
                         "gradients) alone, same volume; best = sequential / max(sequential - "
                         "comm_ms, comm_ms): the ratio a perfect overlap would reach",
                         "transport: gloo on TCP loopback (symmetric: POSIX shared memory); ranks "
                         "share the machine's cores", *notes])
    rows = []
    for world in cfg.world_sizes:
        rows += launch(_rank, world, args=(cfg, world), timeout=cfg.timeout, backend="gloo")[0]
    finish_trace_column(cfg, rows, cfg.out, "bench_moe")
    for row in rows:
        table.add(**row)
    table.publish(cfg.out)


if __name__ == "__main__":
    main()
