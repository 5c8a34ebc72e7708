"""Quantized collectives, nccl-tests style: fp32 vs BF16 vs INT8 on the wire.

    python -m bench.bench_quant                          # CPU: 2 and 4 gloo ranks, 4 KB .. 64 MB
    python -m bench.bench_quant --world-sizes 2 4 --max-size 256M 64M   # a top size per world size
    python -m bench.bench_quant --device cuda --world-sizes 8 --max-size 256M   # GPU: NCCL

For every size (bytes of the fp32 tensor, N = size / 4 elements, N(0,1) data, a different seed
per rank) and op (all_reduce, reduce_scatter, all_gather), the fp32 row is the plain
``torch.distributed`` collective and the bf16 / int8 rows are ``overlap.comm.quant`` with that
``comm_dtype`` on the same fp32 input, all in one run. Columns:

- ``time_us``: the slowest rank's median over ``iters`` barrier-synced calls; ``spread`` is
  (max - min) / median of its samples.
- ``algbw``: S / time in GB/s, with S the fp32 data size as nccl-tests defines it (the input of
  all_reduce and reduce_scatter, the output of all_gather), so the three wire types compare on
  the same logical work. ``busbw = algbw * 2(n-1)/n`` (all_reduce) or ``* (n-1)/n`` (others).
- ``sent_B``: bytes one rank hands to the transport for its peers (``quant.wire_bytes``); for
  fp32 the ring count nccl-tests assumes. ``vs_fp32`` is sent_B over the fp32 row's.
- ``err``: relative RMS error of the result against the fp32 collective's result.

Quantized calls pass ``check_ranks=False`` (the fp32 call has no such check either).

``--profile DIR`` / ``--nsys`` add ``trace_overlap%``: 100 * hidden / communication time over
the row's timed calls on every rank (quantize/dequantize pieces are compute, the wire is
communication), from torch.profiler traces of the timed calls or the Nsight Systems report, by
overlap-analyze's code (bench.runner.TraceOptions). On GPUs (one world size per nsys run):

    nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop \
        -o bench/results/quant_gpu python -m bench.bench_quant --device cuda --world-sizes 8 \
        --max-size 256M --nsys --out bench/results/quant_gpu
    python -m bench.runner fill bench/results/quant_gpu      # after nsys wrote its report
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist

from bench.runner import (Table, TraceOptions, Tracer, add_fields, apply_sharing_flag,
                          check_trace_options, finish_trace_column, sharing_flag, time_fn,
                          trace_columns)
from overlap.comm import quant
from overlap.dist.device import gpu_for_rank
from overlap.dist.launch import launch

OPS = ("all_reduce", "reduce_scatter", "all_gather")
WIRES = ("fp32", "bf16", "int8")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig(TraceOptions):
    world_sizes: tuple[int, ...] = (2, 4)
    min_size: int = 4 << 10
    max_sizes: tuple[int, ...] = (64 << 20,)  # one for all world sizes, or one per world size
    size_step: int = 4
    block_size: int = quant.DEFAULT_BLOCK_SIZE
    block_sweep: tuple[int, ...] = (32, 64, 128, 256, 512)
    block_sweep_size: int = 4 << 20
    device: str = "cpu"
    timeout: float = 3600.0
    out: str = "bench/results/quant"

    def sizes(self, world_size: int) -> list[int]:
        top = self.max_sizes[0] if len(self.max_sizes) == 1 else \
            self.max_sizes[self.world_sizes.index(world_size)]
        out, s = [], self.min_size
        while s <= top:
            out.append(s)
            s *= self.size_step
        return out


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return gpu_for_rank()
    return torch.device("cpu")


def _call(op: str, x: torch.Tensor, wire: str, group, block: int):
    if wire == "fp32":
        if op == "all_reduce":
            dist.all_reduce(x, group=group)
            return x
        return getattr(quant, op)(x, group=group, comm_dtype="fp32", check_ranks=False)
    return getattr(quant, op)(x, group=group, comm_dtype=wire, block_size=block,
                              check_ranks=False)


def _iters(size: int) -> tuple[int, int]:
    if size <= 1 << 20:
        return 3, 20
    if size <= 16 << 20:
        return 2, 8
    return 1, 4


def _rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double().reshape(-1), ref.double().reshape(-1)
    return ((a - ref).norm() / ref.norm()).item() if ref.numel() else 0.0


def _rank_sweep(sizes: list[int], block: int, device_kind: str,
                trace: TraceOptions) -> list[dict]:
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    dev = _device(device_kind)
    tracer = Tracer(trace, rank=rank, device=dev, prefix=f"w{n}_")

    def barrier():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier(group=group)

    rows = []
    for size in sizes:
        N = size // 4
        x = torch.randn(N, generator=torch.Generator().manual_seed(rank)).to(dev)
        for op in OPS:
            # Inputs must divide among ranks for reduce_scatter; sizes are powers of two.
            ref = _call(op, x.clone(), "fp32", group, block)
            for wire in WIRES:
                err = 0.0 if wire == "fp32" else _rel_rms(_call(op, x.clone(), wire, group,
                                                                block), ref)
                work = x.clone()  # all_reduce runs in place: reuse one buffer, values just grow
                warmup, iters = _iters(size)
                key = f"{op}_{wire}_{_human(size).replace(' ', '')}"
                t = time_fn(lambda: _call(op, work, wire, group, block), warmup=warmup,
                            iters=iters, sync=barrier, trace=tracer.row(key))
                rows.append(dict(op=op, wire=wire, size=size, elements=N, median_s=t.median,
                                 spread=t.spread, err=err, **tracer.info(key)))
    tracer.close()
    return rows


def _rank_block_sweep(size: int, blocks: tuple[int, ...], device_kind: str) -> list[dict]:
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    dev = _device(device_kind)
    N = size // 4
    x = torch.randn(N, generator=torch.Generator().manual_seed(rank)).to(dev)
    ref = x.clone()
    dist.all_reduce(ref, group=group)
    out = []
    for block in blocks:
        got = quant.all_reduce(x.clone(), group=group, comm_dtype="int8", block_size=block,
                               check_ranks=False)
        work = x.clone()
        t = time_fn(lambda: quant.all_reduce(work, group=group, comm_dtype="int8",
                                             block_size=block, check_ranks=False),
                    warmup=1, iters=5, sync=lambda: dist.barrier(group=group))
        out.append(dict(block=block, err=_rel_rms(got, ref), median_s=t.median))
    return out


def _human(size: int) -> str:
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if size >= 1 << shift:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def run(cfg: BenchConfig) -> Table:
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    load_before = os.getloadavg()[0]
    table = Table("Quantized collectives: fp32 vs BF16 vs INT8 on the wire",
                  columns=trace_columns(["ranks", "op", "wire", "size", "time_us", "spread",
                                         "algbw_GBps", "busbw_GBps", "sent_B", "vs_fp32",
                                         "err"], cfg, after="spread"))
    trace = TraceOptions(profile=cfg.profile, nsys=cfg.nsys, nsys_report=cfg.nsys_report)
    sweep_notes, rows = [], []
    for n in cfg.world_sizes:
        per_rank = launch(_rank_sweep, n, args=(cfg.sizes(n), cfg.block_size, cfg.device,
                                                trace),
                          timeout=cfg.timeout, backend=backend)
        fp32_sent = {}
        for i, row in enumerate(per_rank[0]):
            slowest = max(per_rank, key=lambda r: r[i]["median_s"])  # it sets the pace
            secs, spread = slowest[i]["median_s"], slowest[i]["spread"]
            op, wire, size, N = row["op"], row["wire"], row["size"], row["elements"]
            data = size * n if op == "all_gather" else size
            algbw = data / secs / 1e9
            comm = None if wire == "fp32" else wire
            sent = quant.wire_bytes(op, N, 4, comm, n, cfg.block_size)
            if wire == "fp32":
                fp32_sent[(op, size)] = sent
            rows.append(dict(ranks=n, op=op, wire=wire, size=_human(size), time_us=secs * 1e6,
                             spread=spread, algbw_GBps=algbw,
                             busbw_GBps=algbw * BUS_FACTOR[op](n), sent_B=sent,
                             vs_fp32=sent / fp32_sent[(op, size)], err=row["err"],
                             **{k: row[k] for k in ("trace_region", "trace_steps")
                                if k in row}))
        blocks = launch(_rank_block_sweep, n, args=(cfg.block_sweep_size, cfg.block_sweep,
                                                    cfg.device), timeout=cfg.timeout,
                        backend=backend)[0]
        N = cfg.block_sweep_size // 4
        fp32 = quant.wire_bytes("all_reduce", N, 4, None, n, 128)
        sweep_notes.append(
            f"Block size trade-off, INT8 all_reduce of {_human(cfg.block_sweep_size)} over {n} "
            "ranks (relative RMS error vs fp32 / bytes vs fp32 / time): " + "; ".join(
                f"B={b['block']}: {b['err']:.2e} / "
                f"{quant.wire_bytes('all_reduce', N, 4, 'int8', n, b['block']) / fp32:.4f} / "
                f"{b['median_s'] * 1e3:.1f} ms" for b in blocks))
    finish_trace_column(cfg, rows, cfg.out, "bench_quant")
    for row in rows:
        table.add(**row)
    table.notes = [
        "Sizes " + ", ".join(f"{_human(cfg.min_size)} .. {_human(max(cfg.sizes(n)))} for {n} "
                             "ranks" for n in cfg.world_sizes)
        + f" (x{cfg.size_step}) of fp32 data per rank, N(0,1); INT8 block size "
        f"{cfg.block_size}; device {cfg.device}, one thread per rank.",
        "INT8 sends, per rank, 2(n-1) shards of L + 4L/B bytes (all_reduce: L int8 codes and "
        "L/B fp32 scales, L = ceil(N/n) rounded up to whole blocks) or (n-1) such shards "
        "(reduce_scatter, all_gather): 0.2578x the fp32 bytes for B = 128 when N is a "
        "multiple of n*B.",
        "fp32 rows are the plain torch.distributed collectives; err is the relative RMS "
        "error against them. spread = (max - min) / median of the slowest rank's samples.",
        f"1-minute load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after "
        f"the run on {os.cpu_count()} cores (other jobs shared the machine: timings are noisy, "
        "the bytes and errors are not).",
        *sweep_notes,
    ]
    if cfg.profile or cfg.nsys:
        table.notes.append(
            "trace_overlap% = 100 * hidden / communication time over the row's timed calls on "
            "every rank, from " + (f"torch.profiler traces (all threads) in {cfg.profile}/"
                                   "w<ranks>_<row>/" if cfg.profile else
                                   "the Nsight Systems report")
            + " by overlap-analyze's code; times of a traced run include the profiler's "
            "overhead.")
    return table


def main(argv: list[str] | None = None) -> None:
    defaults = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=list(defaults.world_sizes))
    p.add_argument("--min-size", default="4K", help="bytes of fp32 data, e.g. 4K")
    p.add_argument("--max-size", nargs="+", default=["64M"],
                   help="e.g. 256M, or one per world size: 256M 64M")
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--device", choices=("cpu", "cuda"), default=defaults.device)
    p.add_argument("--out", default=defaults.out)
    add_fields(p, TraceOptions)
    sharing_flag(p)
    a = p.parse_args(argv)
    apply_sharing_flag(p, vars(a))
    if len(a.max_size) not in (1, len(a.world_sizes)):
        p.error("--max-size takes one size or one per world size")
    cfg = BenchConfig(world_sizes=tuple(a.world_sizes), min_size=_parse_size(a.min_size),
                      max_sizes=tuple(_parse_size(v) for v in a.max_size),
                      block_size=a.block_size,
                      device=a.device, out=a.out, profile=a.profile, nsys=a.nsys,
                      nsys_report=a.nsys_report)
    check_trace_options(cfg, "bench_quant",
                        cuda=cfg.device == "cuda" and torch.cuda.is_available())
    if cfg.nsys and len(cfg.world_sizes) != 1:
        p.error("--nsys: one nsys capture range covers one launch; pass one --world-sizes value")
    table = run(cfg)
    json_path, md_path = table.write(cfg.out)
    print(open(md_path).read())
    print(f"wrote {json_path} and {md_path}")


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


if __name__ == "__main__":
    main()
