"""Tensor parallelism: fused collective matmuls (``ops``) and their backends.

    from overlap.tp import all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce

Modules: comm (TPComm: backend, settings, workspaces, failure state), ops (public API +
autograd), backends (the backend classes), chunked (async torch.distributed), symmetric
(userbuffers + copier), context (workspace ownership, phases), copier (copy thread / side
stream), checks (input validation); layers, embedding, sequence (the drop-in modules),
parallelize and plans (swapping them into a model).
"""

from overlap.tp.comm import TPComm, TPCommFailed
from overlap.tp.context import TPContext
from overlap.tp.ops import (all_gather_matmul, close_all_contexts, make_context,
                            matmul_all_reduce, matmul_reduce_scatter, resolve_backend)
from overlap.tp.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_shared
from overlap.tp.embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy
from overlap.tp.parallelize import Style, TPPlan, gather_grads, gather_state_dict, parallelize
from overlap.tp.plans import gpt2_plan, gpt_plan, llama_plan, plan_for

__all__ = ["TPComm", "TPCommFailed", "all_gather_matmul", "matmul_reduce_scatter",
           "matmul_all_reduce", "make_context", "close_all_contexts", "resolve_backend", "TPContext", "ColumnParallelLinear",
           "RowParallelLinear", "column_parallel_shared", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "Style", "TPPlan", "gather_grads",
           "gather_state_dict", "parallelize", "gpt2_plan", "gpt_plan", "llama_plan", "plan_for"]
