"""Data-parallel training step: overlap.dp (GradReducer, ShardedOptimizer) vs torch DDP.

    python -m bench.bench_dp                                # CPU: 2 and 4 gloo ranks
    python -m bench.bench_dp --world-sizes 8 --device cuda  # GPU: NCCL, one GPU per rank

Writes bench/results/dp.json and dp.md (``--out`` to change).

Every variant trains its own copy of the same GPT on the same data in the same process group;
the variants take turns (a few steps each, several rounds) so all see the same machine load.
A step is forward + backward + AdamW step + zero_grad. Variants:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its default buckets + AdamW.
- ``reducer``: ``GradReducer`` (``--bucket-cap-mb``, default 2 MiB, first bucket 1 MiB) + AdamW,
  gradient communication in fp32 / bf16 / int8; also with DDP's 25 MiB buckets, and with
  ``bucket_cap_mb="auto"`` (buckets planned from the measured backward timeline and link,
  then raced against fixed caps in warm-up steps, ``overlap.dp.autobucket``).
- ``sharded``: ``GradReducer(shard=True)`` + ``ShardedOptimizer(AdamW)`` (reduce-scatter,
  1/dp optimizer state, parameter all-gather overlapped with the next forward).
- ``reducer, no overlap``: the same reduction run after the backward (backward under
  ``no_sync()``, then ``reduce_now()``): what the overlap saves.
- ``local``: no communication at all (compute-only lower bound).

Columns: ``step_ms`` median step time (barrier-synced) and its ``spread``; ``vs_ddp`` = DDP's
median / this one's (> 1: faster than DDP); ``comm_ms``: the gradient collectives of one step
run alone (``reduce_now()``, median); ``exposed_ms``: median time ``finish()`` waited after the
backward; ``hidden``: 1 - exposed/comm, the fraction of gradient communication hidden under
the backward; ``ag_exposed_ms`` (sharded): time the forward pre-hooks waited for the
parameter all-gathers launched by the previous step; ``state_MB``: optimizer state per rank.

``--profile DIR`` / ``--nsys`` add ``trace_overlap%``: 100 * hidden / communication time over
the variant's timed steps on every rank, from torch.profiler traces of the timed rounds
(``DIR/w<world>_rounds/trace_rank<r>.json``) or the Nsight Systems report, by overlap-analyze's
code (bench.runner.TraceOptions). On GPUs (one world size per nsys run):

    nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop \
        -o bench/results/dp_gpu python -m bench.bench_dp --world-sizes 8 --device cuda \
        --nsys --out bench/results/dp_gpu
    python -m bench.runner fill bench/results/dp_gpu         # after nsys wrote its report
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.runner import (Table, Timing, TraceOptions, Tracer, check_trace_options, command_line,
                          finish_trace_column, parse_config, time_fn, trace_columns)
from overlap.dist.device import gpu_for_rank
from overlap.dist.launch import launch
from overlap.dp import GradReducer, ShardedOptimizer
from overlap.models.gpt import GPT, GPTConfig

COMM_DTYPES = ("fp32", "bf16", "int8")


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig(TraceOptions):
    world_sizes: tuple[int, ...] = (2, 4)
    bucket_cap_mb: float = 2.0  # ours; DDP keeps its defaults (25 MiB, first bucket 1 MiB)
    batch: int = 2
    seq_len: int = 64
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    vocab_size: int = 1024
    warmup: int = 2
    rounds: int = 20
    steps_per_round: int = 1
    comm_reps: int = 5
    device: str = "cpu"
    out: str = "bench/results/dp"


def _sync(device: torch.device):
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=dist.group.WORLD)
    return sync


def _variants(base: GPT, world_group, cap_mb: float) -> dict[str, dict]:
    adamw = dict(lr=1e-4, weight_decay=0.1)
    out: dict[str, dict] = {}
    ddp = DDP(copy.deepcopy(base), process_group=world_group)
    out["ddp"] = dict(model=ddp, opt=torch.optim.AdamW(ddp.parameters(), **adamw), red=None)
    for comm_dtype in COMM_DTYPES:
        model = copy.deepcopy(base)
        red = GradReducer(model, dp_group=world_group, comm_dtype=comm_dtype,
                          bucket_cap_mb=cap_mb)
        out[f"reducer/{comm_dtype}"] = dict(
            model=model, red=red, opt=torch.optim.AdamW(model.parameters(), **adamw))
    for comm_dtype in COMM_DTYPES:
        model = copy.deepcopy(base)
        red = GradReducer(model, dp_group=world_group, comm_dtype=comm_dtype, shard=True,
                          bucket_cap_mb=cap_mb)
        out[f"sharded/{comm_dtype}"] = dict(
            model=model, red=red, opt=ShardedOptimizer(red, torch.optim.AdamW, **adamw))
    model = copy.deepcopy(base)
    red = GradReducer(model, dp_group=world_group)  # torch DDP's bucket sizes
    out["reducer/fp32, DDP's buckets"] = dict(model=model, red=red,
                                              opt=torch.optim.AdamW(model.parameters(), **adamw))
    model = copy.deepcopy(base)
    red = GradReducer(model, dp_group=world_group, bucket_cap_mb="auto")
    out["reducer/fp32, auto buckets"] = dict(model=model, red=red,
                                             opt=torch.optim.AdamW(model.parameters(), **adamw))
    model = copy.deepcopy(base)
    red = GradReducer(model, dp_group=world_group, bucket_cap_mb=cap_mb)
    out["reducer/fp32, no overlap"] = dict(model=model, red=red, serial=True,
                                           opt=torch.optim.AdamW(model.parameters(), **adamw))
    model = copy.deepcopy(base)
    out["local (no comm)"] = dict(model=model, red=None,
                                  opt=torch.optim.AdamW(model.parameters(), **adamw))
    return out


def _step(v: dict, idx: torch.Tensor, tgt: torch.Tensor) -> None:
    model, opt, red = v["model"], v["opt"], v["red"]
    _, loss = model(idx, tgt)
    if v.get("serial"):
        with red.no_sync():
            loss.backward()
        red.reduce_now()
    else:
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state_bytes(opt) -> int:
    if isinstance(opt, ShardedOptimizer):
        return opt.state_bytes()
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if torch.is_tensor(t))


def _describe_tuning(report: dict) -> str:
    if report.get("frozen"):
        return "layout frozen before the choice"
    return ", ".join(
        f"{'*' if k == report['chosen'] else ''}{c['source']} {c['buckets']}b"
        + ("" if c["seconds"] is None else f" {1e3 * c['seconds']:.1f}")
        for k, c in enumerate(report["candidates"]))


def _bench_rank(cfg: BenchConfig) -> list[dict]:
    rank = dist.get_rank()
    if cfg.device == "cuda":
        device = gpu_for_rank()
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model,
                         n_layer=cfg.n_layer, n_head=cfg.n_head)).to(device)
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=gen).to(device)
    tgt = torch.roll(idx, -1, dims=1)
    sync = _sync(device)
    variants = _variants(base, dist.group.WORLD, cfg.bucket_cap_mb)
    for v in variants.values():
        v["samples"], v["exposed"], v["ag_exposed"] = [], [], []
        for _ in range(cfg.warmup):
            _step(v, idx, tgt)
        while v["red"] is not None and v["red"].tuning:  # "auto": until the buckets are chosen
            _step(v, idx, tgt)
    tracer = Tracer(cfg, rank=rank, device=device, prefix=f"w{dist.get_world_size()}_")
    with tracer.region("rounds"):
        for _ in range(cfg.rounds):
            for name, v in variants.items():
                for _ in range(cfg.steps_per_round):
                    if isinstance(v["opt"], ShardedOptimizer):  # waits of the previous forward
                        v["ag_exposed"].append(v["opt"].forward_wait_s)
                    step = tracer.wrap(name, lambda: _step(v, idx, tgt))
                    v["samples"] += time_fn(step, warmup=0, iters=1, sync=sync).samples
                    if v["red"] is not None and not v.get("serial"):
                        v["exposed"].append(v["red"].stats.wait_s)
    tracer.close()
    rows = []
    for name, v in variants.items():
        comm = []
        if v["red"] is not None:
            if isinstance(v["opt"], ShardedOptimizer):
                v["opt"].wait_params()
            for _ in range(cfg.comm_reps):
                sync()
                comm.append(v["red"].reduce_now())
        timing = Timing(v["samples"])
        med = timing.median
        comm_s = statistics.median(comm) if comm else None
        exposed = statistics.median(v["exposed"]) if v["exposed"] else None
        rows.append(dict(
            variant=name, step_s=med,
            spread=timing.spread,
            comm_s=comm_s, exposed_s=exposed,
            hidden=(max(0.0, 1.0 - exposed / comm_s) if comm_s and exposed is not None
                    else None),
            state_bytes=_state_bytes(v["opt"]),
            ag_exposed_s=statistics.median(v["ag_exposed"]) if v["ag_exposed"] else None,
            num_buckets=len(v["red"].buckets) if v["red"] is not None else None,
            auto_report=v["red"].auto_report if v["red"] is not None else None,
            **tracer.info(name)))
    return rows


def main(cfg: BenchConfig) -> None:
    check_trace_options(cfg, "bench_dp", cuda=cfg.device == "cuda" and torch.cuda.is_available())
    if cfg.nsys and len(cfg.world_sizes) != 1:
        print("bench_dp: error: --nsys: one nsys capture range covers one launch; pass one "
              "--world-sizes value", file=sys.stderr)
        raise SystemExit(2)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    load_before = os.getloadavg()[0]
    table_rows = []
    numel = sum(p.numel() for p in GPT(GPTConfig(
        vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model,
        n_layer=cfg.n_layer, n_head=cfg.n_head)).parameters())
    tuned = []
    for world in cfg.world_sizes:
        rows = launch(_bench_rank, world, args=(cfg,), backend=backend, timeout=3600,
                      preload=["torch._dynamo"])[0]
        ddp_s = next(r["step_s"] for r in rows if r["variant"] == "ddp")
        tuned += [f"{world} ranks: " + _describe_tuning(r["auto_report"]) for r in rows
                  if r["auto_report"] is not None]
        for r in rows:
            table_rows.append(dict(
                world=world, variant=r["variant"], step_ms=1e3 * r["step_s"],
                spread=r["spread"], vs_ddp=ddp_s / r["step_s"],
                comm_ms="-" if r["comm_s"] is None else 1e3 * r["comm_s"],
                exposed_ms="-" if r["exposed_s"] is None else 1e3 * r["exposed_s"],
                hidden="-" if r["hidden"] is None else r["hidden"],
                ag_exposed_ms="-" if r["ag_exposed_s"] is None else 1e3 * r["ag_exposed_s"],
                state_MB=r["state_bytes"] / 2**20,
                buckets="-" if r["num_buckets"] is None else r["num_buckets"],
                **{k: r[k] for k in ("trace_region", "trace_steps") if k in r}))
    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    notes = [
        f"GPT d_model={cfg.d_model} n_layer={cfg.n_layer} n_head={cfg.n_head} "
        f"vocab={cfg.vocab_size} seq_len={cfg.seq_len}, batch {cfg.batch} per rank, "
        f"{numel / 1e6:.2f} M parameters ({4 * numel / 2**20:.1f} MiB of fp32 gradients), "
        f"our buckets {cfg.bucket_cap_mb} MiB (first 1 MiB), "
        f"AdamW; ranks on {cfg.device} ({backend}), 1 compute thread per rank; median of "
        f"{cfg.rounds * cfg.steps_per_round} steps ({cfg.rounds} rounds of "
        f"{cfg.steps_per_round}, variants taking turns) after {cfg.warmup} warm-up; {load} "
        f"(on {os.cpu_count()} cores: other jobs shared the machine when above ~0.5).",
        "vs_ddp: DDP median step / this median step (> 1 is faster than DDP). comm_ms: the "
        "step's gradient collectives run alone; exposed_ms: wait in finish() after the "
        "backward; hidden = 1 - exposed/comm (gradient communication hidden by the backward). "
        "On CPU gloo's reduction threads share the 2 cores with the backward, so hiding comm "
        "also slows the compute it hides under; on GPUs NCCL's waits do not block the host, "
        "so exposed_ms is not measured there (use a profile).",
        "auto buckets (the link model's plan and fixed caps taking turns in warm-up steps, a "
        "settling round then 3 timed ones; slowest rank's median window from the first "
        "gradient hook to the end of the reduction, ms; * chosen): " + "; ".join(tuned),
        "Command: " + command_line("bench.bench_dp", cfg),
    ]
    if cfg.profile or cfg.nsys:
        notes.insert(-1, "trace_overlap% = 100 * hidden / communication time over the "
                     "variant's timed steps on every rank, from " +
                     (f"torch.profiler traces (all threads) in {cfg.profile}/w<world>_rounds/"
                      if cfg.profile else "the Nsight Systems report")
                     + " by overlap-analyze's code; step times of a traced run include the "
                     "profiler's overhead.")
    finish_trace_column(cfg, table_rows, cfg.out, "bench_dp")
    table = Table("Data-parallel step: overlap.dp vs torch DDP",
                  trace_columns(["world", "variant", "step_ms", "spread", "vs_ddp", "comm_ms",
                                 "exposed_ms", "hidden", "ag_exposed_ms", "state_MB",
                                 "buckets"], cfg, after="hidden"), notes=notes)
    for row in table_rows:
        table.add(**row)
    table.publish(cfg.out)


if __name__ == "__main__":
    main(parse_config(BenchConfig, __doc__.splitlines()[0]))
