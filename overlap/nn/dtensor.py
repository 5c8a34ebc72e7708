"""DTensor views of a parallelized model's state, for torch.distributed.checkpoint (DCP).

Contract: ``dtensor_state_dict(model, mesh)`` returns the model's state dict with every TP
parameter as a DTensor on the 1-D TP ``mesh`` whose *global* shape and layout are the unsharded
model's, so DCP saves a checkpoint that any TP degree (or an unsharded model) can load. A shard
that is one contiguous, even piece of the full tensor is wrapped without a copy; a fused
(``parts``) or uneven shard is gathered and re-cut, a copy made at save/load time only.
Everything else (replicated norms, biases of row layers, buffers) stays a plain tensor, which
DCP treats as replicated. ``load_dtensor_state_dict(model, sd)`` writes such a state dict back
into the model's shards.
The narrative (and an example): docs/design/nn.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.nn import sharding
from overlap.nn.layers import TPModule, local
from overlap.tp.collectives import all_gather_dim

__all__ = ["dtensor_state_dict", "load_dtensor_state_dict", "expose_dtensors", "tp_mesh"]


def tp_mesh(group, device_type: str = "cpu") -> "torch.distributed.device_mesh.DeviceMesh":
    """A 1-D DeviceMesh over the ranks of ``group`` (the model's TP group) on
    ``device_type`` (where the parameters live)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type)


def _tp_entries(model: nn.Module):
    """(state-dict key, TP module, parameter name) for every sharded TP parameter."""
    for name, module in model.named_modules():
        if isinstance(module, TPModule):
            for pname, p in module.named_parameters(recurse=False):
                spec = module.shard_specs[pname]
                if spec.dim is not None:
                    yield (f"{name}.{pname}" if name else pname), module, pname, spec


def _zero_copy(spec: sharding.ShardSpec) -> bool:
    single = spec.parts == 1 or (isinstance(spec.parts, tuple) and len(spec.parts) == 1)
    return single and not spec.transpose and spec.sizes is None


def _why_not(spec: sharding.ShardSpec) -> str:
    if spec.transpose:
        return "Conv1D, stored transposed"
    if spec.sizes is not None:
        return f"uneven sizes {list(spec.sizes)}"
    return f"fused parts={spec.parts}"


def dtensor_state_dict(model: nn.Module, mesh=None) -> dict[str, torch.Tensor]:
    """The model's state dict with TP parameters as DTensors of the unsharded shape (see the
    module docstring). Collective over the TP group when a layer must be gathered."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    sd = model.state_dict()
    for key, module, pname, spec in _tp_entries(model):
        if key not in sd:
            continue
        if mesh is None:
            mesh = tp_mesh(module.tp_group, getattr(module, pname).device.type)
        if mesh.size() != module.tp_size:
            raise ValueError(f"dtensor_state_dict: {key} is sharded over tp={module.tp_size} "
                             f"but the mesh has {mesh.size()} ranks (rank {dist.get_rank()})")
        local = getattr(module, pname).detach()
        if isinstance(local, DTensor):  # exposed already (expose_dtensors)
            continue
        if _zero_copy(spec):
            # Even shards: the global shape follows from the local one (no collective).
            sd[key] = DTensor.from_local(local, mesh, [Shard(spec.dim)], run_check=False)
        else:
            full = sharding.gather(local, spec, group=module.tp_group)
            dim = (1 - spec.dim) if spec.transpose else spec.dim
            sd[key] = distribute_tensor(full, mesh, [Shard(dim)])
    return sd


def _full(value, group) -> torch.Tensor:
    """The global tensor of a DTensor on a 1-D mesh over ``group`` (our bounded collectives,
    which also run on transports that DTensor's functional collectives do not support)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        return value
    (placement,) = value.placements
    local = value.to_local()
    if not isinstance(placement, Shard):
        return local
    d, n, tp = placement.dim, value.shape[placement.dim], dist.get_world_size(group)
    c = -(-n // tp)  # torch.chunk's sizes: the last ranks may hold less (or nothing)
    sizes = [max(0, min(c, n - r * c)) for r in range(tp)]
    return all_gather_dim(local, d, group=group, sizes=sizes, op="load_dtensor_state_dict")


def load_dtensor_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy ``sd`` (from :func:`dtensor_state_dict`, then filled by ``dcp.load``, or any
    state dict of unsharded tensors) into the model's shards and replicated tensors."""
    from torch.distributed.tensor import DTensor

    done = set()
    with torch.no_grad():
        for key, module, pname, spec in _tp_entries(model):
            if key not in sd:
                continue
            value = sd[key]
            param = local(getattr(module, pname))
            if isinstance(value, DTensor) and value.to_local().data_ptr() == param.data_ptr():
                done.add(key)  # wrapped without a copy: dcp.load wrote into the shard
                continue
            full = _full(value, module.tp_group)
            param.copy_(sharding.shard(full, spec, module.tp_rank, module.tp_size))
            done.add(key)
        rest = {k: v for k, v in sd.items() if k not in done}
        own = model.state_dict()
        for k, v in rest.items():
            if k in own and own[k].data_ptr() != v.data_ptr():
                own[k].copy_(v)


def expose_dtensors(model: nn.Module, mesh=None) -> nn.Module:
    """Make every sharded TP parameter a DTensor with ``Shard(dim)`` on the TP ``mesh`` (a
    1-D mesh over the TP group, e.g. ``mesh2d["tp"]``; default: one built from the group),
    in place, so FSDP2 (``fully_shard`` over the dp mesh) and torch's state-dict APIs
    (``get_model_state_dict(full_state_dict=True)``, DCP) see global shapes and placements.
    The layers compute on ``to_local()`` (differentiable; the gradient is a DTensor too).
    Ties stay ties. Only layers whose shard is one contiguous even piece of the full tensor
    can be exposed; fused (``parts``), uneven (a vocabulary tp does not divide) and Conv1D
    parameters are refused with a ValueError naming them, before anything changes (use
    ``dtensor_state_dict`` for those models' checkpoints)."""
    from torch.distributed.tensor import DTensor, Shard

    entries = [e for e in _tp_entries(model) if not isinstance(getattr(e[1], e[2]), DTensor)]
    bad = [f"{key} ({_why_not(spec)})" for key, _, _, spec in entries if not _zero_copy(spec)]
    if bad:
        raise ValueError(f"expose_dtensors on rank {dist.get_rank()}: these TP parameters are "
                         f"not one contiguous even piece of the full tensor, so no Shard "
                         f"placement describes them: {bad}. Use dtensor_state_dict() for "
                         "checkpoints of this model")
    swapped: dict[int, nn.Parameter] = {}
    for key, module, pname, spec in entries:
        p = getattr(module, pname)
        if id(p) in swapped:
            continue
        m = mesh if mesh is not None else tp_mesh(module.tp_group, p.device.type)
        if m.size() != module.tp_size:
            raise ValueError(f"expose_dtensors: {key} is sharded over tp={module.tp_size} but "
                             f"the mesh has {m.size()} ranks (rank {dist.get_rank()})")
        dt = DTensor.from_local(p.detach(), m, [Shard(spec.dim)], run_check=False)
        swapped[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
    for module in model.modules():  # every holder, so tied parameters stay one object
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in swapped:
                module._parameters[name] = swapped[id(p)]
    return model
