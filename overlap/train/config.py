"""TrainConfig: the one definition of the demo's settings. The CLI is generated from it.

Validation happens here, before any process starts, so a bad flag costs a one-line error and
not a hung 8-process job.
"""

from __future__ import annotations

import argparse
import dataclasses

from overlap import cli
from overlap.comm.quant.checks import COMM_DTYPES  # the one vocabulary: "fp32", "bf16", "int8"

__all__ = ["TrainConfig", "ConfigError", "parse_args"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
TP_BACKENDS = ("auto", "chunked", "symmetric", "triton")
TRANSPORTS = ("nccl_twin", "gloo")
VOCAB_SIZE = 256  # byte-level tokenizer


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line naming the flag(s)."""


_field = cli.field


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    tp: int = _field(2, "tensor-parallel degree (innermost: consecutive ranks)")
    pp: int = _field(2, "pipeline-parallel degree (stages)")
    dp: int = _field(2, "data-parallel degree")
    schedule: str = _field("1f1b", "pipeline schedule", choices=SCHEDULES)
    virtual_stages: int = _field(2, "model chunks per pipeline rank (interleaved schedule only)")
    micro_batches: int = _field(4, "micro-batches per step and data-parallel rank")
    micro_batch_size: int = _field(4, "sequences per micro-batch")
    seq_len: int = _field(64, "tokens per sequence")
    n_layer: int = _field(4, "transformer blocks")
    d_model: int = _field(64, "hidden size")
    n_head: int = _field(4, "attention heads")
    steps: int = _field(30, "optimizer steps")
    lr: float = _field(3e-3, "AdamW learning rate")
    weight_decay: float = _field(0.0, "AdamW weight decay")
    seed: int = _field(0, "seed for the model init and the data order")
    sequence_parallel: bool = _field(True, "sequence-parallel TP layers (fused AG-GEMM / GEMM-RS)")
    tp_backend: str = _field("auto", "fused TP op backend", choices=TP_BACKENDS)
    comm_dtype: str = _field("fp32", "data-parallel gradient wire dtype", choices=COMM_DTYPES)
    bucket_mb: float = _field(0.25, "gradient bucket size in MiB (small: the demo model is "
                                    "small, and several buckets show the overlap)")
    sharded_optimizer: bool = _field(True, "ZeRO-style sharded optimizer over the dp axis")
    check: bool = _field(False, "also train the same model on one process and compare losses")
    check_tolerance: float = _field(2e-3, "max |loss difference| per step allowed by --check")
    profile: str | None = _field(None, "write torch.profiler traces, a PNG timeline and overlap "
                                       "metrics to this directory")
    data: str | None = _field(None, "text file to train on (default: the bundled corpus)")
    timeout: float = _field(600.0, "seconds before a hung local job is killed")
    transport: str = _field("nccl_twin", "local CPU processes only: nccl_twin is gloo with "
                                         "NCCL's ordering rules (an order that would hang on "
                                         "GPUs hangs here too, and is reported); gloo is looser",
                            choices=TRANSPORTS)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * (self.virtual_stages if self.schedule == "interleaved" else 1)

    def validate(self) -> None:
        """Raise ConfigError (one line) for settings that cannot work."""
        for name in ("tp", "pp", "dp", "virtual_stages", "micro_batches", "micro_batch_size",
                     "seq_len", "n_layer", "d_model", "n_head", "steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
        from overlap.dist.dims import ParallelDims

        try:
            ParallelDims.resolve(world_size=self.world_size, tp=self.tp, pp=self.pp, dp=self.dp,
                                 ranks_per_node=max(self.tp, self.world_size))
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
        if self.sequence_parallel and (self.micro_batch_size * self.seq_len) % self.tp:
            raise ConfigError(f"sequence parallelism splits the {self.seq_len} tokens of each "
                              f"sequence over --tp {self.tp}: --seq-len must be divisible by it")
        if self.n_layer < self.num_stages:
            raise ConfigError(f"--n-layer {self.n_layer} is less than the {self.num_stages} "
                              "pipeline stages (pp x virtual stages): every stage needs a layer")
        if self.micro_batches < self.pp:
            raise ConfigError(f"--micro-batches {self.micro_batches} must be >= --pp {self.pp} "
                              "so every stage has work in the steady state")
        if self.schedule == "interleaved" and self.micro_batches % self.pp:
            raise ConfigError(f"the interleaved schedule needs --micro-batches "
                              f"({self.micro_batches}) to be a multiple of --pp ({self.pp})")
        if self.bucket_mb < 0:
            raise ConfigError(f"--bucket-mb must be >= 0, got {self.bucket_mb}")
        if self.timeout <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.check_tolerance <= 0:
            raise ConfigError(f"--check-tolerance must be > 0, got {self.check_tolerance}")


_PROG = "overlap-train"
_DESCRIPTION = ("Train a small GPT with tensor x pipeline x data parallelism and every "
                "communication overlap on. Without torchrun it starts tp*pp*dp local CPU "
                "processes itself.")


def build_parser() -> "argparse.ArgumentParser":
    return cli.build_parser(TrainConfig, prog=_PROG, description=_DESCRIPTION)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and validate; a bad value exits with status 2 and a one-line message."""
    return cli.parse(TrainConfig, argv, prog=_PROG, description=_DESCRIPTION,
                     errors=(ConfigError,))
