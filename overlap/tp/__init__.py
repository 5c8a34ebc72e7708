"""Tensor parallelism: fused collective matmuls (``ops``) and their backends.

    from overlap.tp import all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce

Modules: comm (TPComm: backend, settings, workspaces, failure state), ops (public API, the
one implementation of each fused op, its autograd and its custom op; ``call_op`` and
``define_op``, which overlap.nn's region collectives and column linear use too), stamps
(per-call agreement), backends (the
backend classes), chunked (async torch.distributed), symmetric
(userbuffers + copier), context (workspace ownership, phases), copier (copy thread / side
stream), checks (input validation), collectives (the plain bounded collectives).

The nn layers and ``parallelize`` live in ``overlap.nn`` and the model plans in
``overlap.models.tp_plans``.
"""

from overlap.tp.comm import TPComm, TPCommFailed, close_default_comms
from overlap.tp.context import TPContext
from overlap.tp.ops import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

__all__ = ["TPComm", "TPCommFailed", "all_gather_matmul", "matmul_reduce_scatter",
           "matmul_all_reduce", "close_default_comms", "TPContext"]
