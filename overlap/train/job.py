"""The main job's state on one rank: ``Job``, with named fields and the methods that act on it.

``Job.build`` makes, from the library's public API only: the model (parallelized with the GPT
plan, CP and EP where set), this rank's pipeline chunks and schedule, one ``GradReducer`` and
one optimizer per reducer group, the offloader. ``step`` runs one optimizer step and returns
the record every rank agrees on; ``clip`` scales the gradient to a global norm; ``save`` and
``resume`` write and load checkpoints (``resume`` also after a restart: which attempt this is
and where the fault left the job is elastic's side, ``attempt_number`` and ``fault_time``).
``close`` frees every communicator, in any state.

Contract: the gradient is that of the mean loss over every sequence of the step (micro-batch
losses scaled by 1/m, the DP reduction averaged over dp x cp). The narrative:
docs/design/training.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from overlap.cp import CPComm, zigzag_shard
from overlap.dist.device import rank_device
from overlap.dist.dims import ParallelDims
from overlap.dp.grad_reducer import GradReducer
from overlap.dp.sharded_optimizer import ShardedOptimizer
from overlap.memory import ActivationOffloader
from overlap.models.gpt import GPT, Block, GPTConfig, MoEMLP
from overlap.models.tp_plans import gpt_plan
from overlap.moe import EPComm, split_expert_parameters
from overlap.moe.experts import SwiGLUExperts
from overlap.nn.embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy
from overlap.nn.layers import TPModule
from overlap.nn.parallelize import parallelize
from overlap.pp import Pipeline, PipelineSchedule, PipelineStage, build_schedule, pipeline_stages
from overlap.profile import nvtx
from overlap.profile.timers import comm_wait, exposed_seconds, reset_exposed
from overlap.tp import TPComm
from overlap.train.config import VOCAB_SIZE, TrainConfig, agree_across_ranks
from overlap.train.precision import MasterOptimizer, grad_of
from overlap.train.recompute import apply_recompute
from overlap.train.rng import RNGTracker, install_dropout

__all__ = ["Job", "Resumed", "StepRecord", "model_config", "tp_comm_for", "lr_at",
           "param_groups", "attempt_number", "fault_time", "cp_share"]


@dataclasses.dataclass(slots=True)
class StepRecord:
    step: int
    loss: float
    step_s: float          # slowest rank's step time
    tokens_per_s: float
    exposed_fraction: float  # mean over ranks of (blocked-in-communication time / step time)
    ep_exposed_s: float = 0.0  # mean over ranks of the time blocked in EP all-to-alls
    offload_exposed_s: float = 0.0  # mean over ranks of the time waiting for reloads
    grad_norm: float = 0.0   # global L2 norm of the gradient before clipping (0: not computed)
    lr: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Resumed:
    """Where ``Job.resume`` left the job: the first step to run, the checkpoint loaded (None:
    from scratch), the time of the fault this attempt follows, and the writer's layout."""
    step: int = 0
    path: str | None = None
    fault_s: float | None = None
    layout: dict | None = None


def model_config(cfg: TrainConfig, *, dropout: float | None = None,
                 reference: bool = False) -> GPTConfig:
    # MoE blocks route each sequence in tp groups, as tp sequence-parallel ranks do, so one
    # process makes the same capacity decisions as the sharded job. With context parallelism
    # a rank routes its zig-zag tokens in tp groups; the one-process reference (``reference``)
    # routes the whole sequence in cp x tp groups of the same tokens.
    cp = cfg.cp if reference else 1
    return GPTConfig(vocab_size=VOCAB_SIZE, seq_len=cfg.seq_len, d_model=cfg.d_model,
                     n_layer=cfg.n_layer, n_head=cfg.n_head,
                     dropout=cfg.dropout if dropout is None else dropout,
                     moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k,
                     moe_every=cfg.moe_every, moe_shared=cfg.moe_shared_experts,
                     capacity_factor=cfg.capacity_factor or None,
                     moe_token_groups=cfg.tp * cp, moe_token_zigzag=cp,
                     moe_aux_coef=cfg.moe_aux_coef)


def moe_mlps(model: torch.nn.Module) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over ``warmup_steps`` then constant or cosine decay to
    ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    low = cfg.lr * cfg.min_lr_ratio
    return low + (cfg.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def no_decay(name: str, p: torch.Tensor, module: torch.nn.Module) -> bool:
    """Norms, biases (1-D) and embedding tables get no weight decay."""
    return p.dim() < 2 or isinstance(module, (torch.nn.Embedding, VocabParallelEmbedding))


def param_groups(model: torch.nn.Module, params, weight_decay: float) -> list[dict]:
    """Two AdamW groups over ``params`` (a subset of ``model``'s): decayed matrices and the
    rest with weight_decay 0."""
    wanted = {id(p) for p in params}
    decay, rest = [], []
    for mod_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in wanted:
                (rest if no_decay(name, p, module) else decay).append(p)
                wanted.discard(id(p))
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def tp_comm_for(cfg: TrainConfig, dims: ParallelDims, device: torch.device) -> TPComm:
    """The job's one TP communicator: it carries the TP backend and ``cfg.timeout`` to every
    TP wait (fused-op signals and collectives, region collectives). Collective over TP."""
    return TPComm(dims.tp_group, backend=cfg.tp_backend, timeout=cfg.timeout, device=device)


def cp_share(tokens: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """This CP rank's zig-zag piece of the last (sequence) dim; the whole of it without CP."""
    if dims.cp == 1:
        return tokens
    return zigzag_shard(tokens, tokens.dim() - 1, cp=dims.cp, rank=dims.cp_rank)


# This rank's attempt: elastic (or torchrun) restarts the ranks and says which attempt this is;
# the injected fault of the fault-tolerance tests and the grow request end one.

def attempt_number() -> int:
    """0 on the first run; k on the k-th restart (ours or torchrun's)."""
    return int(os.environ.get("OVERLAP_RESTART_ATTEMPT",
                              os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def fault_time(cfg: TrainConfig) -> float | None:
    """When the fault this attempt follows happened (written by the rank that died, or the
    heartbeat that saw it), if known."""
    if not cfg.save:
        return None
    try:
        with open(os.path.join(cfg.save, "fault_time")) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def inject_fault(cfg: TrainConfig) -> None:
    """Fault injection (hidden --kill-rank or --kill-node, with --kill-at-step): note the
    time, then SIGKILL."""
    rank = dist.get_rank()
    if cfg.kill_rank != rank and cfg.kill_node != rank // cfg.node_size:
        return
    if cfg.save:
        with open(os.path.join(cfg.save, "fault_time"), "w") as f:
            f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def grow_requested(path: str, device: torch.device) -> bool:
    """Did the launcher ask to stop for a grow? Rank 0 looks; every rank gets its answer."""
    flag = torch.tensor([float(dist.get_rank() == 0 and os.path.exists(path))], device=device)
    with comm_wait("train.grow"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@dataclasses.dataclass(eq=False)
class Job:
    """One rank's training job. Build it with ``Job.build``; ``close`` it (or use ``with``)."""

    cfg: TrainConfig
    dims: ParallelDims
    device: torch.device
    model: GPT
    tp_comm: TPComm
    tracker: RNGTracker
    stages: list[PipelineStage]
    schedule: PipelineSchedule
    pipe: Pipeline
    reducers: list[GradReducer]
    optimizers: list[Any]
    replicated: list[list[bool]]  # per reducer, per parameter: replicated over TP?
    overlap: bool
    ep_comm: EPComm | None = None
    cp_comm: CPComm | None = None
    offloader: ActivationOffloader | None = None

    @classmethod
    def build(cls, cfg: TrainConfig, dims: ParallelDims, device: torch.device,
              dtype: torch.dtype, *, overlap: bool = True, ep_pairs: bool = True) -> Job:
        """Model, TP communicator, pipeline, reducers and optimizers of one job on this rank.
        ``overlap=False`` builds the no-overlap baseline of ``--compare-no-overlap``: the
        unfused TP backend (whole collective, then the GEMM), every DP bucket reduced after
        the backward, and (in ``step``) the parameter all-gathers waited for at once instead
        of under the next forward. ``ep_pairs=False``: no in-schedule EP pairs."""
        if not overlap:
            cfg = dataclasses.replace(cfg, tp_backend="unfused")
        torch.manual_seed(cfg.seed)
        ep_comm = _ep_comm(cfg, dims, overlap)
        cp_comm = (CPComm(dims.cp_group, timeout=cfg.timeout, device=device)
                   if cfg.cp > 1 else None)
        model = GPT(model_config(cfg), ep_comm=ep_comm).to(device=device, dtype=dtype)
        tp_comm = tp_comm_for(cfg, dims, device)
        moe_blocks = tuple(i for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoEMLP))
        plan = gpt_plan(loss_parallel=True, dense_mlp=len(moe_blocks) < cfg.n_layer,
                        sp_moe_blocks=moe_blocks if cfg.sequence_parallel else ())
        parallelize(model, comm=tp_comm, plan=plan, sequence_parallel=cfg.sequence_parallel)
        if cp_comm is not None:  # after parallelize: its probe runs whole sequences
            model.context_parallel(cp_comm, method=cfg.cp_method)
        for mlp in moe_mlps(model):
            mlp.aux_scale = 1.0 / cfg.micro_batches  # the pipeline's scale of each loss
        tracker = RNGTracker(seed=cfg.seed, tp_rank=dims.tp_rank, pp_rank=dims.pp_rank,
                             dp_rank=dims.dp_rank)
        if cfg.dropout > 0:
            install_dropout(model, tracker, sequence_parallel=cfg.sequence_parallel)
        if cfg.recompute != "none":
            apply_recompute(model, cfg.recompute, tracker=tracker)
        num_virtual = cfg.virtual_stages if cfg.schedule == "interleaved" else 1
        stages = pipeline_stages(model, pp_group=dims.pp_group, num_virtual=num_virtual)
        schedule = build_schedule(cfg.schedule, pp_size=cfg.pp,
                                  num_microbatches=cfg.micro_batches, num_virtual=num_virtual)

        def loss_fn(logits_shard_v: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits_shard_v.float(), targets, comm=tp_comm)

        # Forward/backward pairs whose EP all-to-alls hide under each other's compute: with
        # the chunked exchange (the symmetric one is single-buffered), off in the no-overlap
        # baselines.
        pairs = (ep_comm is not None and ep_comm.pairable and cfg.ep_pipeline_overlap
                 and overlap and ep_pairs)
        pipe = Pipeline(stages, schedule, loss_fn=loss_fn, pp_group=dims.pp_group,
                        timeout=cfg.timeout, ep_comms=[ep_comm] if pairs else [])
        reducers, optimizers = [], []
        for stage, group, params, divisor in _reduction_groups(cfg, dims, stages):
            # rebuild_buckets=False: the bucket layout is fixed from the start, so a resumed
            # run (whose optimizer state is laid out over it) reduces exactly as the
            # uninterrupted one
            red = GradReducer(stage.module, dp_group=group, params=params, divisor=divisor,
                              comm_dtype=cfg.comm_dtype,
                              bucket_cap_mb=cfg.bucket_mb, first_bucket_cap_mb=cfg.bucket_mb,
                              shard=cfg.sharded_optimizer, timeout=cfg.timeout,
                              rebuild_buckets=False, overlap=overlap, **_grad_dtype_option(cfg))
            red.sync_if(lambda s=stage: s.last_backward)
            reducers.append(red)
            groups = param_groups(model, red.params, cfg.weight_decay)
            if cfg.sharded_optimizer:  # fp32 masters of this rank's shard
                optimizers.append(ShardedOptimizer(red, torch.optim.AdamW, param_groups=groups,
                                                   lr=cfg.lr, eps=cfg.adam_eps))
            elif dtype != torch.float32:  # fp32 masters of every parameter, from main_grad
                optimizers.append(MasterOptimizer(groups, torch.optim.AdamW, lr=cfg.lr,
                                                  eps=cfg.adam_eps))
            else:
                optimizers.append(torch.optim.AdamW(groups, lr=cfg.lr, eps=cfg.adam_eps))
        return cls(cfg=cfg, dims=dims, device=device, model=model, tp_comm=tp_comm,
                   tracker=tracker, stages=stages, schedule=schedule, pipe=pipe,
                   reducers=reducers, optimizers=optimizers,
                   replicated=_tp_replicated(model, reducers), overlap=overlap,
                   ep_comm=ep_comm, cp_comm=cp_comm, offloader=_offloader(cfg, stages, device))

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self, step: int, x: list[torch.Tensor], y: list[torch.Tensor],
             lr: float) -> StepRecord:
        """One optimizer step on this rank's micro-batches ``x``/``y`` (used where this rank
        holds the first/last stage); every rank returns the same record."""
        cfg, dims = self.cfg, self.dims
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        has_first = 0 in self.pipe.stages
        has_last = self.schedule.num_stages - 1 in self.pipe.stages
        reset_exposed()
        t0 = time.perf_counter()
        with nvtx.step(step):  # NVTX on CUDA (nsys sees it), record_function everywhere
            out = self.pipe.step(x if has_first else None, y if has_last else None)
            norm = self.clip(cfg.clip_grad) if cfg.clip_grad > 0 else None
            for opt in self.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=False)
                if not self.overlap and hasattr(opt, "wait_params"):
                    opt.wait_params()  # no parameter-gather prefetch under the next forward
        step_s = time.perf_counter() - t0
        exposed, ep_exposed = exposed_seconds(), exposed_seconds("ep")
        off_exposed = exposed_seconds("offload")
        loss = float(out.loss) if has_last and dims.tp_rank == 0 else 0.0
        # One small collective gathers what rank 0 reports: loss (from the last stage,
        # averaged over dp x cp: each CP rank's is the mean over its equal share of the
        # tokens), the mean exposed fraction, EP and offload waits, and the slowest step time.
        world = dist.get_world_size()
        stats = torch.tensor([loss / (cfg.dp * cfg.cp), exposed / step_s / world,
                              ep_exposed / world, off_exposed / world, step_s],
                             dtype=torch.float64, device=self.device)
        sums = stats[:4].clone()
        with comm_wait("train.stats"):
            dist.all_reduce(sums)
            slowest = stats[4:].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        tokens_per_step = cfg.dp * cfg.micro_batches * cfg.micro_batch_size * cfg.seq_len
        return StepRecord(step=step, loss=float(sums[0]), step_s=float(slowest[0]),
                          tokens_per_s=tokens_per_step / float(slowest[0]),
                          exposed_fraction=min(max(float(sums[1]), 0.0), 1.0),
                          ep_exposed_s=float(sums[2]), offload_exposed_s=float(sums[3]),
                          grad_norm=float(norm) if norm is not None else 0.0, lr=lr)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by ``min(1, max_norm / (||g|| + 1e-6))`` (torch's
        ``clip_grad_norm_``), ``||g||`` the L2 norm of the whole model's gradient: each element
        counted once, i.e. on one rank of its reducer's group (the one owning its ZeRO shard,
        else the group's rank 0: DP for dense parameters, expert-DP for experts) and, for
        TP-replicated parameters, on TP rank 0 only; summed over every rank. Returns the norm.
        Reads (and scales) the fp32 main grads where the reducer keeps them (bf16)."""
        sharded = self.cfg.sharded_optimizer
        total = torch.zeros((), dtype=torch.float32)
        tp0 = self.dims.tp_rank == 0
        for opt, red, rep in zip(self.optimizers, self.reducers, self.replicated):
            weights = [0.0 if (r and not tp0) else 1.0 for r in rep]
            if sharded:
                total += opt.grad_norm_sq(weights)
            elif red.dp_rank == 0:
                red.finish()
                for w, p in zip(weights, red.params):
                    g = grad_of(p)  # the fp32 main grad in bf16 training
                    if w and g is not None:
                        g = g.float()
                        total += torch.dot(g.flatten(), g.flatten())
        with comm_wait("train.clip"):
            dist.all_reduce(total)
        norm = total.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for opt, red in zip(self.optimizers, self.reducers):
            if sharded:
                opt.scale_grads_(coef)
            else:
                for p in red.params:
                    g = grad_of(p)
                    if g is not None:
                        g.mul_(coef.to(g.dtype))
        return norm

    def checkpoint_state(self) -> dict:
        """What a checkpoint holds of this rank (the parameters gathered first)."""
        from overlap.train.checkpoint import build_state  # 0.4 s of import: only when saving

        for opt in self.optimizers:
            if hasattr(opt, "wait_params"):
                opt.wait_params()
        return build_state(model=self.model, stages=list(self.stages),
                           optimizers=self.optimizers, sharded=self.cfg.sharded_optimizer)

    def save(self, writer, done: int) -> None:
        """Checkpoint after ``done`` steps through ``writer`` (a ``CheckpointWriter``)."""
        cfg = self.cfg
        meta = {"step": done, "tp": cfg.tp, "cp": cfg.cp, "pp": cfg.pp, "dp": cfg.dp,
                "seed": cfg.seed,
                "schedule": cfg.schedule, "virtual_stages": cfg.virtual_stages,
                "sharded_optimizer": cfg.sharded_optimizer, "dtype": cfg.dtype,
                "global_batch": cfg.dp * cfg.micro_batches * cfg.micro_batch_size,
                "model": dataclasses.asdict(model_config(cfg)), "rng": self.tracker.state()}
        writer.save(self.checkpoint_state(), meta, done)

    def resume(self) -> Resumed:
        """Load the checkpoint to continue from, if any: after a restart the latest complete
        one under --save, else --resume (a checkpoint of another layout is resharded)."""
        cfg, dims = self.cfg, self.dims
        path, fault_s = None, None
        if cfg.save or cfg.resume:  # torch.distributed.checkpoint: 0.4 s of import
            from overlap.train.checkpoint import latest_checkpoint, load, read_meta

            if attempt_number() > 0 and cfg.save:
                path, fault_s = latest_checkpoint(cfg.save), fault_time(cfg)
            if path is None and cfg.resume:
                path = latest_checkpoint(cfg.resume)
        # Each rank lists the directory itself (a node's own mount, an NFS cache): every rank
        # must load the same step, or the ranks would train on from different states.
        agree_across_ranks("overlap-train: the checkpoint to resume from", {
            "step directory": None if path is None else os.path.basename(os.path.normpath(path))},
            rank_device())
        if path is None:  # a fault before the first checkpoint was complete: start over
            return Resumed(fault_s=fault_s)
        meta = read_meta(path)
        state = self.checkpoint_state()
        same = _layout_key(meta) == _layout_key(cfg)
        other_dtype = meta.get("dtype", "fp32") != cfg.dtype
        if other_dtype:
            # The fp32 masters are the truth: load them (and the moments) only, and derive the
            # parameters from them in this run's dtype (without the sharded optimizer in fp32
            # the parameters are their own masters and load as such).
            state = {"optim": state["optim"]}
        blob = load(path, state, rng_key=f"rank{dist.get_rank()}" if same else None)
        if other_dtype:
            for opt in self.optimizers:
                if hasattr(opt, "publish_masters"):  # ShardedOptimizer's is collective over DP
                    opt.publish_masters()
        step_t = state["optim"]["step"]
        for opt in self.optimizers:
            if cfg.sharded_optimizer:
                opt.set_scalar_state({"step": step_t})
            else:
                for group in opt.param_groups:
                    for p in group["params"]:
                        opt.state[p]["step"].copy_(step_t)
        if same:
            self.tracker.load_state(blob)
        else:  # another layout draws other masks anyway: a fresh stream per step resumed at
            torch.manual_seed(cfg.seed * 1_000_003 + 7919 * dims.pp_rank
                              + 104_729 * dims.dp_rank + 1 + 31 * meta["step"])
        batch = cfg.dp * cfg.micro_batches * cfg.micro_batch_size
        if dist.get_rank() == 0 and meta.get("global_batch") != batch:
            print(f"overlap-train: warning: the checkpoint's global batch is "
                  f"{meta.get('global_batch')} sequences, this run's {batch}: the data order "
                  "differs from the original run", flush=True)
        return Resumed(int(meta["step"]), path, fault_s, _saved_layout(meta))

    def close(self) -> None:
        """Close the optimizers, reducers and communicators (each in any state)."""
        for opt in self.optimizers:
            if hasattr(opt, "close"):
                opt.close()
        for red in self.reducers:
            red.close()
        self.tp_comm.close()
        for c in (self.ep_comm, self.cp_comm, self.offloader):
            if c is not None:
                c.close()


def _ep_comm(cfg: TrainConfig, dims: ParallelDims, overlap: bool) -> EPComm | None:
    """The job's EPComm (None without expert parallelism): chunked pieces (the sequential
    exchange for the no-overlap baseline) or the symmetric buffers, sized for one MoE call's
    tokens (a micro-batch's, divided over the TP ranks)."""
    if not cfg.moe_experts or cfg.ep == 1:
        return None
    extra = {}
    if cfg.ep_backend == "symmetric":
        extra["max_tokens"] = cfg.micro_batch_size * cfg.seq_len // (cfg.tp * cfg.cp)
        # a forward and a backward in flight at once (the pipeline's pairs): two workspaces
        extra["lanes"] = 2 if overlap and cfg.ep_pipeline_overlap else 1
    return EPComm(dims.ep_group, backend=cfg.ep_backend, chunks=2 if overlap else 1,
                  timeout=cfg.timeout, **extra)


def _offloader(cfg: TrainConfig, stages, device: torch.device) -> ActivationOffloader | None:
    """--offload-activations: the first N blocks of every pipeline chunk offload what they
    save (after recomputation's wrappers: a checkpointed block offloads its inputs)."""
    if cfg.offload_activations == "none":
        return None
    off = ActivationOffloader(device, timeout=cfg.timeout)
    for stage in stages:
        blocks = [m for m in stage.module.modules() if isinstance(m, Block)]
        n = cfg.offload_blocks(len(blocks))
        if n:
            off.wrap(blocks, keep_last=len(blocks) - n)
    return off


def _reduction_groups(cfg: TrainConfig, dims: ParallelDims, stages):
    """(stage, group, params, divisor) per reducer: every parameter of a stage over DP x CP
    (the dcp group; each CP rank's loss is the mean over its share of the tokens, so the
    average over dp x cp is the mean over the step); with expert parallelism the experts
    apart, over the expert-DP group (the ranks holding the same experts), divided by dp x cp
    like the rest (their local gradient already sums the tokens of the whole EP group)."""
    for stage in stages:
        if cfg.ep == 1 or not cfg.moe_experts:
            yield stage, dims.dcp_group, None, None
            continue
        dense, expert = split_expert_parameters(stage.module)
        if dense:
            yield stage, dims.dcp_group, dense, None
        if expert:
            yield stage, dims.edp_group, expert, cfg.dp * cfg.cp


def _grad_dtype_option(cfg: TrainConfig) -> dict:
    """bf16: fp32 gradient buffers in the reducer (Megatron's main_grad): accumulation over
    the micro-batches and the DP reduction run in fp32 (or the lossy ``comm_dtype``)."""
    return {"grad_dtype": torch.float32} if cfg.dtype == "bf16" else {}


def _tp_replicated(model: GPT, reducers: list[GradReducer]) -> list[list[bool]]:
    """Per reducer, per parameter: is it replicated over TP (a norm, the position table, an
    expert: experts shard over EP, never over TP)?"""
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    out = []
    for red in reducers:
        flags = []
        for p in red.params:
            owner = owners[id(p)]
            name = next(n for n, q in owner.named_parameters(recurse=False) if q is p)
            spec = owner.shard_specs.get(name) if isinstance(owner, TPModule) else None
            flags.append(isinstance(owner, SwiGLUExperts) or spec is None or spec.dim is None)
        out.append(flags)
    return out


def _layout_key(meta_or_cfg) -> tuple:
    g = (lambda k: meta_or_cfg.get(k, 1 if k == "cp" else None)) \
        if isinstance(meta_or_cfg, dict) else (lambda k: getattr(meta_or_cfg, k))
    return tuple(g(k) for k in ("tp", "cp", "pp", "dp", "schedule", "virtual_stages",
                                "sharded_optimizer"))


def _saved_layout(meta: dict) -> dict:
    """The degrees and global batch of the run that wrote a checkpoint (its meta)."""
    return {k: meta.get(k, 1 if k == "cp" else None) for k in ("tp", "cp", "pp", "dp",
                                                               "global_batch")}
