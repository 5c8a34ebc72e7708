"""One rank of the 3D-parallel training job, and the single-process reference it is checked
against.

``train_rank(cfg)`` builds, with the library's public API only: the process groups
(``ParallelDims``, TP innermost), the same-seed ``GPT`` parallelized with the GPT plan, this
rank's pipeline chunks and a validated schedule, one ``GradReducer`` (and a ``ShardedOptimizer``
or AdamW) per stage, and the training features of ``overlap.train``.

Contract: the gradient is that of the mean loss over every sequence of the step (micro-batch
losses scaled by 1/m, the DP reduction averaged over dp x cp): exactly what ``reference_losses``
computes on one process.

The narrative: docs/design/training.md.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
import math
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from overlap.dist.device import placement, rank_device, sharing_note
from overlap.models.gpt import GPT, GPTConfig, MoEMLP, gpt_loss
from overlap.profile import nvtx
from overlap.profile.timers import comm_wait, exposed_seconds, reset_exposed
from overlap.train.config import VOCAB_SIZE, TrainConfig, agree_across_ranks, shared_settings
from overlap.train.data import Batches, load_tokens
from overlap.train.events import log_event
from overlap.train.shrink import layout_dict

__all__ = ["train_rank", "tp_comm_for", "reference_losses", "StepRecord", "model_config",
           "lr_at", "param_groups", "attempt_number"]

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
    ep_exposed_s: float = 0.0  # mean over ranks of the time blocked in EP all-to-alls
    offload_exposed_s: float = 0.0  # mean over ranks of the time waiting for reloads
    grad_norm: float = 0.0   # global L2 norm of the gradient before clipping (0: not computed)
    lr: float = 0.0


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


def _moe_mlps(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def _ep_comm(cfg: TrainConfig, dims, overlap: bool):
    """The job's EPComm (None without expert parallelism): chunked pieces (the sequential
    exchange for the no-overlap baseline) or the symmetric buffers, sized for one MoE call's
    tokens (a micro-batch's, divided over the TP ranks)."""
    if not cfg.moe_experts or cfg.ep == 1:
        return None
    from overlap.moe import EPComm

    extra = {}
    if cfg.ep_backend == "symmetric":
        extra["max_tokens"] = cfg.micro_batch_size * cfg.seq_len // (cfg.tp * cfg.cp)
        # a forward and a backward in flight at once (the pipeline's pairs): two workspaces
        extra["lanes"] = 2 if overlap and cfg.ep_pipeline_overlap else 1
    return EPComm(dims.ep_group, backend=cfg.ep_backend, chunks=2 if overlap else 1,
                  timeout=cfg.timeout, **extra)


def attempt_number() -> int:
    """0 on the first run; k on the k-th restart (ours or torchrun's)."""
    return int(os.environ.get("OVERLAP_RESTART_ATTEMPT",
                              os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


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
    from overlap.nn.embedding import VocabParallelEmbedding

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


def tp_comm_for(cfg: TrainConfig, dims, device: torch.device):
    """The job's one TP communicator: it carries the TP backend and ``cfg.timeout`` to every
    TP wait (fused-op signals and collectives, region collectives). Collective over TP."""
    from overlap.tp import TPComm

    return TPComm(dims.tp_group, backend=cfg.tp_backend, timeout=cfg.timeout, device=device)


def _build(cfg: TrainConfig, dims, device: torch.device, dtype: torch.dtype, *,
           overlap: bool = True, ep_pairs: bool = True) -> SimpleNamespace:
    """Model, TP communicator, pipeline, reducers and optimizers of one job on this rank.
    ``overlap=False`` builds the no-overlap baseline of ``--compare-no-overlap``: the unfused
    TP backend (whole collective, then the GEMM), every DP bucket reduced after the backward,
    and (in the step) the parameter all-gathers waited for at once instead of under the next
    forward."""
    from overlap.dp.grad_reducer import GradReducer
    from overlap.dp.sharded_optimizer import ShardedOptimizer
    from overlap.pp import Pipeline, build_schedule, pipeline_stages
    from overlap.nn.embedding import vocab_parallel_cross_entropy
    from overlap.nn.parallelize import parallelize
    from overlap.models.tp_plans import gpt_plan
    from overlap.train.precision import MasterOptimizer
    from overlap.train.rng import RNGTracker, install_dropout
    from overlap.train.recompute import apply_recompute

    if not overlap:
        cfg = dataclasses.replace(cfg, tp_backend="unfused")
    torch.manual_seed(cfg.seed)
    ep_comm = _ep_comm(cfg, dims, overlap)
    cp_comm = None
    if cfg.cp > 1:
        from overlap.cp import CPComm

        cp_comm = CPComm(dims.cp_group, timeout=cfg.timeout, device=device)
    model = GPT(model_config(cfg), ep_comm=ep_comm).to(device=device, dtype=dtype)
    tp_comm = tp_comm_for(cfg, dims, device)
    moe_blocks = tuple(i for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoEMLP))
    plan = gpt_plan(loss_parallel=True, dense_mlp=len(moe_blocks) < cfg.n_layer,
                    sp_moe_blocks=moe_blocks if cfg.sequence_parallel else ())
    parallelize(model, comm=tp_comm, plan=plan, sequence_parallel=cfg.sequence_parallel)
    if cp_comm is not None:  # after parallelize: its probe runs whole sequences
        model.context_parallel(cp_comm, method=cfg.cp_method)
    for mlp in _moe_mlps(model):
        mlp.aux_scale = 1.0 / cfg.micro_batches  # the pipeline's scale of each loss
    tracker = RNGTracker(seed=cfg.seed, tp_rank=dims.tp_rank, pp_rank=dims.pp_rank,
                         dp_rank=dims.dp_rank)
    if cfg.dropout > 0:
        install_dropout(model, tracker, sequence_parallel=cfg.sequence_parallel)
    if cfg.recompute != "none":
        apply_recompute(model, cfg.recompute, tracker=tracker)
    num_virtual = cfg.virtual_stages if cfg.schedule == "interleaved" else 1
    stages = pipeline_stages(model, pp_group=dims.pp_group, num_virtual=num_virtual)
    schedule = build_schedule(_SCHEDULE_NAMES[cfg.schedule], pp_size=cfg.pp,
                              num_microbatches=cfg.micro_batches, num_virtual=num_virtual)

    def loss_fn(logits_shard_v: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard_v.float(), targets, comm=tp_comm)

    # Forward/backward pairs whose EP all-to-alls hide under each other's compute: with the
    # chunked exchange (the symmetric one is single-buffered), off in the no-overlap baselines.
    pairs = (ep_comm is not None and ep_comm.pairable and cfg.ep_pipeline_overlap and overlap
             and ep_pairs)
    pipe = Pipeline(stages, schedule, loss_fn=loss_fn, pp_group=dims.pp_group,
                    timeout=cfg.timeout, ep_comms=[ep_comm] if pairs else [])
    reducers, optimizers = [], []
    for stage, group, params, divisor in _reduction_groups(cfg, dims, stages):
        # rebuild_buckets=False: the bucket layout is fixed from the start, so a resumed run
        # (whose optimizer state is laid out over it) reduces exactly as the uninterrupted one
        extra = _grad_dtype_option(cfg)
        red = GradReducer(stage.module, dp_group=group, params=params, divisor=divisor,
                          comm_dtype=cfg.comm_dtype,
                          bucket_cap_mb=cfg.bucket_mb, first_bucket_cap_mb=cfg.bucket_mb,
                          shard=cfg.sharded_optimizer, timeout=cfg.timeout,
                          rebuild_buckets=False, overlap=overlap, **extra)
        red.sync_if(lambda s=stage: s.last_backward)
        reducers.append(red)
        groups = param_groups(model, red.params, cfg.weight_decay)
        if cfg.sharded_optimizer:  # fp32 masters of this rank's shard
            optimizers.append(ShardedOptimizer(red, torch.optim.AdamW, param_groups=groups,
                                               lr=cfg.lr, eps=cfg.adam_eps))
        elif dtype != torch.float32:  # fp32 masters of every parameter, stepped from main_grad
            optimizers.append(MasterOptimizer(groups, torch.optim.AdamW, lr=cfg.lr,
                                              eps=cfg.adam_eps))
        else:
            optimizers.append(torch.optim.AdamW(groups, lr=cfg.lr, eps=cfg.adam_eps))
    replicated = _tp_replicated(model, reducers)
    offloader = _offloader(cfg, stages, device)
    return SimpleNamespace(model=model, tp_comm=tp_comm, tracker=tracker, stages=stages,
                           schedule=schedule, pipe=pipe, reducers=reducers,
                           optimizers=optimizers, replicated=replicated, overlap=overlap,
                           ep_comm=ep_comm, cp_comm=cp_comm, offloader=offloader)


def _offloader(cfg: TrainConfig, stages, device: torch.device):
    """--offload-activations: the first N blocks of every pipeline chunk offload what they
    save (after recomputation's wrappers: a checkpointed block offloads its inputs)."""
    if cfg.offload_activations == "none":
        return None
    from overlap.memory import ActivationOffloader
    from overlap.models.gpt import Block

    off = ActivationOffloader(device, timeout=cfg.timeout)
    for stage in stages:
        blocks = [m for m in stage.module.modules() if isinstance(m, Block)]
        n = cfg.offload_blocks(len(blocks))
        if n:
            off.wrap(blocks, keep_last=len(blocks) - n)
    return off


def _reduction_groups(cfg: TrainConfig, dims, stages):
    """(stage, group, params, divisor) per reducer: every parameter of a stage over DP x CP
    (the dcp group; each CP rank's loss is the mean over its share of the tokens, so the
    average over dp x cp is the mean over the step); with expert parallelism the experts
    apart, over the expert-DP group (the ranks holding the same experts), divided by dp x cp
    like the rest (their local gradient already sums the tokens of the whole EP group)."""
    from overlap.moe import split_expert_parameters

    for stage in stages:
        if cfg.ep == 1 or not cfg.moe_experts:
            yield stage, dims.dcp_group, None, None
            continue
        dense, expert = split_expert_parameters(stage.module)
        if dense:
            yield stage, dims.dcp_group, dense, None
        if expert:
            yield stage, dims.edp_group, expert, cfg.dp * cfg.cp


def _train_step(cfg: TrainConfig, job: SimpleNamespace, dims, step: int, x, y, lr: float,
                device: torch.device) -> StepRecord:
    """One optimizer step of ``job``; every rank returns the same record."""
    for opt in job.optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
    has_first = 0 in job.pipe.stages
    has_last = job.schedule.num_stages - 1 in job.pipe.stages
    reset_exposed()
    t0 = time.perf_counter()
    with nvtx.step(step):  # NVTX on CUDA (nsys sees it), record_function everywhere
        out = job.pipe.step(x if has_first else None, y if has_last else None)
        norm = (clip_grads(job.optimizers, job.reducers, job.replicated, cfg.clip_grad,
                           dims=dims, sharded=cfg.sharded_optimizer)
                if cfg.clip_grad > 0 else None)
        for opt in job.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=False)
            if not job.overlap and hasattr(opt, "wait_params"):
                opt.wait_params()  # no parameter-gather prefetch under the next forward
    step_s = time.perf_counter() - t0
    exposed, ep_exposed = exposed_seconds(), exposed_seconds("ep")
    off_exposed = exposed_seconds("offload")
    loss = float(out.loss) if has_last and dims.tp_rank == 0 else 0.0
    # One small collective gathers what rank 0 reports: loss (from the last stage, averaged
    # over dp x cp: each CP rank's is the mean over its equal share of the tokens), the mean
    # exposed fraction, EP and offload waits, and the slowest step time.
    world = dist.get_world_size()
    stats = torch.tensor([loss / (cfg.dp * cfg.cp), exposed / step_s / world,
                          ep_exposed / world, off_exposed / world, step_s],
                         dtype=torch.float64, device=device)
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


def train_rank(cfg: TrainConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train on this rank (the default process group must be initialised with
    tp*cp*pp*dp ranks). Returns the per-step records (identical on every rank) and, with
    ``cfg.profile``, the path of this rank's trace."""
    from overlap.dist.dims import ParallelDims
    from overlap.tp import close_default_comms

    device = rank_device()
    agree_across_ranks("overlap-train", shared_settings(cfg), device)
    dims = ParallelDims.build(tp=cfg.tp, cp=cfg.cp, pp=cfg.pp, dp=cfg.dp, ep=cfg.ep,
                              device_type=device.type)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    job = _build(cfg, dims, device, dtype)
    off = (_build(cfg, dims, device, dtype, overlap=False) if cfg.compare_no_overlap else
           _build(cfg, dims, device, dtype, ep_pairs=False) if cfg.compare_ep_overlap else None)
    model, tracker, stages, optimizers = job.model, job.tracker, job.stages, job.optimizers

    start_step, resumed_from, fault_s, saved_layout = _maybe_resume(cfg, dims, model, stages,
                                                                    optimizers, tracker)
    writer = None
    if cfg.save:
        from overlap.train.checkpoint import CheckpointWriter

        writer = CheckpointWriter(cfg.save, attempt=attempt_number(), timeout=cfg.timeout)
    batches = Batches(load_tokens(cfg.data), seq_len=cfg.seq_len,
                      micro_batch_size=cfg.micro_batch_size, micro_batches=cfg.micro_batches,
                      dp=cfg.dp, seed=cfg.seed)
    printer = dist.get_rank() == 0 and progress
    records: list[StepRecord] = []
    off_records: list[StepRecord] = []
    prof, trace_path = _profiler(cfg, dims)
    # Trace only the last PROFILED_STEPS steps: step 0 pays for warm-up, and a trace of every
    # step of a long run is hundreds of MB per rank.
    first_traced = max(1 if cfg.steps > 1 else 0, cfg.steps - PROFILED_STEPS)
    resumed_at = None
    grow_path = os.environ.get("OVERLAP_GROW_REQUEST")
    stop = False
    logging = printer and cfg.log_json is not None
    layout = layout_dict(cfg)
    try:
        for step in range(start_step, cfg.steps):
            if step == cfg.kill_at_step and attempt_number() == 0:
                _maybe_die(cfg)
            if prof is not None and step == first_traced:
                prof.start()
            inputs, targets = batches.step(step)
            # (micro_batches, mbs, seq) -> a list of (mbs, seq / cp) micro-batches: this CP
            # rank's zig-zag tokens and their next-token targets
            x = list(_cp_share(inputs[dims.dp_rank], dims).to(device).unbind(0))
            y = list(_cp_share(targets[dims.dp_rank], dims).to(device).unbind(0))
            lr = lr_at(cfg, step)
            if resumed_at is None:
                resumed_at = time.time()
                if logging and (resumed_from or attempt_number()):
                    log_event(cfg, "resumed", step=start_step, checkpoint=resumed_from,
                              attempt=attempt_number() + 1, layout=layout,
                              checkpoint_layout=saved_layout,
                              fault_to_resumed_s=(resumed_at - fault_s) if fault_s else None)
            # --compare-*: the baseline's step runs next to this one, first on odd
            # steps, so load and warm caches affect both alike.
            if off is not None and step % 2:
                off_records.append(_train_step(cfg, off, dims, step, x, y, lr, device))
            rec = _train_step(cfg, job, dims, step, x, y, lr, device)
            if off is not None and not step % 2:
                off_records.append(_train_step(cfg, off, dims, step, x, y, lr, device))
            records.append(rec)
            if printer:
                if len(records) == 1 and sharing_note() is not None:
                    print(f"note: {sharing_note()}", flush=True)  # before any timing
                print(_row(rec, cfg.steps), flush=True)
            if logging:
                log_event(cfg, "step", layout=layout, **dataclasses.asdict(rec))
            done = step + 1
            stop = grow_path is not None and done < cfg.steps and _grow_requested(grow_path,
                                                                                  device)
            if writer is not None and (done % cfg.save_every == 0 or done == cfg.steps
                                       or stop):
                _save(cfg, writer, model, stages, optimizers, tracker, done)
            if stop:  # the lost nodes are back: stop here, the launcher resumes on all of them
                break
        if prof is not None:
            prof.stop()
            prof.export_chrome_trace(trace_path)
        if writer is not None:
            writer.wait()
    finally:
        for j in (job, off):
            if j is None:
                continue
            for opt in j.optimizers:
                if hasattr(opt, "close"):
                    opt.close()
            for red in j.reducers:
                red.close()
            j.tp_comm.close()
            for c in (j.ep_comm, j.cp_comm, j.offloader):
                if c is not None:
                    c.close()
        if writer is not None:
            writer.close()
        close_default_comms()
    return {"records": [dataclasses.asdict(r) for r in records],
            "records_no_overlap": [dataclasses.asdict(r) for r in off_records],
            "trace": trace_path if prof is not None else None,
            "start_step": start_step, "resumed_from": resumed_from,
            "checkpoint_layout": saved_layout,
            "fault_to_resumed_s": (resumed_at - fault_s) if fault_s and resumed_at else None,
            "saved": writer.saved if writer is not None else [], "stopped_to_grow": stop,
            "ep_pairs": len(job.pipe.pairs), **_cp_report(job.cp_comm),
            "placement": placement(),
            "offload": job.offloader.stats.as_dict() if job.offloader is not None else None}


def _cp_report(comm) -> dict:
    """What ``--cp-method auto`` chose per attention shape, and the timings it chose by."""
    if comm is None or not comm.cp_choices:
        return {}
    keys = sorted(comm.cp_choices, key=str)
    return {"cp_choices": [(str(tuple(k[:5])), comm.cp_choices[k]) for k in keys],
            "cp_timings": [comm.cp_timings.get(k, {}) for k in keys]}


def _cp_share(tokens: torch.Tensor, dims) -> torch.Tensor:
    """This CP rank's zig-zag piece of the last (sequence) dim; the whole of it without CP."""
    if dims.cp == 1:
        return tokens
    from overlap.cp import zigzag_shard

    return zigzag_shard(tokens, tokens.dim() - 1, cp=dims.cp, rank=dims.cp_rank)


def _grad_dtype_option(cfg: TrainConfig) -> dict:
    """bf16: fp32 gradient buffers in the reducer (Megatron's main_grad): accumulation over
    the micro-batches and the DP reduction run in fp32 (or the lossy ``comm_dtype``)."""
    return {"grad_dtype": torch.float32} if cfg.dtype == "bf16" else {}


def _maybe_die(cfg: TrainConfig) -> None:
    """Fault injection (hidden --kill-rank or --kill-node, with --kill-at-step): note the
    time, then SIGKILL."""
    rank = dist.get_rank()
    if cfg.kill_rank != rank and cfg.kill_node != rank // cfg.node_size:
        return
    if cfg.save:
        with open(os.path.join(cfg.save, "fault_time"), "w") as f:
            f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _grow_requested(path: str, device: torch.device) -> bool:
    """Did the launcher ask to stop for a grow? Rank 0 looks; every rank gets its answer."""
    flag = torch.tensor([float(dist.get_rank() == 0 and os.path.exists(path))], device=device)
    with comm_wait("train.grow"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _tp_replicated(model, reducers) -> list[list[bool]]:
    """Per reducer, per parameter: is it replicated over TP (a norm, the position table, an
    expert: experts shard over EP, never over TP)?"""
    from overlap.moe.experts import SwiGLUExperts
    from overlap.nn.layers import TPModule

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


def clip_grads(optimizers, reducers, replicated, max_norm: float, *, dims,
               sharded: bool) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (||g|| + 1e-6))`` (torch's
    ``clip_grad_norm_``), ``||g||`` the L2 norm of the whole model's gradient: each element
    counted once, i.e. on one rank of its reducer's group (the one owning its ZeRO shard, else
    the group's rank 0: DP for dense parameters, expert-DP for experts) and, for
    TP-replicated parameters, on TP rank 0 only; summed over every rank. Returns the norm.
    Reads (and scales) the fp32 main grads where the reducer keeps them (bf16)."""
    from overlap.train.precision import grad_of

    total = torch.zeros((), dtype=torch.float32)
    tp0 = dims.tp_rank == 0
    for opt, red, rep in zip(optimizers, reducers, replicated):
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
    for opt, red in zip(optimizers, reducers):
        if sharded:
            opt.scale_grads_(coef)
        else:
            for p in red.params:
                g = grad_of(p)
                if g is not None:
                    g.mul_(coef.to(g.dtype))
    return norm


def _checkpoint_state(cfg, model, stages, optimizers):
    from overlap.train.checkpoint import build_state

    for opt in optimizers:
        if hasattr(opt, "wait_params"):
            opt.wait_params()
    return build_state(model=model, stages=[s for s in stages], optimizers=optimizers,
                       sharded=cfg.sharded_optimizer)


def _save(cfg, writer, model, stages, optimizers, tracker, done: int) -> None:
    state = _checkpoint_state(cfg, model, stages, optimizers)
    meta = {"step": done, "tp": cfg.tp, "cp": cfg.cp, "pp": cfg.pp, "dp": cfg.dp,
            "seed": cfg.seed,
            "schedule": cfg.schedule, "virtual_stages": cfg.virtual_stages,
            "sharded_optimizer": cfg.sharded_optimizer, "dtype": cfg.dtype,
            "global_batch": cfg.dp * cfg.micro_batches * cfg.micro_batch_size,
            "model": dataclasses.asdict(model_config(cfg)), "rng": tracker.state()}
    writer.save(state, meta, done)


def _layout_key(meta_or_cfg) -> tuple:
    g = (lambda k: meta_or_cfg.get(k, 1 if k == "cp" else None)) \
        if isinstance(meta_or_cfg, dict) else (lambda k: getattr(meta_or_cfg, k))
    return tuple(g(k) for k in ("tp", "cp", "pp", "dp", "schedule", "virtual_stages",
                                "sharded_optimizer"))


def _saved_layout(meta: dict) -> dict:
    """The degrees and global batch of the run that wrote a checkpoint (its meta)."""
    return {k: meta.get(k, 1 if k == "cp" else None) for k in ("tp", "cp", "pp", "dp",
                                                               "global_batch")}


def _maybe_resume(cfg, dims, model, stages, optimizers, tracker):
    """Load the checkpoint to continue from, if any: after a restart the latest complete one
    under --save, else --resume. Returns (first step, path or None, fault time or None, the
    writer's layout or None)."""
    from overlap.train.checkpoint import latest_checkpoint, load, read_meta

    path, fault_s = None, None
    if attempt_number() > 0 and cfg.save:
        path = latest_checkpoint(cfg.save)
        try:
            with open(os.path.join(cfg.save, "fault_time")) as f:
                fault_s = float(f.read())
        except (OSError, ValueError):
            pass
    if path is None and cfg.resume:
        path = latest_checkpoint(cfg.resume)
    # Each rank lists the directory itself (a node's own mount, an NFS cache): every rank
    # must load the same step, or the ranks would train on from different states.
    agree_across_ranks("overlap-train: the checkpoint to resume from", {
        "step directory": None if path is None else os.path.basename(os.path.normpath(path))},
        rank_device())
    if path is None:  # a fault before the first checkpoint was complete: start over
        return 0, None, fault_s, None
    meta = read_meta(path)
    state = _checkpoint_state(cfg, model, stages, optimizers)
    same = _layout_key(meta) == _layout_key(cfg)
    other_dtype = meta.get("dtype", "fp32") != cfg.dtype
    if other_dtype:
        # The fp32 masters are the truth: load them (and the moments) only, and derive the
        # parameters from them in this run's dtype (without the sharded optimizer in fp32
        # the parameters are their own masters and load as such).
        state = {"optim": state["optim"]}
    blob = load(path, state, rng_key=f"rank{dist.get_rank()}" if same else None)
    if other_dtype:
        for opt in optimizers:
            if hasattr(opt, "publish_masters"):  # ShardedOptimizer's is collective over DP
                opt.publish_masters()
    step_t = state["optim"]["step"]
    for opt in optimizers:
        if cfg.sharded_optimizer:
            opt.set_scalar_state({"step": step_t})
        else:
            for group in opt.param_groups:
                for p in group["params"]:
                    opt.state[p]["step"].copy_(step_t)
    if same:
        tracker.load_state(blob)
    else:  # another layout draws other masks anyway: a fresh stream per step resumed at
        torch.manual_seed(cfg.seed * 1_000_003 + 7919 * dims.pp_rank + 104_729 * dims.dp_rank
                          + 1 + 31 * meta["step"])
    if dist.get_rank() == 0 and meta.get("global_batch") != \
            cfg.dp * cfg.micro_batches * cfg.micro_batch_size:
        print(f"overlap-train: warning: the checkpoint's global batch is "
              f"{meta.get('global_batch')} sequences, this run's "
              f"{cfg.dp * cfg.micro_batches * cfg.micro_batch_size}: the data order differs "
              "from the original run", flush=True)
    return int(meta["step"]), path, fault_s, _saved_layout(meta)


def _profiler(cfg: TrainConfig, dims) -> tuple[Any, str | None]:
    if not cfg.profile:
        return None, None
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(cfg.profile, exist_ok=True)
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    # Every thread: on CPU the communication runs on gloo's, the stream twins' and the copier's
    # threads, and a trace of the training thread alone would show none of it hidden.
    from torch._C._profiler import _ExperimentalConfig

    return (profile(activities=acts,
                    experimental_config=_ExperimentalConfig(profile_all_threads=True)),
            os.path.join(cfg.profile, f"trace_rank{dist.get_rank()}.json"))


def _row(rec: StepRecord, steps: int) -> str:
    done = rec.step + 1
    width = 20
    bar = "#" * (width * done // steps) + "." * (width - width * done // steps)
    return (f"step {done:>4}/{steps} [{bar}] loss {rec.loss:8.4f}  tok/s {rec.tokens_per_s:9.0f}"
            f"  step {rec.step_s * 1e3:7.1f} ms  exposed comm {100 * rec.exposed_fraction:5.1f}%"
            + (f"  grad norm {rec.grad_norm:.6g}" if rec.grad_norm else ""))


def reference_model(cfg: TrainConfig, *, steps: int | None = None, dropout: float = 0.0,
                    norms: list[float] | None = None) -> tuple[GPT, list[float]]:
    """The same training on one process: the same init, data, param groups, LR schedule and
    clipping (``torch.nn.utils.clip_grad_norm_``; its norms are appended to ``norms``), no
    parallelism, fp32. Returns the model after ``steps`` (default ``cfg.steps``) steps and
    the per-step losses.

    Each step averages the per-micro-batch mean losses of all dp x micro_batches micro-batches
    (what the 3D job's pipeline and DP averaging compute) and takes one AdamW step."""
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg, dropout=dropout, reference=True))
    for mlp in _moe_mlps(model):
        mlp.aux_scale = 1.0 / (cfg.dp * cfg.micro_batches)  # each micro-batch's loss scale
    opt = torch.optim.AdamW(param_groups(model, list(model.parameters()), cfg.weight_decay),
                            lr=cfg.lr, eps=cfg.adam_eps)
    batches = Batches(load_tokens(cfg.data), seq_len=cfg.seq_len,
                      micro_batch_size=cfg.micro_batch_size, micro_batches=cfg.micro_batches,
                      dp=cfg.dp, seed=cfg.seed)
    n = cfg.dp * cfg.micro_batches
    losses = []
    for step in range(cfg.steps if steps is None else steps):
        inputs, targets = batches.step(step)
        total = 0.0
        for x, y in zip(inputs.flatten(0, 1), targets.flatten(0, 1)):
            loss = gpt_loss(model(x), y) / n
            loss.backward()
            total += loss.item()
        if cfg.clip_grad > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            if norms is not None:
                norms.append(float(norm))
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses


def reference_losses(cfg: TrainConfig) -> list[float]:
    """Per-step losses of ``reference_model``: what ``--check`` compares against. With
    ``--dropout`` the comparison runs both without dropout (the masks of a TP-sharded run
    cannot equal one process's)."""
    return reference_model(cfg)[1]
