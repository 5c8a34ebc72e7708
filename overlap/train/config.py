"""TrainConfig: the one definition of the demo's settings. The CLI is generated from it.

Validation happens here, before any process starts, so a bad flag costs a one-line error and
not a hung 8-process job.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from overlap import cli
from overlap.comm.quant.checks import COMM_DTYPES  # the one vocabulary: "fp32", "bf16", "int8"
from overlap.errors import ConfigError  # one for every command (re-exported)
from overlap.pp.schedules import SCHEDULE_ALIASES, SCHEDULE_NAMES, schedule_key

__all__ = ["TrainConfig", "ConfigError", "parse_args", "shared_settings", "agree_across_ranks"]

SCHEDULES = tuple(SCHEDULE_NAMES)  # gpipe 1f1b interleaved zb-h1; --schedule also takes aliases
TP_BACKENDS = ("auto", "chunked", "symmetric", "triton", "unfused")
TRANSPORTS = ("nccl_twin", "gloo")
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("fp32", "bf16")
LR_SCHEDULES = ("constant", "cosine")
EP_BACKENDS = ("chunked", "symmetric")
CP_METHODS = ("ring", "allgather", "ulysses", "auto")
VOCAB_SIZE = 256  # byte-level tokenizer


_field = cli.field


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    tp: int = _field(2, "tensor-parallel degree (innermost: consecutive ranks)")
    cp: int = _field(1, "context-parallel degree: each sequence is split over cp ranks "
                        "(zig-zag, so causal work is balanced) and attention runs as ring "
                        "attention over them; between tp and pp in the rank order")
    cp_method: str = _field("ring", "context-parallel attention: ring (kv blocks rotate under "
                                    "the attention of the previous one), allgather, ulysses "
                                    "(heads <-> sequence all-to-all) or auto (measured per "
                                    "shape on the first step)", choices=CP_METHODS)
    pp: int = _field(2, "pipeline-parallel degree (stages)")
    dp: int = _field(2, "data-parallel degree")
    schedule: str = _field("1f1b", "pipeline schedule", choices=SCHEDULES,
                           aliases=SCHEDULE_ALIASES)
    virtual_stages: int = _field(2, "model chunks per pipeline rank (interleaved schedule only)")
    micro_batches: int = _field(4, "micro-batches per step and data-parallel rank")
    micro_batch_size: int = _field(4, "sequences per micro-batch")
    seq_len: int = _field(64, "tokens per sequence")
    n_layer: int = _field(4, "transformer blocks")
    d_model: int = _field(64, "hidden size")
    n_head: int = _field(4, "attention heads")
    steps: int = _field(30, "optimizer steps")
    lr: float = _field(3e-3, "AdamW (peak) learning rate")
    lr_schedule: str = _field("constant", "learning rate after warm-up: constant, or cosine "
                                          "decay to --min-lr-ratio x lr at the last step",
                              choices=LR_SCHEDULES)
    warmup_steps: int = _field(0, "linear learning-rate warm-up steps (from lr/warmup)")
    min_lr_ratio: float = _field(0.1, "cosine schedule: final lr as a fraction of --lr")
    adam_eps: float = _field(1e-8, "AdamW epsilon; a larger one bounds how far rounding noise in "
                                   "a near-zero gradient can move a parameter (about lr x "
                                   "noise / eps per step instead of up to lr)")
    weight_decay: float = _field(0.0, "AdamW weight decay of matrix weights (norms, biases and "
                                      "embeddings get none)")
    clip_grad: float = _field(0.0, "clip the global gradient L2 norm (over every TP/PP/DP "
                                   "shard, each element once) to this value; 0: off")
    dropout: float = _field(0.0, "dropout probability (attention, residual, embedding); "
                                 "TP-sharded regions draw per-rank masks")
    recompute: str = _field("none", "activation recomputation: selective (the attention core) "
                                    "or full (each transformer block)", choices=RECOMPUTE)
    offload_activations: str = _field("none", "copy what transformer blocks save for the "
                                               "backward to host memory on a side stream and "
                                               "reload it one block ahead of its backward: "
                                               "none, all, or N (the first N blocks of each "
                                               "pipeline chunk; the later ones, whose backward "
                                               "comes first, stay on the device)",
                                  metavar="{none,all,N}")
    dtype: str = _field("fp32", "parameter and activation dtype; bf16 keeps fp32 gradient "
                                "buffers and fp32 master weights", choices=DTYPES)
    seed: int = _field(0, "seed for the model init and the data order")
    sequence_parallel: bool = _field(True, "sequence-parallel TP layers (fused AG-GEMM / GEMM-RS)")
    tp_backend: str = _field("auto", "fused TP op backend", choices=TP_BACKENDS)
    comm_dtype: str = _field("fp32", "data-parallel gradient wire dtype", choices=COMM_DTYPES)
    ep: int = _field(1, "expert-parallel degree: the MoE blocks' experts are sharded over ep "
                        "data-parallel ranks (needs --moe-experts; ep must divide dp)")
    moe_experts: int = _field(0, "experts per MoE block (0: a dense model)")
    moe_top_k: int = _field(2, "experts per token")
    moe_shared_experts: int = _field(0, "shared experts per MoE block (run on every token)")
    moe_every: int = _field(1, "every N-th block is a MoE block")
    capacity_factor: float = _field(0.0, "MoE capacity factor (tokens over capacity are "
                                         "dropped); 0: dropless")
    moe_aux_coef: float = _field(0.01, "load-balancing loss coefficient")
    ep_backend: str = _field("chunked", "expert-parallel exchange", choices=EP_BACKENDS)
    ep_pipeline_overlap: bool = _field(True, "run a forward and a backward of different "
                                             "micro-batches next to each other in the schedule "
                                             "as a pair whose EP all-to-alls hide under each "
                                             "other's compute (where a cost model of the "
                                             "schedule says it pays; with --ep-backend "
                                             "symmetric: twice the userbuffers)")
    bucket_mb: float = _field(0.25, "gradient bucket size in MiB (small: the demo model is "
                                    "small, and several buckets show the overlap)",
                              metavar="MIB")
    sharded_optimizer: bool = _field(True, "ZeRO-style sharded optimizer over the dp axis")
    check: bool = _field(False, "also train the same model on one process and compare losses")
    check_tolerance: float = _field(2e-3, "max |loss difference| per step allowed by --check")
    profile: str | None = _field(None, "write torch.profiler traces, a PNG timeline and overlap "
                                       "metrics to this directory", metavar="DIR")
    compare_no_overlap: bool = _field(False, "also train the same model with every overlap off "
                                             "(unfused TP ops, DP reduction after the backward, "
                                             "no parameter-gather prefetch), steps interleaved, "
                                             "and compare step time and exposed comm")
    compare_ep_overlap: bool = _field(False, "also train the same model with "
                                             "--no-ep-pipeline-overlap, steps interleaved, and "
                                             "compare the exposed EP all-to-all time")
    data: str | None = _field(None, "text file to train on (default: the bundled corpus)",
                               metavar="FILE")
    save: str | None = _field(None, "write distributed checkpoints (torch.distributed."
                                    "checkpoint) to DIR/step_<N>, asynchronously",
                                metavar="DIR")
    save_every: int = _field(10, "with --save: checkpoint every N steps (and after the last)")
    resume: str | None = _field(None, "continue from the latest complete checkpoint under DIR "
                                      "(or from DIR itself, a step_<N> directory); any "
                                      "tp/pp/dp layout", metavar="DIR")
    export: str | None = _field(None, "with --resume: write the checkpoint's unsharded model "
                                      "as one torch.save file (FILE) and exit; no training",
                                  metavar="FILE")
    max_restarts: int = _field(0, "restart every rank from the latest complete checkpoint "
                                  "(of --save) up to K times after a rank dies or times out",
                               metavar="K")
    ranks_per_node: int = _field(0, "ranks that share a node (a local job emulates nodes: "
                                    "ranks k*N..k*N+N-1 are node k); tp must fit in one; 0: "
                                    "LOCAL_WORLD_SIZE under torchrun/srun, else one node")
    ranks_per_gpu: int = _field(0, "ranks that share one GPU (rank r on GPU r // N, each with "
                                   "its own NCCL host id: one GPU runs a multi-rank job, for "
                                   "correctness; its timings mean nothing for speed); 0: env "
                                   "OVERLAP_RANKS_PER_GPU, else 1")
    min_nodes: int = _field(0, "when a rank dies, presume its node lost and continue on the "
                               "surviving nodes while at least this many remain: the planner "
                               "picks their layout and the job resumes from the latest "
                               "checkpoint, resharded (needs --save, --max-restarts); 0: "
                               "restart on the same layout only")
    grow_back: bool = _field(False, "after a shrink, return to the full layout when the lost "
                                    "nodes come back (the job stops at a fresh checkpoint and "
                                    "resumes on every node)")
    plan_profile: str = _field("h100-sxm", "device the shrink planner ranks layouts for: a GPU "
                                           "name of overlap-plan or a profile JSON written by "
                                           "overlap-plan --calibrate", metavar="GPU|FILE")
    log_json: str | None = _field(None, "append one JSON line per step, fault, layout change "
                                        "and resume to FILE", metavar="FILE")
    heartbeat_timeout: float = _field(15.0, "under torchrun or srun: when a watched peer's "
                                            "heartbeat stops for this many seconds (its node is "
                                            "lost), every rank exits so that the launcher "
                                            "restarts the job, instead of waiting --timeout in "
                                            "a collective; 0: off", metavar="SECONDS")
    timeout: float = _field(600.0, "seconds before a hung local job is killed",
                            metavar="SECONDS")
    transport: str = _field("nccl_twin", "local CPU processes only: nccl_twin is gloo with "
                                         "NCCL's ordering rules (an order that would hang on "
                                         "GPUs hangs here too, and is reported); gloo is looser",
                            choices=TRANSPORTS)
    # fault injection for the restart test: rank R kills itself with SIGKILL at step S, once
    kill_rank: int = _field(-1, "test only", hidden=True)
    kill_at_step: int = _field(-1, "test only", hidden=True)
    # ... or every rank of emulated node N (--ranks-per-node) does
    kill_node: int = _field(-1, "test only", hidden=True)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def vocab_size(self) -> int:
        """The byte-level tokenizer's vocabulary (what the planner's view of the job reads)."""
        return VOCAB_SIZE

    @property
    def node_size(self) -> int:
        """Ranks per node: --ranks-per-node, or the whole job as one node."""
        return self.ranks_per_node or self.world_size

    @property
    def num_stages(self) -> int:
        return self.pp * (self.virtual_stages if self.schedule == "interleaved" else 1)

    def __post_init__(self) -> None:
        # Any accepted spelling (the library's names, any case) is held as --schedule's, so
        # code built as TrainConfig(schedule="zb_h1") reads the same value as the CLI's.
        key = schedule_key(self.schedule)
        if key is not None:
            self.schedule = next(n for n, k in SCHEDULE_NAMES.items() if k == key)

    def validate(self) -> None:
        """Raise ConfigError (one line) for settings that cannot work. Reads only the file
        system (the data file, checkpoint directories): nothing starts."""
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)} (or "
                              f"{', '.join(SCHEDULE_ALIASES)}), got {self.schedule!r}")
        for name in ("tp", "cp", "pp", "dp", "virtual_stages", "micro_batches", "micro_batch_size",
                     "seq_len", "n_layer", "d_model", "n_head", "steps", "save_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
        for name in ("warmup_steps", "max_restarts", "ranks_per_node", "min_nodes",
                     "ranks_per_gpu"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 0, got {v}")
        from overlap.dist.device import ranks_per_gpu

        try:  # 0: the environment's setting, which must then be a count too
            ranks_per_gpu(self.ranks_per_gpu or None)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _check_number("lr", self.lr, low=0.0, low_open=True)
        _check_number("adam_eps", self.adam_eps, low=0.0, low_open=True)
        _check_number("weight_decay", self.weight_decay, low=0.0)
        _check_number("clip_grad", self.clip_grad, low=0.0)
        _check_number("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        _check_number("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        _check_number("bucket_mb", self.bucket_mb, low=0.0)
        _check_number("timeout", self.timeout, low=0.0, low_open=True)
        _check_number("heartbeat_timeout", self.heartbeat_timeout, low=0.0)
        from overlap.dist.heartbeat import INTERVAL_S

        if 0 < self.heartbeat_timeout <= INTERVAL_S:
            raise ConfigError(f"--heartbeat-timeout {self.heartbeat_timeout} must exceed the "
                              f"{INTERVAL_S:g} s heartbeat interval (or be 0: off)")
        _check_number("check_tolerance", self.check_tolerance, low=0.0, low_open=True)
        self._validate_moe()
        rpn = self.ranks_per_node
        if rpn and self.world_size % rpn and self.world_size > rpn:
            raise ConfigError(f"--ranks-per-node {rpn} does not divide the {self.world_size} "
                              "ranks (tp*cp*pp*dp): every node holds the same number")
        from overlap.dist.dims import ParallelDims

        try:
            ParallelDims.resolve(world_size=self.world_size, tp=self.tp, cp=self.cp, pp=self.pp,
                                 dp=self.dp, ep=self.ep,
                                 ranks_per_node=self.ranks_per_node or max(self.tp,
                                                                           self.world_size))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.d_model % self.n_head:
            raise ConfigError(f"--d-model {self.d_model} is not divisible by --n-head {self.n_head}")
        if self.n_head % self.tp:
            raise ConfigError(f"--n-head {self.n_head} is not divisible by --tp {self.tp}: "
                              "each tensor-parallel rank needs whole heads")
        if (4 * self.d_model) % self.tp or VOCAB_SIZE % self.tp:
            raise ConfigError(f"--tp {self.tp} must divide the MLP width {4 * self.d_model} and "
                              f"the vocabulary {VOCAB_SIZE}")
        self._validate_cp()
        self._validate_offload()
        if self.sequence_parallel and self.cp == 1 and self.seq_len % self.tp:
            raise ConfigError(f"sequence parallelism splits the {self.seq_len} tokens of each "
                              f"sequence over --tp {self.tp}: --seq-len {self.seq_len} must be "
                              "divisible by it (or pass --no-sequence-parallel)")
        if self.sequence_parallel and (self.seq_len // self.cp) % self.tp:
            raise ConfigError(f"sequence parallelism splits the {self.seq_len // self.cp} tokens "
                              f"of each sequence (per context-parallel rank) over --tp "
                              f"{self.tp}: --seq-len {self.seq_len} must be divisible by "
                              f"cp x tp = {self.cp * self.tp} (or pass --no-sequence-parallel)")
        if self.n_layer < self.num_stages:
            raise ConfigError(f"--n-layer {self.n_layer} is less than the {self.num_stages} "
                              "pipeline stages (pp x virtual stages): every stage needs a layer")
        if self.micro_batches < self.pp:
            raise ConfigError(f"--micro-batches {self.micro_batches} must be >= --pp {self.pp} "
                              "so every stage has work in the steady state")
        if self.schedule == "interleaved" and self.micro_batches % self.pp:
            raise ConfigError(f"the interleaved schedule needs --micro-batches "
                              f"({self.micro_batches}) to be a multiple of --pp ({self.pp})")
        self._validate_data()
        self._validate_checkpoints()

    def offload_blocks(self, chunk_blocks: int) -> int:
        """How many of a pipeline chunk's ``chunk_blocks`` blocks offload."""
        v = self.offload_activations
        return 0 if v == "none" else chunk_blocks if v == "all" else min(int(v),
                                                                          chunk_blocks)

    def _validate_offload(self) -> None:
        v = self.offload_activations
        if v in ("none", "all"):
            return
        if not (isinstance(v, str) and v.isdigit() and int(v) >= 1):
            raise ConfigError(f"--offload-activations must be none, all or a positive number "
                              f"of blocks per pipeline chunk, got {v!r}")
        if int(v) > self.n_layer:
            raise ConfigError(f"--offload-activations {v} is more than the {self.n_layer} "
                              "blocks (--n-layer)")

    def _validate_cp(self) -> None:
        if self.cp == 1:
            return
        if self.seq_len % (2 * self.cp):
            raise ConfigError(f"--cp {self.cp} splits each sequence into 2 x cp = "
                              f"{2 * self.cp} zig-zag chunks: --seq-len {self.seq_len} must be "
                              "divisible by it")
        if self.dropout > 0:
            raise ConfigError(f"--dropout {self.dropout} with --cp {self.cp}: context-parallel "
                              "attention has no attention dropout; pass --dropout 0")
        if self.cp_method == "ulysses" and (self.n_head // self.tp) % self.cp:
            raise ConfigError(f"--cp-method ulysses gives each of the --cp {self.cp} ranks "
                              f"whole heads: the {self.n_head // self.tp} heads per tensor-"
                              f"parallel rank (--n-head {self.n_head} / --tp {self.tp}) must "
                              "be divisible by cp")

    def _validate_moe(self) -> None:
        for name in ("ep", "moe_top_k", "moe_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
        for name in ("moe_experts", "moe_shared_experts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 0, got {v}")
        _check_number("capacity_factor", self.capacity_factor, low=0.0)
        _check_number("moe_aux_coef", self.moe_aux_coef, low=0.0)
        if not self.moe_experts:
            if self.ep > 1:
                raise ConfigError(f"--ep {self.ep} shards the experts of MoE blocks: pass "
                                  "--moe-experts N too")
            return
        if self.moe_experts % self.ep:
            raise ConfigError(f"--moe-experts {self.moe_experts} is not divisible by --ep "
                              f"{self.ep}: every EP rank holds the same number of experts")
        if self.moe_top_k > self.moe_experts:
            raise ConfigError(f"--moe-top-k {self.moe_top_k} is larger than --moe-experts "
                              f"{self.moe_experts}")
        if self.seq_len % (self.tp * self.cp):
            groups = f"cp x tp = {self.cp * self.tp}" if self.cp > 1 else f"--tp {self.tp}"
            raise ConfigError(f"MoE blocks route each sequence in {groups} groups (as "
                              f"sequence-parallel ranks do): --seq-len {self.seq_len} must be "
                              "divisible by it")
        for flag, on in (("--dtype bf16", self.dtype == "bf16"),
                         ("--recompute full", self.recompute == "full")):
            if on:
                raise ConfigError(f"--moe-experts with {flag} is not built yet (MoE in the "
                                  "main job: docs/moe.md)")

    def _validate_data(self) -> None:
        if self.data is None:
            return
        if not os.path.exists(self.data):
            raise ConfigError(f"--data {self.data}: no such file")
        if os.path.isdir(self.data):
            raise ConfigError(f"--data {self.data} is a directory; give a text file")
        try:
            size = os.path.getsize(self.data)
            with open(self.data, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"--data {self.data}: cannot read it ({exc.strerror})") from None
        if size == 0:
            raise ConfigError(f"--data {self.data} is empty")
        if size < self.seq_len + 2:
            raise ConfigError(f"--data {self.data} has {size} bytes (tokens); --seq-len "
                              f"{self.seq_len} needs at least seq_len + 2 = {self.seq_len + 2}")

    def _validate_checkpoints(self) -> None:
        from overlap.train.checkpoint import latest_checkpoint

        if self.save is not None and os.path.exists(self.save) and not os.path.isdir(self.save):
            raise ConfigError(f"--save {self.save} exists and is not a directory")
        if self.export is not None:
            if self.resume is None:
                raise ConfigError(f"--export {self.export} needs --resume DIR (the checkpoint "
                                  "to convert)")
            parent = os.path.dirname(os.path.abspath(self.export))
            if not os.path.isdir(parent):
                raise ConfigError(f"--export {self.export}: directory {parent} does not exist")
        if self.resume is not None:
            if not os.path.isdir(self.resume):
                raise ConfigError(f"--resume {self.resume}: no such directory")
            if latest_checkpoint(self.resume) is None:
                raise ConfigError(f"--resume {self.resume}: no complete checkpoint in it (a "
                                  "step_<N> directory with DCP .metadata)")
        if self.compare_ep_overlap:
            if self.compare_no_overlap:
                raise ConfigError("--compare-ep-overlap and --compare-no-overlap each run a "
                                  "second job beside the main one; pass one of them")
            if self.ep == 1 or not self.ep_pipeline_overlap:
                raise ConfigError("--compare-ep-overlap compares the in-schedule EP overlap "
                                  "with none: it needs --ep > 1 and --ep-pipeline-overlap")
        if self.compare_no_overlap or self.compare_ep_overlap:
            which = "--compare-ep-overlap" if self.compare_ep_overlap else "--compare-no-overlap"
            for flag, on in (("--save", self.save), ("--resume", self.resume),
                             ("--profile", self.profile), ("--check", self.check),
                             ("--max-restarts", self.max_restarts),
                             ("--tp-backend unfused", self.tp_backend == "unfused")):
                if on:
                    raise ConfigError(f"{which} measures two runs side by side; "
                                      f"it does not combine with {flag}")
        self._validate_elastic()
        if self.max_restarts and self.save is None:
            raise ConfigError(f"--max-restarts {self.max_restarts} needs --save DIR: a restart "
                              "continues from the latest checkpoint written there")

    def _validate_elastic(self) -> None:
        if self.min_nodes or self.grow_back:
            flag = f"--min-nodes {self.min_nodes}" if self.min_nodes else "--grow-back"
            if not self.min_nodes:
                raise ConfigError("--grow-back returns to the full layout after a shrink: it "
                                  "needs --min-nodes N")
            torchrun = "TORCHELASTIC_RESTART_COUNT" in os.environ  # its own --max-restarts
            if self.save is None or not (self.max_restarts or torchrun):
                raise ConfigError(f"{flag} continues from the latest checkpoint after a lost "
                                  "node: it needs --save DIR and --max-restarts K >= 1")
            nodes = self.world_size // self.node_size
            if self.min_nodes >= nodes and not os.environ.get("LOCAL_WORLD_SIZE"):
                raise ConfigError(f"{flag}: the job has {nodes} node(s) of "
                                  f"{self.node_size} ranks (--ranks-per-node), so "
                                  "losing one always leaves fewer than --min-nodes; pass "
                                  "--ranks-per-node and a smaller --min-nodes")
            from overlap.plan.profiles import load_profile

            try:
                load_profile(self.plan_profile)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--plan-profile {self.plan_profile}: {exc}") from None


def _check_number(name: str, v: float, *, low: float, high: float | None = None,
                  low_open: bool = False, high_open: bool = False) -> None:
    flag = "--" + name.replace("_", "-")
    ok = isinstance(v, (int, float)) and math.isfinite(v) and \
        (v > low if low_open else v >= low) and \
        (high is None or (v < high if high_open else v <= high))
    if not ok:
        lo = f"{'>' if low_open else '>='} {low:g}"
        hi = "" if high is None else f" and {'<' if high_open else '<='} {high:g}"
        raise ConfigError(f"{flag} must be a finite number {lo}{hi}, got {v}")


_PROG = "overlap-train"
_DESCRIPTION = ("Train a small GPT with tensor x context x pipeline x data (x expert) "
                "parallelism and every communication overlap on. Without torchrun it starts "
                "tp*cp*pp*dp local CPU processes itself.")


_GROUPS = (
    ("layout (tp x pp x dp; --cp and --ep below)",
     ("tp", "pp", "dp", "schedule", "virtual_stages", "micro_batches")),
    ("model", ("n_layer", "d_model", "n_head", "dropout", "dtype", "seed")),
    ("data", ("data", "seq_len", "micro_batch_size")),
    ("optimizer", ("steps", "lr", "lr_schedule", "warmup_steps", "min_lr_ratio", "adam_eps",
                   "weight_decay", "clip_grad", "sharded_optimizer")),
    ("communication", ("sequence_parallel", "tp_backend", "comm_dtype", "bucket_mb")),
    ("MoE (mixture of experts)", ("ep", "moe_experts", "moe_top_k", "moe_shared_experts",
                                  "moe_every", "capacity_factor", "moe_aux_coef", "ep_backend",
                                  "ep_pipeline_overlap")),
    ("CP (context parallelism)", ("cp", "cp_method")),
    ("memory", ("recompute", "offload_activations")),
    ("checkpoints and faults", ("save", "save_every", "resume", "export", "max_restarts",
                                "min_nodes", "grow_back", "plan_profile", "heartbeat_timeout")),
    ("checks and profiling", ("check", "check_tolerance", "compare_no_overlap",
                              "compare_ep_overlap", "profile", "log_json")),
    ("launch", ("ranks_per_node", "ranks_per_gpu", "transport", "timeout")),
)
# Each command line parses and validates (tests/test_cli_output.py; --resume needs a checkpoint).
EXAMPLES = """\
examples:
  overlap-train                                # tp 2 x pp 2 x dp 2: 8 local ranks, 30 steps
  overlap-train --check                        # also train on one process, compare losses
  overlap-train --schedule zb-h1 --dtype bf16
  overlap-train --schedule interleaved --virtual-stages 2 --recompute selective
  overlap-train --ep 2 --moe-experts 8 --schedule interleaved   # MoE, EP pairs in the schedule
  overlap-train --cp 2 --dp 1 --cp-method ulysses               # context parallelism
  overlap-train --steps 6 --profile runs/prof  # traces, a PNG timeline, overlap metrics
  overlap-train --save runs/ck --max-restarts 1                 # restart from a checkpoint
  overlap-train --resume runs/ck --steps 40                     # continue, any layout
  torchrun --nproc-per-node 8 -m overlap.train --tp 2 --pp 2 --dp 2   # on 8 GPUs (NCCL)
schedule names: gpipe, 1f1b, interleaved, zb-h1; interleaved_1f1b and zb_h1 (the library's) too,
in any case.
"""


def _layout() -> dict:
    return {"groups": _GROUPS, "epilog": EXAMPLES}


def build_parser() -> "argparse.ArgumentParser":
    return cli.build_parser(TrainConfig, prog=_PROG, description=_DESCRIPTION, **_layout())


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and validate; a bad value exits with status 2 and a one-line message."""
    return cli.parse(TrainConfig, argv, prog=_PROG, description=_DESCRIPTION,
                     errors=(ConfigError,), **_layout())


# Settings a rank may hold on its own: paths (a node's own mount of the same files), what only
# rank 0 writes, the local launcher's options, a node's placement on its GPUs, and the
# test-only fault injection.
_PER_RANK = ("data", "save", "resume", "export", "profile", "log_json", "timeout", "transport",
             "ranks_per_gpu", "kill_rank", "kill_at_step", "kill_node")


def shared_settings(cfg: TrainConfig) -> dict:
    """The settings every rank of a job must hold alike (all but ``_PER_RANK``)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in _PER_RANK}


def agree_across_ranks(what: str, values: dict, device) -> None:
    """The same ConfigError on every rank if ranks hold different ``values`` (one all-gather of
    a digest: ``overlap.dist.stamp.agree_on``). Under torchrun or srun each rank parses its own
    command line, so a per-node difference would otherwise train silently apart."""
    from overlap.dist.stamp import agree_on

    agree_on(what, values, device, error=ConfigError)
