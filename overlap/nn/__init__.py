"""Tensor-parallel nn layers on the fused-op engine (``overlap.tp``): drop-in linear layers and
embedding, sequence-parallel norms, autograd region collectives, sharding helpers, and
``parallelize(model, ...)`` that swaps them into a model by a plan (``TPPlan``) and verifies
the result on a probe (``verify``, ``verifier``), subclass wrapping (``wrap``) and DTensor
state dicts for torch.distributed.checkpoint (``dtensor``).

    from overlap.nn import ColumnParallelLinear, RowParallelLinear, parallelize, TPPlan
"""

from overlap.nn.dtensor import dtensor_state_dict, expose_dtensors, load_dtensor_state_dict
from overlap.nn.embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy
from overlap.nn.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_shared
from overlap.nn.parallelize import gather_grads, gather_state_dict, parallelize
from overlap.nn.tp_plan import STYLES, Style, TPPlan
from overlap.nn.sequence import (SequenceParallelLayerNorm, SequenceParallelRMSNorm,
                                 SequenceShardedPositions, sequence_parallel_norm,
                                 sum_grads_over_tp)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_parallel_shared",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "parallelize",
           "gather_state_dict", "gather_grads", "Style", "STYLES", "TPPlan",
           "SequenceParallelLayerNorm", "SequenceParallelRMSNorm", "SequenceShardedPositions",
           "sequence_parallel_norm", "sum_grads_over_tp", "dtensor_state_dict", "load_dtensor_state_dict",
           "expose_dtensors"]
