"""A layout (tp x cp x pp x dp, ep for MoE): how a model is cut over a cluster, and what the
runtime overlaps.

``Layout.check(model, cluster)`` raises a ValueError naming the flag for every choice that
cannot work (tp not dividing the heads, gpus not divisible by tp*pp*cp, a batch that does not
split into micro-batches, ep not dividing dp*cp or the experts, ...), before anything is
estimated. EP is carved out of the dp x cp ranks, as ``overlap.dist.ParallelDims`` does. CP
needs the sequence divisible by 2*cp (zig-zag) and Ulysses heads that split over cp. Offloading
needs none, all or a block count, and a device with a host link.
"""

from __future__ import annotations

import dataclasses

from overlap.plan.hardware import ClusterSpec
from overlap.plan.models import ModelSpec

__all__ = ["Layout", "Overlap", "SCHEDULES", "RECOMPUTE", "COMM_DTYPES", "WIRE_BYTES",
           "EP_DISPATCH", "CP_METHODS", "ulysses_error"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
COMM_DTYPES = ("fp32", "bf16", "int8")
# Bytes per element on the wire. int8: one code per element plus one fp32 scale per block of
# 128 (overlap.comm.quant), 1 + 4/128 bytes.
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 128}
EP_DISPATCH = ("bf16", "int8")  # the MoE forward dispatch's wire dtype (EPComm(dispatch=))
CP_METHODS = ("ring", "allgather", "ulysses")  # Layout.cp_method also takes "auto"


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Overlap:
    """Which communication the runtime hides under compute.

    The defaults are this runtime's mechanisms: fused TP comm+GEMM ops, bucketed DP reduction
    under the backward (and parameter all-gathers under the next forward), P2P under the
    neighbouring compute. ``Overlap.none()`` is a runtime that waits for every transfer, such as
    the Megatron-LM of Narayanan et al. 2021 that the calibration runs used.

    MoE: ``ep`` hides the dispatch/combine all-to-all under the expert GEMMs in
    ``Layout.ep_chunks`` pieces (the chunked exchange, ``overlap.moe.exchange``); ``ep_schedule``
    (pp > 1) hides what is left under another micro-batch's compute in the 1F1B steady state.
    CP: ``cp`` hides the ring's hops under the attention blocks and the all-gather under the
    local block (``overlap.plan.cp``)."""

    tp: bool = True
    dp: bool = True
    pp: bool = True
    ep: bool = True
    ep_schedule: bool = True
    cp: bool = True

    @classmethod
    def none(cls) -> "Overlap":
        return cls(tp=False, dp=False, pp=False, ep=False, ep_schedule=False, cp=False)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    """Degrees, batch split, schedule and memory savers. ``flash_attention`` (default on, as
    torch's scaled_dot_product_attention on GPUs) never stores or streams the s x s scores; off
    reproduces the unfused attention that Korthikanti et al. and Narayanan et al. measured.
    ``dtype_bytes`` is the element size of weights and activations: 2 (bf16) on GPUs, 4 for the
    fp32 CPU twin.

    MoE models: ``ep`` ranks of the dp x cp ones split the experts; ``capacity_factor`` None is
    dropless (exact routed rows; the slowest EP rank gets ``moe_imbalance`` times the mean), a
    number pads every (rank, expert) to ``ceil(cf * T * k / E)`` slots on the wire and in the
    GEMMs; ``ep_dispatch`` is the forward dispatch's wire dtype; ``ep_chunks`` the pieces of the
    chunked exchange; ``ep_node_dedup`` sends a token once per remote node (DeepEP, which the
    calibration runs used; this runtime's exchange sends every routed row).

    ``cp_method``: how attention reaches the other CP ranks' keys and values, "ring",
    "allgather", "ulysses" or "auto" (``estimate`` picks the one with the lowest step time).

    ``offload``: activation offloading (``overlap.memory.ActivationOffloader``), "none", "all"
    or a number N as a string: the first N transformer blocks of every pipeline chunk copy what
    they save to host memory (``overlap.plan.offload``)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_method: str = "auto"
    ep: int = 1
    capacity_factor: float | None = None
    moe_imbalance: float = 1.0
    ep_dispatch: str = "bf16"
    ep_chunks: int = 2
    ep_node_dedup: bool = False
    global_batch: int
    micro_batch: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "selective"
    sequence_parallel: bool = False
    flash_attention: bool = True
    zero: int = 1
    comm_dtype: str = "bf16"
    fp32_main_grads: bool = True
    dtype_bytes: int = 2
    bucket_bytes: float = 25 * 2**20
    overlap: Overlap = Overlap()
    offload: str = "none"

    # ------------------------------------------------------------------ derived
    def dp(self, cluster: ClusterSpec) -> int:
        return cluster.num_gpus // (self.tp * self.pp * self.cp)

    def edp(self, cluster: ClusterSpec) -> int:
        """Expert-data-parallel size: the ranks holding the same experts."""
        return self.dp(cluster) * self.cp // self.ep

    def num_microbatches(self, cluster: ClusterSpec) -> int:
        return self.global_batch // (self.dp(cluster) * self.micro_batch)

    @property
    def num_virtual(self) -> int:
        return self.virtual if self.schedule == "interleaved" else 1

    @property
    def num_chunks(self) -> int:
        return self.pp * self.num_virtual

    def chunk_layers(self, model: ModelSpec) -> list[int]:
        """Layers per model chunk (stage), in stage order; spread as evenly as possible."""
        n, c = model.num_layers, self.num_chunks
        return [n // c + (1 if i < n % c else 0) for i in range(c)]

    def chunk_moe_layers(self, model: ModelSpec) -> list[int]:
        """MoE layers per model chunk (chunks hold consecutive layers, in stage order)."""
        out, start = [], 0
        for n in self.chunk_layers(model):
            out.append(model.num_moe_layers(start, start + n))
            start += n
        return out

    def rank_chunks(self, rank: int) -> list[int]:
        """The stages a pipeline rank holds (looping placement, as ``overlap.pp``)."""
        return [rank + j * self.pp for j in range(self.num_virtual)]

    # ------------------------------------------------------------------ validation
    def check(self, model: ModelSpec, cluster: ClusterSpec) -> None:
        for arg in ("tp", "pp", "cp", "ep", "global_batch", "micro_batch", "virtual",
                    "ep_chunks"):
            v = getattr(self, arg)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{arg.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule {self.schedule!r} is unknown; expected one of "
                             f"{list(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute {self.recompute!r} is unknown; expected one of "
                             f"{list(RECOMPUTE)}")
        if self.comm_dtype not in COMM_DTYPES:
            raise ValueError(f"--comm-dtype {self.comm_dtype!r} is unknown; expected one of "
                             f"{list(COMM_DTYPES)}")
        if self.ep_dispatch not in EP_DISPATCH:
            raise ValueError(f"--ep-dispatch {self.ep_dispatch!r} is unknown; expected one of "
                             f"{list(EP_DISPATCH)}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"--capacity-factor must be > 0 (or dropless), got "
                             f"{self.capacity_factor!r}")
        if not self.moe_imbalance >= 1.0:
            raise ValueError(f"--moe-imbalance must be >= 1 (the slowest EP rank's share of "
                             f"the mean), got {self.moe_imbalance!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.virtual > 1 and self.schedule != "interleaved":
            raise ValueError(f"--virtual {self.virtual} needs --schedule interleaved (the other "
                             "schedules run one model chunk per pipeline rank)")
        if self.schedule == "zb-h1" and self.recompute == "full":
            raise ValueError("--schedule zb-h1 with --recompute full is not modelled: the "
                             "split backward needs the stored activations")
        model_parallel = self.tp * self.pp * self.cp
        if cluster.num_gpus % model_parallel:
            raise ValueError(f"--gpus {cluster.num_gpus} is not divisible by --tp {self.tp} x "
                             f"--pp {self.pp} x --cp {self.cp} = {model_parallel}")
        if model.num_heads % self.tp:
            raise ValueError(f"--tp {self.tp} does not divide --heads {model.num_heads}: each "
                             "tensor-parallel rank needs whole heads")
        if model.kv_heads % self.tp and self.tp % model.kv_heads:
            raise ValueError(f"--tp {self.tp} and --kv-heads {model.kv_heads}: one must divide "
                             "the other (whole key/value heads per rank, or replicated ones)")
        if model.ffn_dim % self.tp or model.vocab % self.tp:
            raise ValueError(f"--tp {self.tp} must divide --ffn {model.ffn_dim} and --vocab "
                             f"{model.vocab}")
        if model.seq_len % self.cp:
            raise ValueError(f"--cp {self.cp} does not divide --seq {model.seq_len}")
        if self.cp > 1 and model.seq_len % (2 * self.cp):
            raise ValueError(f"--seq {model.seq_len} is not divisible by 2 x --cp {self.cp} = "
                             f"{2 * self.cp}: zig-zag gives every CP rank two equal chunks")
        if self.cp_method not in CP_METHODS + ("auto",):
            raise ValueError(f"--cp-method {self.cp_method!r} is unknown; expected one of "
                             f"{list(CP_METHODS + ('auto',))}")
        if self.cp > 1 and self.cp_method == "ulysses":
            why = ulysses_error(model, self.tp, self.cp)
            if why:
                raise ValueError(why)
        self.check_offload(model, cluster)
        if self.sequence_parallel and (model.seq_len // self.cp) % self.tp:
            raise ValueError(f"--sequence-parallel splits the {model.seq_len // self.cp} tokens "
                             f"of a sequence over --tp {self.tp}: it must divide them")
        if model.num_layers < self.num_chunks:
            raise ValueError(f"--layers {model.num_layers} is less than --pp {self.pp} x "
                             f"--virtual {self.num_virtual} stages: every stage needs a layer")
        dp = self.dp(cluster)
        if self.ep > 1 and not model.is_moe:
            raise ValueError(f"--ep {self.ep} needs a mixture-of-experts model; "
                             f"{model.name} is dense")
        if (dp * self.cp) % self.ep:
            raise ValueError(f"--ep {self.ep} must divide data parallel x --cp = {dp} x "
                             f"{self.cp} = {dp * self.cp} (EP is carved out of those ranks)")
        if model.is_moe and model.num_experts % self.ep:
            raise ValueError(f"--ep {self.ep} does not divide the {model.num_experts} experts: "
                             "every EP rank holds the same number")
        if self.global_batch % (dp * self.micro_batch):
            raise ValueError(f"--global-batch {self.global_batch} is not divisible by data "
                             f"parallel {dp} x --micro-batch {self.micro_batch}")
        m = self.num_microbatches(cluster)
        if m < self.pp:
            raise ValueError(f"{m} micro-batches per pipeline (--global-batch / (dp x "
                             f"--micro-batch)) is fewer than --pp {self.pp}: stages would idle")
        if self.schedule == "interleaved" and m % self.pp:
            raise ValueError(f"--schedule interleaved needs the {m} micro-batches per pipeline "
                             f"to be a multiple of --pp {self.pp}")


    def check_offload(self, model: ModelSpec, cluster: ClusterSpec) -> None:
        """``offload`` is none, all or a block count, and the device has a host link."""
        v = self.offload
        if v == "none":
            return
        if v != "all":
            if not (isinstance(v, str) and v.isdigit() and int(v) >= 1):
                raise ValueError(f"--offload-activations must be none, all or a positive number "
                                 f"of blocks per pipeline chunk, got {v!r}")
            if int(v) > model.num_layers:
                raise ValueError(f"--offload-activations {v} is more than the "
                                 f"{model.num_layers} layers (--layers)")
        if cluster.device.host_link is None:
            raise ValueError(f"--offload-activations {v} needs the GPU's host link: the profile "
                             f"{cluster.device.name!r} has none (give --host-bandwidth)")


def ulysses_error(model: ModelSpec, tp: int, cp: int) -> str | None:
    """Why Ulysses cannot run at (tp, cp), or None. Its all-to-all trades the sequence for heads
    (``overlap.cp.ulysses_fits``): a TP rank's query heads must split over cp, and its kv heads
    too, or divide cp (then they are repeated)."""
    heads, kv = model.num_heads // tp, max(1, model.kv_heads // tp)
    if heads % cp:
        return (f"--cp-method ulysses needs the {heads} query heads of a TP rank (--heads "
                f"{model.num_heads} / --tp {tp}) divisible by --cp {cp}")
    if kv % cp and cp % kv:
        return (f"--cp-method ulysses needs the {kv} key/value heads of a TP rank (--kv-heads "
                f"{model.kv_heads} / --tp {tp}) divisible by --cp {cp} or dividing it")
    return None
