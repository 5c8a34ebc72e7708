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
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

from bench.runner import Table, Timing, parse_config, command_line
from overlap.dist.device import rank_device
from overlap.dist.launch import launch
from overlap.models import GPT, GPTConfig


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig:
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
    out = [("unsharded", "-", False, "-", _model(cfg, device, dtype).blocks[0], x, dy),
           ("dtensor", "-", False, "-", _dtensor_block(_model(cfg, device, dtype).blocks[0],
                                                        tp, device), x, dy)]
    for backend in cfg.backends:
        # Only "chunked" compares shapes across ranks on every call; the workspace backends
        # do it once per cached context.
        for check in ((True, False) if backend == "chunked" else (True,)):
            for sp in (False, True):
                model = parallelize(_model(cfg, device, dtype), tp_group=group,
                                    backend=backend, sequence_parallel=sp, check_inputs=check)
                out.append(("overlap", backend, sp, check, model.blocks[0], x_s if sp else x,
                            dy_s if sp else dy))
    return out


def _bench_rank(cfg: BenchConfig) -> list[dict]:
    from overlap.tp import close_all_contexts

    device = rank_device()
    dtype = getattr(torch, cfg.dtype)
    variants = _variants(cfg, device, dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def step(block, x, dy):
        xi = x.detach().requires_grad_()
        block(xi).backward(dy)
        block.zero_grad(set_to_none=True)

    samples: list[list[float]] = [[] for _ in variants]
    try:
        for it in range(cfg.warmup + cfg.iters):
            for i, (*_, block, x, dy) in enumerate(variants):
                sync()
                t0 = time.perf_counter()
                step(block, x, dy)
                sync()
                if it >= cfg.warmup:
                    samples[i].append(time.perf_counter() - t0)
    finally:
        close_all_contexts()
    return [dict(variant=v[0], backend=v[1], sp=v[2], check=v[3], timing=Timing(s))
            for v, s in zip(variants, samples)]


def main(cfg: BenchConfig) -> None:
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    load_before = os.getloadavg()[0]
    rows = launch(_bench_rank, cfg.tp, args=(cfg,), backend=backend, timeout=3600,
                  preload=["torch.distributed.tensor.parallel"])[0]
    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    base = next(r["timing"].median for r in rows if r["variant"] == "unsharded")
    dt = next(r["timing"].median for r in rows if r["variant"] == "dtensor")
    notes = [
        f"overlap GPT Block: batch {cfg.batch}, seq {cfg.seq_len}, d_model {cfg.d_model}, "
        f"{cfg.n_head} heads, MLP 4x, {cfg.dtype}; forward + backward (input grad and all "
        f"parameter grads); tp={cfg.tp} ranks on {cfg.device} ({backend}), 1 thread per rank.",
        f"Median of {cfg.iters} iterations after {cfg.warmup} warm-up, variants round-robin, "
        f"barrier-synced; {load} (on {os.cpu_count()} cores: other jobs shared the machine "
        "when above ~0.5).",
        "check_inputs=False: the fused ops skip the per-call cross-rank shape check.",
        "vs_unsharded = unsharded median / median (the unsharded block runs on every rank at "
        "once, one core each); vs_dtensor = DTensor TP median / median.",
        "Command: " + command_line("bench.bench_tp_block", cfg),
    ]
    table = Table("Transformer block forward+backward: overlap TP vs DTensor TP vs unsharded",
                  ["variant", "backend", "sequence_parallel", "check_inputs", "median_ms",
                   "spread", "vs_unsharded", "vs_dtensor"], notes=notes)
    for r in rows:
        t = r["timing"]
        table.add(variant=r["variant"], backend=r["backend"], sequence_parallel=r["sp"],
                  check_inputs=r["check"], median_ms=t.median_ms, spread=t.spread, vs_unsharded=base / t.median,
                  vs_dtensor=dt / t.median)
    table.publish(cfg.out)


if __name__ == "__main__":
    main(parse_config(BenchConfig, __doc__.splitlines()[0]))
