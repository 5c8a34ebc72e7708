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
``overlap.models.plans``; their names are also reachable here (``from overlap.tp import
ColumnParallelLinear``), resolved on first use so that neither package imports the other at
import time.
"""

from overlap.tp.comm import TPComm, TPCommFailed
from overlap.tp.context import TPContext
from overlap.tp.ops import (all_gather_matmul, close_all_contexts, matmul_all_reduce,
                            matmul_reduce_scatter, resolve_backend)

__all__ = ["TPComm", "TPCommFailed", "all_gather_matmul", "matmul_reduce_scatter",
           "matmul_all_reduce", "close_all_contexts", "resolve_backend",
           "TPContext", "ColumnParallelLinear",
           "RowParallelLinear", "column_parallel_shared", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "Style", "TPPlan", "gather_grads",
           "gather_state_dict", "parallelize", "gpt2_plan", "gpt_plan", "llama_plan", "plan_for",
           "phi3_plan", "gpt_neox_plan", "opt_plan", "dtensor_state_dict",
           "load_dtensor_state_dict", "expose_dtensors"]


_NN_NAMES = {"ColumnParallelLinear": "overlap.nn", "RowParallelLinear": "overlap.nn",
             "column_parallel_shared": "overlap.nn", "VocabParallelEmbedding": "overlap.nn",
             "vocab_parallel_cross_entropy": "overlap.nn", "Style": "overlap.nn",
             "TPPlan": "overlap.nn", "gather_grads": "overlap.nn",
             "gather_state_dict": "overlap.nn", "parallelize": "overlap.nn",
             "gpt2_plan": "overlap.models.plans", "gpt_plan": "overlap.models.plans",
             "llama_plan": "overlap.models.plans", "plan_for": "overlap.models.plans",
             "phi3_plan": "overlap.models.plans", "gpt_neox_plan": "overlap.models.plans",
             "opt_plan": "overlap.models.plans", "dtensor_state_dict": "overlap.nn",
             "load_dtensor_state_dict": "overlap.nn", "expose_dtensors": "overlap.nn"}


def __getattr__(name: str):
    if name in _NN_NAMES:
        import importlib

        return getattr(importlib.import_module(_NN_NAMES[name]), name)
    raise AttributeError(f"module 'overlap.tp' has no attribute {name!r}")
