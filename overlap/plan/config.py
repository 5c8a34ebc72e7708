"""PlanConfig: the one definition of ``overlap-plan``'s settings; the CLI is generated from it.

Validation happens here and in ``Layout.check`` and names the flag: a named model that does not
exist, a shape flag missing without ``--model``, ``--tp`` not dividing the heads, ``--gpus`` not
divisible by ``--tp x --pp x --cp``, ``--ep`` on a dense model, and so on, each a one-line
error.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from overlap import cli
from overlap.plan.hardware import ClusterSpec, DeviceProfile, LinkSpec
from overlap.plan.layout import (COMM_DTYPES, CP_METHODS, EP_DISPATCH, RECOMPUTE, SCHEDULES,
                                 Layout, Overlap)
from overlap.plan.models import MODELS, ModelSpec, get_model
from overlap.plan.profiles import PROFILES, get_profile
from overlap.pp.schedules import SCHEDULE_ALIASES

__all__ = ["PlanConfig", "build_parser", "parse_args"]


_field = cli.field


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanConfig:
    model: str | None = _field(None, "a named model (its shape flags may still be overridden)",
                               choices=sorted(MODELS))
    layers: int | None = _field(None, "transformer layers L")
    hidden: int | None = _field(None, "hidden size h")
    heads: int | None = _field(None, "attention heads a")
    kv_heads: int | None = _field(None, "key/value heads (grouped-query attention)")
    ffn: int | None = _field(None, "MLP width (default 4h)")
    vocab: int | None = _field(None, "vocabulary size V")
    seq: int | None = _field(None, "sequence length s")
    global_batch: int | None = _field(None, "sequences per optimizer step")
    micro_batch: int = _field(1, "sequences per micro-batch")
    gpus: int | None = _field(None, "number of GPUs")
    gpu: str = _field("a100-80g", "GPU profile", choices=sorted(PROFILES))
    profile: str | None = _field(None, "a device profile JSON (from --calibrate) instead of --gpu",
                                  metavar="FILE")
    gpus_per_node: int = _field(8, "GPUs per node (NVLink domain)")
    tp: int = _field(1, "tensor-parallel degree")
    pp: int = _field(1, "pipeline-parallel degree")
    cp: int = _field(1, "context-parallel degree (--search: 1 tries every valid cp, N > 1 "
                        "only N)")
    cp_method: str = _field("auto", "context-parallel attention: ring (KV hops under the "
                                    "attention blocks), allgather (KV gathered), ulysses "
                                    "(all-to-all heads <-> sequence), auto (the lowest step "
                                    "time)", choices=CP_METHODS + ("auto",))
    ep: int = _field(1, "expert-parallel degree (MoE models; carved out of dp x cp; --search: "
                        "1 tries every valid ep, N > 1 only N)")
    capacity_factor: float | None = _field(None, "MoE capacity factor (default: dropless)")
    moe_imbalance: float = _field(1.0, "dropless MoE: the busiest EP rank's rows over the mean "
                                  "(1.47 reproduces Megatron-Core's dropless Qwen3-235B runs)")
    ep_dispatch: str = _field("bf16", "MoE forward dispatch wire dtype", choices=EP_DISPATCH)
    ep_chunks: int = _field(2, "pieces of the chunked MoE exchange")
    ep_overlap: bool = _field(True, "hide the MoE all-to-all under the expert GEMMs (chunked)")
    ep_schedule_overlap: bool = _field(True, "pp > 1: hide the rest of the MoE all-to-all "
                                             "under another micro-batch's compute")
    virtual: int = _field(1, "model chunks per pipeline rank (--schedule interleaved)")
    schedule: str = _field("1f1b", "pipeline schedule", choices=SCHEDULES,
                           aliases=SCHEDULE_ALIASES)
    recompute: str = _field("selective", "activation recomputation", choices=RECOMPUTE)
    sequence_parallel: bool = _field(False, "sequence-parallel TP (activations sharded over tp)")
    flash_attention: bool = _field(True, "attention never materialises the s x s scores")
    zero: int = _field(1, "ZeRO stage over the data-parallel ranks", choices=(0, 1, 2, 3))
    comm_dtype: str = _field("bf16", "data-parallel gradient wire dtype", choices=COMM_DTYPES)
    overlap: bool = _field(True, "this runtime's overlaps (fused TP ops, DP under backward, "
                                 "P2P under compute); --no-overlap waits for every transfer")
    offload_activations: str = _field("none", "copy what transformer blocks save for the "
                                               "backward to host memory and reload it one block "
                                               "ahead: none, all, or N (the first N blocks of "
                                               "each pipeline chunk); --search: none tries all, "
                                               "all-but-one and half where a layout does not fit "
                                               "without, all or N only that",
                                  metavar="{none,all,N}")
    host_bandwidth: float | None = _field(None, "GB/s per direction between a GPU and host "
                                                "memory, achieved (default: the profile's PCIe "
                                                "link; e.g. 450 for GH200's NVLink-C2C)",
                                           metavar="GB/S")
    search_offload: bool = _field(True, "--search: try offloading where a layout does not fit "
                                        "without (--no-search-offload: never)")
    memory_fraction: float = _field(0.9, "share of GPU memory a layout may use (the rest: "
                                         "CUDA context, communication buffers, fragmentation); "
                                         "with offloading also of the node's host memory")
    json: bool = _field(False, "print one JSON object")
    search: bool = _field(False, "search layouts for --gpus and --global-batch; rank those "
                                 "that fit")
    top: int = _field(15, "rows of the --search table")
    explain: bool = _field(False, "show the formulas with the numbers substituted")
    calibrate: bool = _field(False, "measure this machine and write a profile to --output")
    ranks: int = _field(8, "--calibrate: local ranks of the jobs to predict")
    output: str = _field("overlap-plan-profile.json", "--calibrate: where to write the profile",
                         metavar="FILE")

    # ------------------------------------------------------------------ builders
    def model_spec(self) -> ModelSpec:
        shape = {"num_layers": self.layers, "hidden": self.hidden, "num_heads": self.heads,
                 "num_kv_heads": self.kv_heads, "ffn": self.ffn, "vocab": self.vocab,
                 "seq_len": self.seq}
        given = {k: v for k, v in shape.items() if v is not None}
        if self.model is not None:
            base = get_model(self.model)
            if not given:
                return base
            return dataclasses.replace(base, name=f"{base.name} (modified)", **given)
        missing = [flag for flag, key in (("--layers", "num_layers"), ("--hidden", "hidden"),
                                          ("--heads", "num_heads"), ("--vocab", "vocab"),
                                          ("--seq", "seq_len")) if key not in given]
        if missing:
            raise ValueError(f"give --model or the model shape: missing {' '.join(missing)}")
        return ModelSpec(**given)

    def device(self) -> DeviceProfile:
        dev = DeviceProfile.load(self.profile) if self.profile else get_profile(self.gpu)
        if self.host_bandwidth is None:
            return dev
        if not self.host_bandwidth > 0:
            raise ValueError(f"--host-bandwidth must be > 0 GB/s, got {self.host_bandwidth}")
        link = LinkSpec(bandwidth=self.host_bandwidth * 1e9, latency_s=0.0)
        return dev.replace(host_link=link, sources={
            **dev.sources, "host_link.bandwidth": f"--host-bandwidth {self.host_bandwidth:g}",
            "host_link.efficiency": "--host-bandwidth is the achieved bandwidth"})

    def cluster(self) -> ClusterSpec:
        if self.gpus is None:
            raise ValueError("--gpus is required")
        dev = self.device()
        if self.profile and dev.host_cores is not None and self.gpus <= self.gpus_per_node:
            return ClusterSpec.local(dev, self.gpus)  # a CPU profile: local ranks share cores
        return ClusterSpec(device=dev, num_gpus=self.gpus, gpus_per_node=self.gpus_per_node)

    def layout(self) -> Layout:
        if self.global_batch is None:
            raise ValueError("--global-batch is required")
        return Layout(tp=self.tp, pp=self.pp, cp=self.cp, cp_method=self.cp_method, ep=self.ep,
                      global_batch=self.global_batch,
                      micro_batch=self.micro_batch, schedule=self.schedule,
                      virtual=self.virtual, recompute=self.recompute,
                      sequence_parallel=self.sequence_parallel,
                      flash_attention=self.flash_attention, zero=self.zero,
                      comm_dtype=self.comm_dtype, capacity_factor=self.capacity_factor,
                      moe_imbalance=self.moe_imbalance, ep_dispatch=self.ep_dispatch,
                      ep_chunks=self.ep_chunks, overlap=self.overlap_modes(),
                      offload=self.offload_activations)

    def search_offload_modes(self) -> tuple[str, ...] | None:
        """``Constraints.offload`` for --search."""
        if self.offload_activations != "none":
            return (self.offload_activations,)
        return None if self.search_offload else ("none",)

    def overlap_modes(self) -> Overlap:
        if not self.overlap:
            return Overlap.none()
        return Overlap(ep=self.ep_overlap, ep_schedule=self.ep_schedule_overlap)

    def validate(self) -> None:
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"--memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if self.top < 1:
            raise ValueError(f"--top must be >= 1, got {self.top}")
        if self.calibrate:
            return
        model = self.model_spec()
        cluster = self.cluster()
        layout = self.layout()
        if self.ep > 1 and not model.is_moe:
            raise ValueError(f"--ep {self.ep} needs a mixture-of-experts model; {model.name} "
                             "is dense")
        if not self.search:
            layout.check(model, cluster)
        else:
            layout.check_offload(model, cluster)


_PROG = "overlap-plan"
_DESCRIPTION = ("Predict memory, pipeline bubble, communication and step time of a layout "
                "(tp x cp x pp x dp, with ep for MoE models; --search: find the best one), or "
                "--calibrate this machine.")
_GROUPS = (
    ("what to print", ("search", "top", "explain", "json")),
    ("model", ("model", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")),
    ("cluster", ("gpus", "gpu", "profile", "gpus_per_node", "host_bandwidth",
                 "memory_fraction")),
    ("layout", ("global_batch", "micro_batch", "tp", "pp", "schedule", "virtual")),
    ("communication", ("sequence_parallel", "comm_dtype", "overlap", "zero")),
    ("MoE (mixture of experts)", ("ep", "capacity_factor", "moe_imbalance", "ep_dispatch",
                                  "ep_chunks", "ep_overlap", "ep_schedule_overlap")),
    ("CP (context parallelism)", ("cp", "cp_method")),
    ("memory", ("recompute", "flash_attention", "offload_activations", "search_offload")),
    ("calibration", ("calibrate", "ranks", "output")),
)
# Each planner setting whose default differs from overlap-train's -> that job's flag and default:
# the planner models a production-size GPU job, overlap-train's defaults suit its small CPU demo.
# Spelled here because the plan layer sits below train; tests/test_cli_output.py holds them to
# TrainConfig's.
TRAIN_DEFAULTS = {"sequence_parallel": ("sequence_parallel", True),
                  "recompute": ("recompute", "none"), "comm_dtype": ("comm_dtype", "fp32"),
                  "gpu": ("plan_profile", "h100-sxm"), "cp_method": ("cp_method", "ring"),
                  "virtual": ("virtual_stages", 2)}
EXAMPLES = """\
examples:
  overlap-plan --model gpt3-175b --gpus 512 --gpu a100-80g --tp 8 --pp 8 \\
      --global-batch 1536 --micro-batch 1 --json
  overlap-plan --model llama3-70b --gpus 1024 --gpu h100-sxm --global-batch 512 --search
  overlap-plan --model mixtral-8x7b --gpus 64 --gpu h100-sxm --global-batch 1024 --search
  overlap-plan --model llama3-8b --seq 131072 --gpus 16 --gpu h100-sxm --global-batch 16 \\
      --search                                 # picks cp > 1: cp 1 does not fit
  overlap-plan --model llama3-8b --seq 131072 --gpus 16 --gpu h100-sxm --global-batch 16 \\
      --tp 8 --sequence-parallel --offload-activations 31   # activations to host memory
  overlap-plan --model gpt3-175b --gpus 512 --tp 8 --pp 8 --global-batch 1536 \\
      --schedule zb-h1 --explain               # the formulas with the numbers
  overlap-plan --calibrate --output local.json  # then: --profile local.json --gpus 8 ...
schedule names: gpipe, 1f1b, interleaved, zb-h1; interleaved_1f1b and zb_h1 (the library's) too,
in any case.
"""


def _train_notes() -> dict[str, str]:
    def shown(v: object) -> str:
        return ("on" if v else "off") if isinstance(v, bool) else str(v)

    return {mine: f"overlap-train's --{flag.replace('_', '-')} defaults to {shown(default)}"
            for mine, (flag, default) in TRAIN_DEFAULTS.items()}


def _layout() -> dict:
    notes = _train_notes()
    flags = ", ".join("--" + k.replace("_", "-") for k in notes)
    epilog = EXAMPLES + textwrap.fill(f"defaults unlike overlap-train's (the planner models a "
                                      f"production-size job, not its CPU demo): {flags}; each "
                                      "flag's line says how.", 78,
                                      break_on_hyphens=False) + "\n"
    return {"groups": _GROUPS, "epilog": epilog, "notes": notes}


def build_parser() -> "argparse.ArgumentParser":
    return cli.build_parser(PlanConfig, prog=_PROG, description=_DESCRIPTION, **_layout())


def parse_args(argv: list[str] | None = None) -> PlanConfig:
    """Parse and validate; a bad value exits with status 2 and a one-line message."""
    return cli.parse(PlanConfig, argv, prog=_PROG, description=_DESCRIPTION,
                     errors=(ValueError,), **_layout())
