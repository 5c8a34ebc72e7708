"""Triton backend of the fused tensor-parallel GEMMs (used by overlap.tp.ops).

    ag_gemm(ws, x_shard [m, K], w [K, N], *, phase) -> (all_gather(x_shard) @ w [world*m, N],
                                                         all_gather(x_shard) [world*m, K] | None)
    gemm_rs(ws, x [M, K], w [K, N], *, phase)       -> reduce_scatter(x @ w) [M/world, N]

Both run over a SymmetricWorkspace of the TP group sized by ``*_workspace_bytes`` and
``*_num_signals``; each op kind needs its own workspace. ``phase`` grows by one per call on a
workspace (the same on every rank); calls back to back need no barrier (double buffers by
phase parity, consumers acknowledge). A wait that times out raises TimeoutError after the
call, or, with ``sync=False``, at the next call on the workspace or in ``check_pending(ws)``.

Design, shapes and signal layout: ag_gemm.py and gemm_rs.py; the shared wait/signal machinery:
tp_sync.py. The same kernels run on CUDA tensors over a cuda workspace and, here, under
TRITON_INTERPRET=1 over shared memory across processes.
"""

from overlap.kernels.triton.ag_gemm import ag_gemm, ag_gemm_num_signals, ag_gemm_workspace_bytes
from overlap.kernels.triton.gemm_rs import gemm_rs, gemm_rs_num_signals, gemm_rs_workspace_bytes
from overlap.kernels.triton.tp_sync import check_pending

__all__ = ["ag_gemm", "ag_gemm_workspace_bytes", "ag_gemm_num_signals", "gemm_rs",
           "gemm_rs_workspace_bytes", "gemm_rs_num_signals", "check_pending"]
