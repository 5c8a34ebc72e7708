"""What each of overlap's own kernels does, for the trace analyzer (``overlap-analyze``).

Every kernel this project launches (the Triton ``*_kernel`` functions in overlap/kernels/triton
and the ``__global__`` functions in csrc/*.cu) declares here one of three kinds:

- ``comm``: moves or waits for data from peers; its time is communication;
- ``compute``: local math (quantize, dequantize); its time is compute, like a GEMM's;
- ``fused``: a GEMM that reads from or writes to peers while it runs; its time is compute with
  its communication hidden, except the time it waits on a peer's signal.

``waits=True`` marks a kernel that only waits on a peer's signal: its whole time is a wait.
Add a kernel here in the same change that adds it; tests/test_profile_names.py fails on a
kernel without an entry or an entry naming no kernel.
The narrative: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["KernelInfo", "KERNELS", "lookup", "COMM", "COMPUTE", "FUSED"]

COMM, COMPUTE, FUSED = "comm", "compute", "fused"


@dataclasses.dataclass(frozen=True, slots=True)
class KernelInfo:
    name: str
    kind: str  # COMM | COMPUTE | FUSED
    source: str  # the file that defines it, relative to the repository root
    waits: bool = False
    what: str = ""

    def __post_init__(self) -> None:
        if self.kind not in (COMM, COMPUTE, FUSED):
            raise ValueError(f"KernelInfo({self.name!r}): kind must be one of "
                             f"{(COMM, COMPUTE, FUSED)}, got {self.kind!r}")


_TRITON = "overlap/kernels/triton/"
_ENTRIES = (
    KernelInfo("_all_gather_matmul_kernel", FUSED, _TRITON + "all_gather_matmul.py",
               what="AllGather-GEMM: tiles wait on a peer's ready flag, then read its shard"),
    KernelInfo("_ag_publish_kernel", COMM, _TRITON + "all_gather_matmul.py",
               what="copies this rank's shard into its symmetric buffer and signals peers"),
    KernelInfo("_matmul_reduce_scatter_kernel", FUSED, _TRITON + "matmul_reduce_scatter.py",
               what="GEMM-ReduceScatter: the epilogue stores tiles into the owner's buffer"),
    KernelInfo("_reduce_kernel", COMM, _TRITON + "matmul_reduce_scatter.py",
               what="waits for every source's partial, sums them (the reduce of the scatter)"),
    KernelInfo("_pull_kernel", COMM, _TRITON + "signal.py",
               what="waits on a peer's flag, then copies from the peer's buffer"),
    KernelInfo("_set_kernel", COMM, _TRITON + "signal.py", what="sets a (peer's) signal flag"),
    KernelInfo("_ep_dispatch_kernel", COMM, _TRITON + "ep_dispatch.py",
               what="MoE send: stores each routed row into its owner's buffer, then the "
                    "counts, then signals every owner"),
    KernelInfo("_quantize_kernel", COMPUTE, _TRITON + "quant.py", what="blockwise INT8 quantize"),
    KernelInfo("_dequantize_kernel", COMPUTE, _TRITON + "quant.py",
               what="blockwise INT8 dequantize"),
    KernelInfo("_dequant_reduce_kernel", COMPUTE, _TRITON + "quant.py",
               what="dequantize, sum in fp32, requantize: local math on received data"),
    KernelInfo("overlap_signal_set", COMM, "csrc/signal.cu",
               what="release-stores a flag after the stream's prior work"),
    KernelInfo("overlap_signal_add", COMM, "csrc/signal.cu", what="atomically adds to a flag"),
    KernelInfo("overlap_signal_wait", COMM, "csrc/signal.cu", waits=True,
               what="blocks its stream until a peer's flag reaches the phase"),
    KernelInfo("overlap_poison_if_error", COMPUTE, "csrc/signal.cu",
               what="fills an op's output with NaN bytes if a wait of its workspace gave up "
                    "(a no-op load otherwise)"),
    KernelInfo("overlap_quantize_blocks", COMPUTE, "csrc/quant.cu",
               what="blockwise INT8 quantize"),
    KernelInfo("overlap_dequantize_blocks", COMPUTE, "csrc/quant.cu",
               what="blockwise INT8 dequantize"),
    KernelInfo("overlap_dequant_reduce_blocks", COMPUTE, "csrc/quant.cu",
               what="dequantize, sum in fp32, requantize"),
)
KERNELS: dict[str, KernelInfo] = {k.name: k for k in _ENTRIES}

# Older Triton releases append the specialization to the compiled name ("_kernel_0d1d2de");
# CUDA tools may show a signature ("overlap_signal_wait(long const*, ...)").
_TRITON_SUFFIX = re.compile(r"_[0-9cde]+$")


def lookup(kernel_name: str) -> KernelInfo | None:
    """The registry entry for a kernel name as a profiler shows it, or None."""
    name = kernel_name.strip()
    hit = KERNELS.get(name)
    if hit is not None:
        return hit
    base = name.split("(", 1)[0].strip()
    base = base.rsplit(" ", 1)[-1]  # "void overlap_signal_wait" -> "overlap_signal_wait"
    hit = KERNELS.get(base)
    if hit is not None:
        return hit
    stripped = _TRITON_SUFFIX.sub("", base)
    return KERNELS.get(stripped) if stripped != base else None
