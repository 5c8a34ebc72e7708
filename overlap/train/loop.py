"""One rank of the main job (``train_rank``: drives a ``Job`` over the steps), and the
single-process reference it is checked against.

``train_rank(cfg)`` agrees the settings over the ranks, builds the process groups
(``ParallelDims``, TP innermost) and the ``Job`` (overlap.train.job), resumes it (after a
restart, from the checkpoint elastic's attempt left), then runs the steps: this rank's share
of each batch, the LR schedule, the profiler over the last steps, a row per step on rank 0,
checkpoints, the injected fault and the grow request. ``reference_model`` trains the same
model on one process, as ``--check`` compares.

The narrative: docs/design/training.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from overlap.dist.device import placement, rank_device, sharing_note
from overlap.dist.dims import ParallelDims
from overlap.models.gpt import GPT, gpt_loss
from overlap.tp import close_default_comms
from overlap.train.config import TrainConfig, agree_across_ranks, shared_settings
from overlap.train.data import Batches, load_tokens
from overlap.train.events import log_event
from overlap.train.job import (Job, StepRecord, attempt_number, cp_share, grow_requested,
                               inject_fault, lr_at, model_config, moe_mlps, param_groups,
                               tp_comm_for)
from overlap.train.shrink import layout_dict

__all__ = ["train_rank", "reference_model", "reference_losses", "PROFILED_STEPS", "Job",
           "StepRecord", "model_config", "tp_comm_for", "lr_at", "param_groups",
           "attempt_number"]

PROFILED_STEPS = 3


def train_rank(cfg: TrainConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train on this rank (the default process group must be initialised with
    tp*cp*pp*dp ranks). Returns the per-step records (identical on every rank) and, with
    ``cfg.profile``, the path of this rank's trace."""
    device = rank_device()
    agree_across_ranks("overlap-train", shared_settings(cfg), device)
    dims = ParallelDims.build(tp=cfg.tp, cp=cfg.cp, pp=cfg.pp, dp=cfg.dp, ep=cfg.ep,
                              device_type=device.type)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    job = off = writer = None
    records: list[StepRecord] = []
    off_records: list[StepRecord] = []
    resumed_at = None
    stop = False
    printer = dist.get_rank() == 0 and progress
    t0 = time.monotonic()
    try:
        job = Job.build(cfg, dims, device, dtype)
        # --compare-*: the baseline job, same model and data, stepped beside this one
        off = (Job.build(cfg, dims, device, dtype, overlap=False) if cfg.compare_no_overlap
               else Job.build(cfg, dims, device, dtype, ep_pairs=False)
               if cfg.compare_ep_overlap else None)
        resumed = job.resume()
        if cfg.save:
            from overlap.train.checkpoint import CheckpointWriter  # 0.4 s: only when saving

            writer = CheckpointWriter(cfg.save, attempt=attempt_number(), timeout=cfg.timeout)
        batches = Batches(load_tokens(cfg.data), seq_len=cfg.seq_len,
                          micro_batch_size=cfg.micro_batch_size,
                          micro_batches=cfg.micro_batches, dp=cfg.dp, seed=cfg.seed)
        if printer:
            note = sharing_note()
            if note is not None:
                print(f"note: {note}", flush=True)  # before any timing
            n = sum(p.numel() for p in job.model.parameters())
            print(f"overlap-train: {dist.get_world_size()} ranks up, job built in "
                  f"{time.monotonic() - t0:.1f} s ({n / 1e6:.2f} M parameters on rank 0); "
                  + (f"resuming at step {resumed.step + 1}" if resumed.step else
                     "step 1 warms up (shapes, buckets, first compiles)"), flush=True)
        prof, trace_path = _profiler(cfg)
        # Trace only the last PROFILED_STEPS steps: step 0 pays for warm-up, and a trace of
        # every step of a long run is hundreds of MB per rank.
        first_traced = max(1 if cfg.steps > 1 else 0, cfg.steps - PROFILED_STEPS)
        grow_path = os.environ.get("OVERLAP_GROW_REQUEST")
        logging = printer and cfg.log_json is not None
        layout = layout_dict(cfg)
        for step in range(resumed.step, cfg.steps):
            if step == cfg.kill_at_step and attempt_number() == 0:
                inject_fault(cfg)
            if prof is not None and step == first_traced:
                with _quiet_kineto():
                    prof.start()
            inputs, targets = batches.step(step)
            # (micro_batches, mbs, seq) -> a list of (mbs, seq / cp) micro-batches: this CP
            # rank's zig-zag tokens and their next-token targets
            x = list(cp_share(inputs[dims.dp_rank], dims).to(device).unbind(0))
            y = list(cp_share(targets[dims.dp_rank], dims).to(device).unbind(0))
            lr = lr_at(cfg, step)
            if resumed_at is None:
                resumed_at = time.time()
                if logging and (resumed.path or attempt_number()):
                    log_event(cfg, "resumed", step=resumed.step, checkpoint=resumed.path,
                              attempt=attempt_number() + 1, layout=layout,
                              checkpoint_layout=resumed.layout,
                              fault_to_resumed_s=(resumed_at - resumed.fault_s)
                              if resumed.fault_s else None)
            # The baseline's step runs next to this one, first on odd steps, so load and warm
            # caches affect both alike.
            if off is not None and step % 2:
                off_records.append(off.step(step, x, y, lr))
            rec = job.step(step, x, y, lr)
            if off is not None and not step % 2:
                off_records.append(off.step(step, x, y, lr))
            records.append(rec)
            if printer:
                print(_row(rec, cfg.steps), flush=True)
            if logging:
                log_event(cfg, "step", layout=layout, **dataclasses.asdict(rec))
            done = step + 1
            stop = (grow_path is not None and done < cfg.steps
                    and grow_requested(grow_path, device))
            if writer is not None and (done % cfg.save_every == 0 or done == cfg.steps
                                       or stop):
                job.save(writer, done)
            if stop:  # the lost nodes are back: stop here, the launcher resumes on all of them
                break
        if prof is not None:
            if printer:
                print(f"profile: writing each rank's trace of the last {PROFILED_STEPS} "
                      f"steps to {cfg.profile}", flush=True)
            with _quiet_kineto():
                prof.stop()
                prof.export_chrome_trace(trace_path)
        if writer is not None:
            writer.wait()
    finally:
        for j in (job, off):
            if j is not None:
                j.close()
        if writer is not None:
            writer.close()
        close_default_comms()
    return {"records": [dataclasses.asdict(r) for r in records],
            "records_no_overlap": [dataclasses.asdict(r) for r in off_records],
            "trace": trace_path if prof is not None else None,
            "start_step": resumed.step, "resumed_from": resumed.path,
            "checkpoint_layout": resumed.layout,
            "fault_to_resumed_s": (resumed_at - resumed.fault_s)
            if resumed.fault_s and resumed_at else None,
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


def _profiler(cfg: TrainConfig) -> tuple[Any, str | None]:
    if not cfg.profile:
        return None, None
    os.makedirs(cfg.profile, exist_ok=True)
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    # Every thread: on CPU the communication runs on gloo's, the stream twins' and the copier's
    # threads, and a trace of the training thread alone would show none of it hidden.
    return (profile(activities=acts,
                    experimental_config=_ExperimentalConfig(profile_all_threads=True)),
            os.path.join(cfg.profile, f"trace_rank{dist.get_rank()}.json"))


# What torch's profiler prints to fd 2 at every start and stop, at any KINETO_LOG_LEVEL
# ("USDT:<date> <time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start").
_KINETO_NOISE = re.compile(r"(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] [^\n]*")


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """Catch fd 2 around a profiler start, stop or export, and pass on all but kineto's
    banner lines, which would interleave with the step rows."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = _KINETO_NOISE.sub("", caught.read().decode(errors="replace"))
            rest = "".join(ln + "\n" for ln in rest.splitlines() if ln.strip())
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()


def _row(rec: StepRecord, steps: int) -> str:
    done = rec.step + 1
    width = 20
    bar = "#" * (width * done // steps) + "." * (width - width * done // steps)
    return (f"step {done:>4}/{steps} [{bar}] loss {rec.loss:8.4f}  tok/s {rec.tokens_per_s:9.0f}"
            f"  step {rec.step_s * 1e3:7.1f} ms  comm wait {100 * rec.exposed_fraction:5.1f}%"
            + (f"  grad norm {rec.grad_norm:.6g}" if rec.grad_norm else ""))


def reference_model(cfg: TrainConfig, *, steps: int | None = None, dropout: float = 0.0,
                    norms: list[float] | None = None,
                    on_step: Callable[[int, int], None] | None = None
                    ) -> tuple[GPT, list[float]]:
    """The same training on one process: the same init, data, param groups, LR schedule and
    clipping (``torch.nn.utils.clip_grad_norm_``; its norms are appended to ``norms``), no
    parallelism, fp32. Returns the model after ``steps`` (default ``cfg.steps``) steps and
    the per-step losses.

    Each step averages the per-micro-batch mean losses of all dp x micro_batches micro-batches
    (what the parallel job's pipeline and DP averaging compute) and takes one AdamW step."""
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg, dropout=dropout, reference=True))
    for mlp in moe_mlps(model):
        mlp.aux_scale = 1.0 / (cfg.dp * cfg.micro_batches)  # each micro-batch's loss scale
    opt = torch.optim.AdamW(param_groups(model, list(model.parameters()), cfg.weight_decay),
                            lr=cfg.lr, eps=cfg.adam_eps)
    batches = Batches(load_tokens(cfg.data), seq_len=cfg.seq_len,
                      micro_batch_size=cfg.micro_batch_size, micro_batches=cfg.micro_batches,
                      dp=cfg.dp, seed=cfg.seed)
    n = cfg.dp * cfg.micro_batches
    losses = []
    n_steps = cfg.steps if steps is None else steps
    for step in range(n_steps):
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
        if on_step is not None:
            on_step(step + 1, n_steps)
    return model, losses


def reference_losses(cfg: TrainConfig) -> list[float]:
    """Per-step losses of ``reference_model``: what ``--check`` compares against. With
    ``--dropout`` the comparison runs both without dropout (the masks of a TP-sharded run
    cannot equal one process's)."""
    return reference_model(cfg)[1]
