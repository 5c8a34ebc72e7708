"""CompileSpec: one GPU launch of a Triton kernel, as its launcher makes it, for compiling the
kernel ahead of time without a GPU (``python -m overlap.kernels.compile_check``).

Each launcher module defines ``compile_specs()`` next to its launcher, built from the same
helper that builds the launch's keyword arguments, so the check compiles what a GPU runs:
the constexprs, ``num_warps``/``num_stages`` and options of the launch, and the Triton type
each runtime argument takes there (a tensor: a pointer to its dtype; a Python int: i32 unless
it needs 64 bits). The narrative: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

__all__ = ["CompileSpec", "ptr", "ints", "CUDA", "GEMM_DTYPES", "FUSED_GEMM_TABLES"]

CUDA = torch.device("cuda")  # a device object only: gemm_blocks reads its type, nothing more
GEMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # tp_sync.check_dtypes accepts
# The fused TP GEMMs' workspace tables and status words (all_gather_matmul.py,
# matmul_reduce_scatter.py).
FUSED_GEMM_TABLES = {"data_table": "*i64", "flag_table": "*i64", "counter_ptr": "*i32",
                     "status_ptr": "*i64", "timeout_ns": "i64"}

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
        torch.int8: "*i8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64"}


def ptr(dtype: torch.dtype) -> str:
    """The Triton type of a tensor argument of ``dtype``."""
    return _PTR[dtype]


def ints(names: str, ty: str = "i32") -> dict[str, str]:
    """``{name: ty}`` for space-separated integer argument names."""
    return {n: ty for n in names.split()}


@dataclasses.dataclass(frozen=True, slots=True)
class CompileSpec:
    kernel: Any  # the @triton.jit function
    types: Mapping[str, str]  # every runtime argument -> its Triton type at launch
    meta: Mapping[str, Any]  # the launch's keywords: constexprs, then compile options
    variant: str = ""  # what tells this launch from the kernel's others ("bf16, gathered")

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def constexprs(self) -> dict[str, Any]:
        return {k: v for k, v in self.meta.items() if k in self.kernel.arg_names}

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in self.meta.items() if k not in self.kernel.arg_names}

    def signature(self) -> dict[str, str]:
        """Every argument in order: its type, or "constexpr"; raises if the spec misses one."""
        consts = self.constexprs()
        missing = [a for a in self.kernel.arg_names if a not in consts and a not in self.types]
        extra = sorted(set(self.types) - set(self.kernel.arg_names))
        if missing or extra:
            raise ValueError(f"compile spec of {self.name} ({self.variant}): arguments without "
                             f"a type {missing}, types naming no argument {extra}")
        return {a: "constexpr" if a in consts else self.types[a] for a in self.kernel.arg_names}
