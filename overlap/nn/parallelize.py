"""parallelize(model, ...): swap a model's modules for tensor-parallel ones, in place, by the
model's shipped plan or the one given.

The model-aware entry over ``overlap.nn.apply.apply_plan``, which takes the plan and the EP
communicator as arguments and does the work: without ``plan=`` this takes
``overlap.models.tp_plans.plan_for(model)``, and it checks that ``ep_comm`` is an
``overlap.moe.EPComm``. It (and the ``overlap.nn`` package, which exports it) is the one part of
``overlap.nn`` above ``overlap.models`` and ``overlap.moe`` in the layers (tests/test_layers.py).
Styles, the contract and the errors: overlap.nn.apply, docs/parallelize.md; narrative:
docs/design/nn.md.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from overlap.nn.apply import apply_plan, expert_modules, gather_grads, gather_state_dict
from overlap.nn.tp_plan import STYLES, Style, TPPlan
from overlap.tp.comm import TPComm

__all__ = ["Style", "TPPlan", "STYLES", "parallelize", "gather_state_dict", "gather_grads",
           "expert_modules"]


def parallelize(model: nn.Module, *, comm: TPComm | None = None, ep_comm=None,
                plan: TPPlan | None = None, sequence_parallel: bool = False,
                verify: bool | str = True, probe=None,
                verify_tol: float | None = None, subclasses: str = "wrap",
                cp_comm=None) -> nn.Module:
    """Replace ``model``'s modules by TP ones per ``plan`` (default: the model's shipped plan,
    ``overlap.models.tp_plans.plan_for(model)``) on one TP communicator; returns ``model``
    (changed in place).

    The communicator: ``comm=``, a TPComm (``TPComm(group, backend=..., chunks=...)`` or
    ``dims.tp_comm()``). Every rank of the group must call it on the same (same-seed)
    model. The sharded modules copy their shard of the current values, so the parallel model
    computes the same function.

    ``ep_comm``: an ``overlap.moe.EPComm`` for plans with mixture-of-experts blocks (style
    "experts"): each rank keeps ``num_experts / ep`` experts of every block. Its group either
    meets the TP group in this rank only (EP carved from the data-parallel ranks, which hold
    different tokens) or lies inside it (the EP ranks hold the same tokens and split them).
    A transformers model whose experts the plan leaves out is refused.

    ``verify``: True (default) checks that the weights are identical across TP ranks, then
    compares every replaced layer and every module that contains one with the unsharded
    module on a probe (output and input gradient); "model" adds the whole model's output;
    False skips verification. ``probe``: the model input for the region checks (a tensor,
    a tuple of args, a dict of kwargs, or a callable model -> output); default: token ids
    built from the vocabulary size (models that take ids), or features for a model whose
    first layer is an nn.Linear; a probe the model rejects raises (no check is skipped).
    ``verify_tol``: the largest relative error accepted (default 1e-4 for fp32, 3e-2 for
    16-bit weights). On a mismatch, or when anything raises inside (the model's own forward
    on the sharded shapes included), the model is restored (the same module objects, values,
    requires_grad and hooks) and every rank raises one ValueError naming the module, what
    failed and why it likely did, chained to the original error.
    ``subclasses``: "wrap" (default), "refuse" or "replace" for matched modules whose type
    overrides forward (see overlap.nn.wrap).

    ``cp_comm``: an ``overlap.cp.CPComm``; after the TP replacement (and its verification)
    a Hugging Face decoder's attention runs over it (``overlap.cp.hf.enable_context_parallel``:
    the ring over this rank's heads). Checked before anything changes.
    """
    # Imported on the call: overlap.moe and overlap.models import overlap.nn's layers, so
    # importing them with this module (which the overlap.nn package imports) would be a circle.
    if ep_comm is not None:
        from overlap.moe.comm import EPComm

        if not isinstance(ep_comm, EPComm):
            where = f" (rank {dist.get_rank()})" if dist.is_initialized() else ""
            raise TypeError(f"parallelize: ep_comm must be an overlap.moe.EPComm, got "
                            f"{type(ep_comm).__name__}{where}")
    if plan is None:
        from overlap.models.tp_plans import plan_for

        plan = plan_for(model)
    return apply_plan(model, plan, comm=comm, ep_comm=ep_comm,
                      sequence_parallel=sequence_parallel, verify=verify, probe=probe,
                      verify_tol=verify_tol, subclasses=subclasses, cp_comm=cp_comm)
