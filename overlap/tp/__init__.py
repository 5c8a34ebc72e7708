"""Tensor parallelism: fused collective matmuls (``ops``) and their backends.

    from overlap.tp import all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce

Modules: ops (public API + autograd), backends (the "auto" rule, dispatch), chunked (async
torch.distributed), symmetric (userbuffers + copier), triton_backend (fused Triton kernels),
context (workspace ownership, phases, cache), copier (copy thread / side stream), checks
(input validation).
"""

from overlap.tp.context import TPContext, close_all_contexts
from overlap.tp.ops import (all_gather_matmul, make_context, matmul_all_reduce,
                            matmul_reduce_scatter, resolve_backend)

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "make_context",
           "close_all_contexts", "resolve_backend", "TPContext"]
