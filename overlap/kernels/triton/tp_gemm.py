"""Triton backend of the fused tensor-parallel GEMMs (used by overlap.tp.ops).

    all_gather_matmul(ws, x_shard [m, K], w [K, N], *, phase)
        -> (all_gather(x_shard) @ w [world*m, N], all_gather(x_shard) [world*m, K] | None)
    matmul_reduce_scatter(ws, x [M, K], w [K, N], *, phase)
        -> reduce_scatter(x @ w) [M/world, N]

Both run over a SymmetricWorkspace of the TP group sized by ``*_workspace_bytes`` and
``*_num_signals``; each op kind needs its own workspace. ``phase`` grows by one per call on a
workspace (the same on every rank); calls back to back need no barrier. A wait that times out
raises TimeoutError after the call, or, with ``sync=False``, at the next call on the workspace
or in ``check_pending(ws)``. Runs on CUDA tensors and under TRITON_INTERPRET=1.
The narrative: docs/design/kernels.md.
"""

from overlap.kernels.triton.all_gather_matmul import (all_gather_matmul,
                                                      all_gather_matmul_num_signals,
                                                      all_gather_matmul_workspace_bytes)
from overlap.kernels.triton.matmul_reduce_scatter import (matmul_reduce_scatter,
                                                          matmul_reduce_scatter_num_signals,
                                                          matmul_reduce_scatter_workspace_bytes)
from overlap.kernels.triton.tp_sync import check_pending

__all__ = ["all_gather_matmul", "all_gather_matmul_workspace_bytes",
           "all_gather_matmul_num_signals", "matmul_reduce_scatter",
           "matmul_reduce_scatter_workspace_bytes", "matmul_reduce_scatter_num_signals",
           "check_pending"]
