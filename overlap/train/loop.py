"""One rank of the 3D-parallel training job, and the single-process reference it is checked
against.

Per rank, in order (every piece is the library's public API, nothing demo-specific):

1. ``ParallelDims.build(tp, pp, dp)``: the process groups (TP innermost).
2. The same-seed ``GPT`` on every rank, then ``parallelize`` with the GPT plan: sequence-parallel
   TP layers over the fused ops (``tp_backend``), vocab-parallel head and loss.
3. ``pipeline_stages`` + ``build_schedule`` + ``Pipeline``: this rank's chunks and a validated
   1F1B (or other) schedule whose P2P transfers overlap compute.
4. One ``GradReducer`` per stage over the DP group, synchronising only on the stage's last
   gradient-accumulating action of the step (``stage.last_backward``), so the DP reduction of a
   stage runs under the backward of the micro-batches and stages still in flight; with
   ``sharded_optimizer`` a ``ShardedOptimizer`` (ZeRO-1/2) per stage, else AdamW.

The micro-batch losses are averaged (each scaled by 1/m in the pipeline) and the DP reduction
averages over dp, so the gradient is that of the mean loss over every sequence of the step:
exactly what ``reference_losses`` computes on one process.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from overlap.dist.device import rank_device
from overlap.models.gpt import GPT, GPTConfig, gpt_loss
from overlap.profile.timers import comm_wait, exposed_seconds, reset_exposed
from overlap.train.config import VOCAB_SIZE, TrainConfig
from overlap.train.data import Batches, load_tokens

__all__ = ["train_rank", "tp_comm_for", "reference_losses", "StepRecord", "model_config"]

PROFILED_STEPS = 3
_SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b",
                   "zb-h1": "zb_h1"}


@dataclasses.dataclass(slots=True)
class StepRecord:
    step: int
    loss: float
    step_s: float          # slowest rank's step time
    tokens_per_s: float
    exposed_fraction: float  # mean over ranks of (blocked-in-communication time / step time)


def model_config(cfg: TrainConfig) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB_SIZE, seq_len=cfg.seq_len, d_model=cfg.d_model,
                     n_layer=cfg.n_layer, n_head=cfg.n_head)


def tp_comm_for(cfg: TrainConfig, dims, device: torch.device):
    """The job's one TP communicator: it carries the TP backend and ``cfg.timeout`` to every
    TP wait (fused-op signals and collectives, region collectives). Collective over TP."""
    from overlap.tp import TPComm

    return TPComm(dims.tp_group, backend=cfg.tp_backend, timeout=cfg.timeout, device=device)


def train_rank(cfg: TrainConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train on this rank (the default process group must be initialised with
    tp*pp*dp ranks). Returns the per-step records (identical on every rank) and, with
    ``cfg.profile``, the path of this rank's trace."""
    from overlap.dist.dims import ParallelDims
    from overlap.dp.grad_reducer import GradReducer
    from overlap.dp.sharded_optimizer import ShardedOptimizer
    from overlap.pp import Pipeline, build_schedule, pipeline_stages
    from overlap.tp import close_all_contexts
    from overlap.nn.embedding import vocab_parallel_cross_entropy
    from overlap.nn.parallelize import parallelize
    from overlap.models.plans import gpt_plan

    device = rank_device()
    dims = ParallelDims.build(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, device_type=device.type)
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg)).to(device)
    tp_comm = tp_comm_for(cfg, dims, device)
    parallelize(model, comm=tp_comm, plan=gpt_plan(loss_parallel=True),
                sequence_parallel=cfg.sequence_parallel)
    num_virtual = cfg.virtual_stages if cfg.schedule == "interleaved" else 1
    stages = pipeline_stages(model, pp_group=dims.pp_group, num_virtual=num_virtual)
    schedule = build_schedule(_SCHEDULE_NAMES[cfg.schedule], pp_size=cfg.pp,
                              num_microbatches=cfg.micro_batches, num_virtual=num_virtual)

    def loss_fn(logits_shard_v: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard_v, targets, tp_group=dims.tp_group)

    pipe = Pipeline(stages, schedule, loss_fn=loss_fn, pp_group=dims.pp_group,
                    timeout=cfg.timeout)
    reducers, optimizers = [], []
    for stage in stages:
        red = GradReducer(stage.module, dp_group=dims.dp_group, comm_dtype=cfg.comm_dtype,
                          bucket_cap_mb=cfg.bucket_mb, first_bucket_cap_mb=cfg.bucket_mb,
                          shard=cfg.sharded_optimizer, timeout=cfg.timeout)
        red.sync_if(lambda s=stage: s.last_backward)
        reducers.append(red)
        kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
        if cfg.sharded_optimizer:
            optimizers.append(ShardedOptimizer(red, torch.optim.AdamW, **kwargs))
        else:
            optimizers.append(torch.optim.AdamW(stage.module.parameters(), **kwargs))

    batches = Batches(load_tokens(cfg.data), seq_len=cfg.seq_len,
                      micro_batch_size=cfg.micro_batch_size, micro_batches=cfg.micro_batches,
                      dp=cfg.dp, seed=cfg.seed)
    has_first = 0 in pipe.stages
    has_last = schedule.num_stages - 1 in pipe.stages
    report_loss = has_last and dims.tp_rank == 0
    tokens_per_step = cfg.dp * cfg.micro_batches * cfg.micro_batch_size * cfg.seq_len
    world = dist.get_world_size()
    printer = dist.get_rank() == 0 and progress
    records: list[StepRecord] = []
    prof, trace_path = _profiler(cfg, dims)
    # Trace only the last PROFILED_STEPS steps: step 0 pays for warm-up, and a trace of every
    # step of a long run is hundreds of MB per rank.
    first_traced = max(1 if cfg.steps > 1 else 0, cfg.steps - PROFILED_STEPS)
    try:
        for step in range(cfg.steps):
            if prof is not None and step == first_traced:
                prof.start()
            inputs, targets = batches.step(step)
            # (micro_batches, mbs, seq) -> a list of (mbs, seq) micro-batches
            x = list(inputs[dims.dp_rank].to(device).unbind(0))
            y = list(targets[dims.dp_rank].to(device).unbind(0))
            reset_exposed()
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"step:{step}"):
                out = pipe.step(x if has_first else None, y if has_last else None)
                for opt in optimizers:
                    opt.step()
                    opt.zero_grad(set_to_none=False)
            step_s = time.perf_counter() - t0
            exposed = exposed_seconds()
            loss = float(out.loss) if report_loss else 0.0
            # One small collective gathers what rank 0 reports: loss (from the last stage,
            # averaged over dp), the mean exposed fraction and the slowest step time.
            stats = torch.tensor([loss / cfg.dp, exposed / step_s / world, step_s],
                                 dtype=torch.float64, device=device)
            sums = stats[:2].clone()
            with comm_wait("train.stats"):
                dist.all_reduce(sums)
                slowest = stats[2:].clone()
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rec = StepRecord(step=step, loss=float(sums[0]), step_s=float(slowest[0]),
                             tokens_per_s=tokens_per_step / float(slowest[0]),
                             exposed_fraction=min(max(float(sums[1]), 0.0), 1.0))
            records.append(rec)
            if printer:
                print(_row(rec, cfg.steps), flush=True)
        if prof is not None:
            prof.stop()
            prof.export_chrome_trace(trace_path)
    finally:
        for opt in optimizers:
            if hasattr(opt, "close"):
                opt.close()
        for red in reducers:
            red.close()
        tp_comm.close()
        close_all_contexts()
    return {"records": [dataclasses.asdict(r) for r in records],
            "trace": trace_path if prof is not None else None}


def _profiler(cfg: TrainConfig, dims) -> tuple[Any, str | None]:
    if not cfg.profile:
        return None, None
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(cfg.profile, exist_ok=True)
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    return profile(activities=acts), os.path.join(cfg.profile, f"trace_rank{dist.get_rank()}.json")


def _row(rec: StepRecord, steps: int) -> str:
    done = rec.step + 1
    width = 20
    bar = "#" * (width * done // steps) + "." * (width - width * done // steps)
    return (f"step {done:>4}/{steps} [{bar}] loss {rec.loss:8.4f}  tok/s {rec.tokens_per_s:9.0f}"
            f"  step {rec.step_s * 1e3:7.1f} ms  exposed comm {100 * rec.exposed_fraction:5.1f}%")


def reference_losses(cfg: TrainConfig) -> list[float]:
    """The same training on one process: the same init, data and optimizer, no parallelism.

    Each step averages the per-micro-batch mean losses of all dp x micro_batches micro-batches
    (what the 3D job's pipeline and DP averaging compute) and takes one AdamW step."""
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = Batches(load_tokens(cfg.data), seq_len=cfg.seq_len,
                      micro_batch_size=cfg.micro_batch_size, micro_batches=cfg.micro_batches,
                      dp=cfg.dp, seed=cfg.seed)
    n = cfg.dp * cfg.micro_batches
    losses = []
    for step in range(cfg.steps):
        inputs, targets = batches.step(step)
        total = 0.0
        for x, y in zip(inputs.flatten(0, 1), targets.flatten(0, 1)):
            loss = gpt_loss(model(x), y) / n
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses
