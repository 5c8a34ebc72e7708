"""Triton backend: the fused kernels of overlap.kernels.triton.tp_gemm on a context's workspace.

The kernels fuse the wait into the GEMM: ``ag_gemm``'s tiles wait on the signal of the shard
they need before loading it; ``gemm_rs``'s epilogue writes each tile into its owner's workspace
and signals. This module only owns the plumbing: workspace sizes, the phase (one per call, from
the context), contiguity, and ``matmul_all_reduce`` = ``gemm_rs`` then a plain all-gather of the
reduced shards (M padded to a multiple of world with zero rows).

``chunks`` does not apply (the kernels' tiles are the granularity). The weight-gradient GEMM
that the backward overlaps with the dgrad reduce-scatter runs after the kernel call here: on the
CPU interpreter the call is synchronous, and on a GPU both go to the current stream.
Under ``TRITON_INTERPRET=1`` the kernels run on CPU shared-memory workspaces across processes.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

import torch
import torch.distributed as dist

from overlap.tp.context import TPContext
from overlap.tp.regions import all_gather_dim

__all__ = ["available", "sizes", "all_gather_matmul", "matmul_reduce_scatter",
           "matmul_all_reduce"]

_MODULE = "overlap.kernels.triton.tp_gemm"


def available() -> bool:
    return importlib.util.find_spec(_MODULE) is not None


def _kernels():
    return importlib.import_module(_MODULE)


def sizes(op: str, rows: int, k: int, n: int, world: int,
          dtype: torch.dtype) -> tuple[int, int]:
    """(workspace bytes per rank, signals) for an op whose input has ``rows`` rows (the shard
    rows m for all_gather_matmul, the full M otherwise)."""
    kern = _kernels()
    if op == "all_gather_matmul":
        return kern.ag_gemm_workspace_bytes(rows, k, world, dtype), kern.ag_gemm_num_signals(world)
    m = -(-rows // world)
    return kern.gemm_rs_workspace_bytes(m, n, world, dtype), kern.gemm_rs_num_signals(world)


def all_gather_matmul(ctx: TPContext, x_shard: torch.Tensor, w: torch.Tensor, *,
                      return_gathered: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, k = x_shard.shape
    need, _ = sizes("all_gather_matmul", m, k, w.shape[1], ctx.world, x_shard.dtype)
    ctx.require("all_gather_matmul", need, f"a shard of {m} x {k} {x_shard.dtype}")
    return _kernels().ag_gemm(ctx.ws, x_shard.contiguous(), w.contiguous(),
                              phase=ctx.next_phase(), return_gathered=return_gathered)


def matmul_reduce_scatter(ctx: TPContext, x: torch.Tensor, w: torch.Tensor, *,
                          overlap_with: Callable[[], None] | None = None,
                          op: str = "matmul_reduce_scatter") -> torch.Tensor:
    need, _ = sizes("matmul_reduce_scatter", x.shape[0], x.shape[1], w.shape[1], ctx.world,
                    x.dtype)
    ctx.require(op, need, f"a {x.shape[0]} x {w.shape[1]} {x.dtype} product")
    y = _kernels().gemm_rs(ctx.ws, x.contiguous(), w.contiguous(), phase=ctx.next_phase())
    if overlap_with is not None:
        overlap_with()
    return y


def matmul_all_reduce(ctx: TPContext, x: torch.Tensor, w: torch.Tensor, *,
                      group: dist.ProcessGroup) -> torch.Tensor:
    rows, world = x.shape[0], ctx.world
    if rows % world:
        x = torch.cat([x, x.new_zeros(world - rows % world, x.shape[1])])
    y_shard = matmul_reduce_scatter(ctx, x, w, op="matmul_all_reduce")
    return all_gather_dim(y_shard, 0, group=group, op="matmul_all_reduce (triton)")[:rows]
