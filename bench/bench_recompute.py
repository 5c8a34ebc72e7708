"""Activation recomputation: step time and activation memory of --recompute none / selective /
full (``overlap.train.recompute``) at one configuration.

    python -m bench.bench_recompute                          # CPU, 1 rank (tp=1)
    python -m bench.bench_recompute --tp 2                   # 2 gloo ranks, sequence parallel
    python -m bench.bench_recompute --tp 8 --device cuda     # GPU: NCCL, one GPU per rank

Writes bench/results/recompute.json and recompute.md (``--out`` to change).

The three modes train their own copies of the same GPT (same init, same batch) in the same
processes and take turns (one step each per round, ``rounds`` rounds) so all see the same
machine load; the ratios are of medians measured in the same run. A step is forward + loss +
backward + AdamW step (fp32 masters with bf16, ``MasterOptimizer``).

Memory columns, per rank:

- ``saved_MB``: what the forward keeps for the backward, measured with
  ``saved_tensors_hooks`` over the whole model and loss (``overlap.train.activations.
  saved_bytes``: each storage once, parameters excluded). It is the activation memory at the
  forward/backward boundary, where the stored activations peak.
- ``transient_MB``: what a recomputation re-materialises at once in the backward, measured on
  one block: full recomputes one whole block (its ``none`` saves), selective one attention
  core (one block's ``none`` minus ``selective`` saves).
- ``peak_MB`` = saved + transient; ``vs_none``: its ratio to ``none``'s peak.
- ``layer_KB`` / ``formula_KB``: one block's measured saves vs Korthikanti et al.

``--kernels gpu`` (default) measures with ``as_on_gpu``: the attention core written out in the
activation dtype and the 1-byte-mask fused dropout, what the GPU kernels the formula describes
save (CPU sdpa's flash kernel saves no s x s scores, so selective recomputation would save
nothing on it); ``--kernels cpu`` keeps the stock CPU kernels.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.distributed as dist

from bench.runner import Table, Timing, command_line, parse_config, time_fn
from overlap.dist.device import gpu_for_rank
from overlap.dist.launch import launch

MODES = ("none", "selective", "full")


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig:
    tp: int = 1
    sequence_parallel: int = 1
    batch: int = 4
    seq_len: int = 256
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 8
    vocab_size: int = 256
    dropout: float = 0.1
    dtype: str = "bf16"
    kernels: str = "gpu"
    warmup: int = 1
    rounds: int = 11
    device: str = "cpu"
    out: str = "bench/results/recompute"


def _build(cfg: BenchConfig, base, mode: str, comm):
    from overlap.train.activations import as_on_gpu
    from overlap.train.precision import MasterOptimizer
    from overlap.train.recompute import apply_recompute

    model = copy.deepcopy(base)
    if comm is not None:
        from overlap.models.tp_plans import gpt_plan
        from overlap.nn.parallelize import parallelize

        parallelize(model, comm=comm, plan=gpt_plan(loss_parallel=True),
                    sequence_parallel=bool(cfg.sequence_parallel))
    if cfg.kernels == "gpu":
        as_on_gpu(model)
    apply_recompute(model, mode)
    opt = MasterOptimizer([{"params": list(model.parameters())}], torch.optim.AdamW, lr=1e-4)
    return model, opt


def _bench_rank(cfg: BenchConfig) -> dict:
    from overlap.models.gpt import GPT, GPTConfig, gpt_loss
    from overlap.nn.embedding import vocab_parallel_cross_entropy
    from overlap.train.activations import (LayerShape, korthikanti_bytes, measure_layer,
                                           saved_bytes)

    rank = dist.get_rank()
    if cfg.device == "cuda":
        device = gpu_for_rank()
    else:
        device = torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model,
                         n_layer=cfg.n_layer, n_head=cfg.n_head, dropout=cfg.dropout)
               ).to(device=device, dtype=dtype)
    comm = None
    group = dist.group.WORLD
    if cfg.tp > 1:
        from overlap.tp import TPComm

        comm = TPComm(group, backend="auto", timeout=600.0, device=device)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=gen).to(device)
    tgt = torch.roll(idx, -1, dims=1)

    def loss_of(model):
        logits = model(idx)
        if comm is None:
            return gpt_loss(logits.float(), tgt)
        return vocab_parallel_cross_entropy(logits.float(), tgt, group=group)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=group)

    variants = {mode: _build(cfg, base, mode, comm) for mode in MODES}
    out: dict = {}
    sp = bool(cfg.sequence_parallel) and cfg.tp > 1
    seq = cfg.seq_len // cfg.tp if sp else cfg.seq_len
    for mode, (model, opt) in variants.items():
        params = list(model.parameters())
        saved, loss = saved_bytes(loss_of, model, exclude=params)
        loss.backward()
        opt.zero_grad()
        x = torch.randn(cfg.batch, seq, cfg.d_model, dtype=dtype, device=device,
                        requires_grad=True)
        layer = measure_layer(model.blocks[0], x)
        opt.zero_grad()
        out[mode] = dict(saved=saved, layer=layer, samples=[])
    for mode in MODES:
        if mode != "none":
            full_layer = out["none"]["layer"]
            out[mode]["transient"] = (full_layer if mode == "full"
                                      else full_layer - out["selective"]["layer"])
        else:
            out[mode]["transient"] = 0
        out[mode]["formula"] = korthikanti_bytes(
            LayerShape(s=cfg.seq_len, b=cfg.batch, h=cfg.d_model, a=cfg.n_head, t=cfg.tp,
                       sp=sp), mode)

    def step(model, opt) -> None:
        loss_of(model).backward()
        opt.step()
        opt.zero_grad()

    for model, opt in variants.values():
        for _ in range(cfg.warmup):
            step(model, opt)
    for _ in range(cfg.rounds):
        for mode, (model, opt) in variants.items():
            out[mode]["samples"] += time_fn(lambda: step(model, opt), warmup=0, iters=1,
                                            sync=sync).samples
    if comm is not None:
        from overlap.tp import close_default_comms

        comm.close()
        close_default_comms()
    return out


def main(cfg: BenchConfig) -> None:
    if cfg.dtype not in ("bf16", "fp32"):
        raise SystemExit(f"bench_recompute: --dtype must be bf16 or fp32, got {cfg.dtype}")
    if cfg.kernels not in ("gpu", "cpu"):
        raise SystemExit(f"bench_recompute: --kernels must be gpu or cpu, got {cfg.kernels}")
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    load_before = os.getloadavg()[0]
    res = launch(_bench_rank, cfg.tp, args=(cfg,), backend=backend, timeout=3600,
                 preload=["torch._dynamo"])[0]
    base_t = Timing(res["none"]["samples"]).median
    base_peak = res["none"]["saved"] + res["none"]["transient"]
    table = Table("Activation recomputation: step time and activation memory", [
        "mode", "step_ms", "spread", "vs_none_time", "saved_MB", "transient_MB", "peak_MB",
        "vs_none_peak", "layer_KB", "formula_KB"], notes=[])
    for mode in MODES:
        r = res[mode]
        t = Timing(r["samples"])
        peak = r["saved"] + r["transient"]
        table.add(mode=mode, step_ms=t.median_ms, spread=t.spread,
                  vs_none_time=t.median / base_t, saved_MB=r["saved"] / 2**20,
                  transient_MB=r["transient"] / 2**20, peak_MB=peak / 2**20,
                  vs_none_peak=peak / base_peak, layer_KB=r["layer"] / 2**10,
                  formula_KB=r["formula"] / 2**10)
    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    sp = bool(cfg.sequence_parallel) and cfg.tp > 1
    table.notes = [
        f"GPT d_model={cfg.d_model} n_layer={cfg.n_layer} n_head={cfg.n_head} "
        f"vocab={cfg.vocab_size} seq_len={cfg.seq_len}, micro-batch {cfg.batch}, dropout "
        f"{cfg.dropout}, {cfg.dtype} (fp32 masters), tp={cfg.tp}"
        f"{' with sequence parallelism' if sp else ''}, {cfg.kernels} kernels' saves; ranks "
        f"on {cfg.device} ({backend}); median of {cfg.rounds} steps per mode (modes taking "
        f"turns) after {cfg.warmup} warm-up; {load} (on {os.cpu_count()} cores).",
        "vs_none_time: median step / none's median step (the recomputation's cost); "
        "saved_MB: measured bytes the forward keeps for the backward (whole model + loss); "
        "transient_MB: what one recomputation re-materialises in the backward (measured on "
        "one block); peak = saved + transient; layer_KB: one block's saves, formula_KB: "
        "Korthikanti et al. (16-bit activations).",
        "Command: " + command_line("bench.bench_recompute", cfg),
    ]
    table.publish(cfg.out)


if __name__ == "__main__":
    main(parse_config(BenchConfig, __doc__.splitlines()[0]))
