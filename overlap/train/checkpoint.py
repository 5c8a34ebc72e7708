"""Distributed checkpoints of the main job with torch.distributed.checkpoint (DCP), reshardable.

Every tensor is saved under the name and in the coordinates of the *unsharded* model, so a
checkpoint written with one tp x pp x dp layout loads into any other. Keys: ``model.<fqn>``
(parameters of ``GPT``, global shape); ``optim.master.<fqn>``, ``optim.exp_avg.<fqn>``,
``optim.exp_avg_sq.<fqn>`` (fp32 masters and AdamW moments, ZeRO shards saved as such);
``optim.step``; ``train`` (the next step, the global batch); ``rng.rank<r>`` (generator states,
restored only under the same layout).

Contract: ``latest_checkpoint`` returns only complete checkpoints (a renamed ``DIR/step_<N>``
with ``.metadata``), never one a fault interrupted; ``CheckpointWriter`` saves asynchronously,
at most one save in flight.

The narrative: docs/design/training.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager

__all__ = ["Chunks", "latest_checkpoint", "param_slices", "CheckpointWriter", "load",
           "export_model", "TRAIN_STATE"]

TRAIN_STATE = "train_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class Chunks:
    """This rank's chunks of one logical tensor of shape ``shape``: ``(offsets, tensor)``
    pairs, each tensor a (view of a) rectangle of the global tensor at ``offsets``."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = torch.Size(shape)
        self.pieces: list[tuple[torch.Size, torch.Tensor]] = []

    def add(self, offsets, tensor: torch.Tensor) -> None:
        self.pieces.append((torch.Size(offsets), tensor))

    def size(self) -> torch.Size:
        return self.shape

    def get(self, offsets) -> torch.Tensor:
        for off, t in self.pieces:
            if off == torch.Size(offsets):
                return t
        raise KeyError(f"Chunks: no chunk at offsets {tuple(offsets)}")

    def snapshot(self) -> "Chunks":
        out = Chunks(self.shape)
        out.pieces = [(off, t.detach().clone()) for off, t in self.pieces]
        return out

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self.shape))
                for off, t in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self.pieces]


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunks):
            return obj.get(index.offset)
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's _init_state_dict (meta-tensor materialisation) maps objects it
        # does not know, Chunks included, to None: skip it (nothing here is on "meta").
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        self.original_state_dict = state_dict
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunks):
            return obj.get(index.offset)
        return super().lookup_tensor(index)


class _Staged(AsyncStager):
    """The state dict is already a private copy (``Chunks.snapshot``): nothing to stage."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ layout

def param_slices(model: torch.nn.Module, params) -> dict[int, tuple[str, tuple, tuple]]:
    """``{id(p): (fqn, global_shape, global_offsets)}`` for ``params`` of the parallelized
    ``model``: where each local (TP-sharded or replicated) tensor sits in the unsharded one."""
    from overlap.moe.experts import SwiGLUExperts
    from overlap.nn.layers import TPModule

    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p in params:
        fqn = names[id(p)]
        mod_name, _, attr = fqn.rpartition(".")
        owner = model.get_submodule(mod_name)
        spec = owner.shard_specs.get(attr) if isinstance(owner, TPModule) else None
        shape, offsets = list(p.shape), [0] * p.dim()
        if spec is not None and spec.dim is not None:
            if spec.parts != 1 or spec.transpose:
                raise NotImplementedError(f"checkpoint: {fqn} is sharded with parts="
                                          f"{spec.parts}, transpose={spec.transpose}; only "
                                          "plain row/column shards are supported")
            tp, r = owner.tp_size, owner.tp_rank
            sizes = list(spec.sizes) if spec.sizes is not None else [p.shape[spec.dim]] * tp
            shape[spec.dim] = sum(sizes)
            offsets[spec.dim] = sum(sizes[:r])
        if isinstance(owner, SwiGLUExperts):  # an EP shard: these experts of all of them
            shape[0], offsets[0] = owner.num_total, owner.first
        out[id(p)] = (fqn, tuple(shape), tuple(offsets))
    return out


def _rects(local_shape, lo: int, hi: int):
    """Elements [lo, hi) of a row-major tensor of ``local_shape`` as boxes:
    ``(local_offsets, sizes, start)`` with ``start`` the first element's index minus lo. At
    most two partial slices per dimension and one run of whole ones between them."""
    shape = tuple(local_shape)
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), 0)]
    inner = 1
    for s in shape[1:]:
        inner *= s
    out = []
    pos = lo
    while pos < hi:
        i, within = divmod(pos, inner)
        if within or hi - pos < inner:  # a partial slice i of the outer dimension
            n = min(inner - within, hi - pos)
            for loc, sizes, start in _rects(shape[1:], within, within + n):
                out.append(((i, *loc), (1, *sizes), pos - lo + start))
        else:  # whole slices
            n = (hi - pos) // inner * inner
            out.append(((i, *[0] * (len(shape) - 1)), (n // inner, *shape[1:]), pos - lo))
        pos += n
    return out


def _flat_chunks(chunks: dict[str, Chunks], fqn, shape, offsets, local_shape, lo, hi,
                 flat: torch.Tensor) -> None:
    """Register elements [lo, hi) of a local tensor (stored in ``flat``, 1-D) as chunks."""
    c = chunks.setdefault(fqn, Chunks(shape))
    for loc, sizes, start in _rects(local_shape, lo, hi):
        n = 1
        for s in sizes:
            n *= s
        glob = tuple(o + l for o, l in zip(offsets, loc))
        c.add(glob, flat.narrow(0, start, n).view(sizes))


def build_state(*, model, stages, optimizers, sharded: bool) -> dict[str, Any]:
    """The checkpointable tensors of this rank (views: loading writes into them). Each
    optimizer owns some of the stages' parameters (one per stage, or with expert parallelism
    one for the dense and one for the expert parameters of a stage)."""
    state: dict[str, Any] = {"model": {}, "optim": {"master": {}, "exp_avg": {},
                                                     "exp_avg_sq": {}}}
    everything = [p for stage in stages for p in stage.module.parameters() if p.requires_grad]
    where = param_slices(model, everything)
    for p in everything:
        fqn, shape, off = where[id(p)]
        state["model"].setdefault(fqn, Chunks(shape)).add(off, p.data)
    for opt in optimizers:
        if sharded:
            opt.init_state()
            reducer_params = opt.reducer.params
            for piece in opt.shard_pieces():
                p = reducer_params[piece.param]
                fqn, shape, off = where[id(p)]
                for key, flat in opt.piece_state(piece).items():
                    if key in state["optim"]:
                        _flat_chunks(state["optim"][key], fqn, shape, off, tuple(p.shape),
                                     piece.lo, piece.hi, flat)
            state["optim"]["step"] = opt.scalar_state()["step"]
        else:
            _init_adamw_state(opt)
            for p in _params_of(opt):
                fqn, shape, off = where[id(p)]
                # bf16: the fp32 master (MasterOptimizer), else the parameter is its own master
                master = opt.master_of(p) if hasattr(opt, "master_of") else p
                st = opt.state[master]
                state["optim"]["master"].setdefault(fqn, Chunks(shape)).add(off, master.data)
                for key in ("exp_avg", "exp_avg_sq"):
                    state["optim"][key].setdefault(fqn, Chunks(shape)).add(off, st[key])
                state["optim"]["step"] = st["step"]
    return state


def _params_of(opt) -> list:
    """The model parameters an (unsharded) optimizer steps: its own, or the ones its fp32
    masters stand for (MasterOptimizer)."""
    if hasattr(opt, "params"):
        return list(opt.params)
    return [p for group in opt.param_groups for p in group["params"]]


def _init_adamw_state(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _snapshot(state):
    if isinstance(state, Chunks):
        return state.snapshot()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if torch.is_tensor(state):
        return state.detach().clone()
    return state


# ------------------------------------------------------------------------------ files

def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (``root`` itself if it is one)."""
    if os.path.isfile(os.path.join(root, ".metadata")):
        return root
    try:
        names = os.listdir(root)
    except OSError:
        return None
    steps = []
    for n in names:
        m = _STEP_DIR.match(n)
        if m and os.path.isfile(os.path.join(root, n, ".metadata")) \
                and os.path.isfile(os.path.join(root, n, TRAIN_STATE)):
            steps.append((int(m.group(1)), n))
    return os.path.join(root, max(steps)[1]) if steps else None


class CheckpointWriter:
    """Asynchronous DCP saves of this rank's state; collective over every rank (its own gloo
    group, built here)."""

    def __init__(self, root: str, *, attempt: int, timeout: float):
        from datetime import timedelta

        self.root = root
        self.attempt = attempt
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self._pending = None  # (future, tmp dir, final dir)
        self._lock = threading.Lock()
        if self.rank == 0:
            os.makedirs(root, exist_ok=True)
            # half-written checkpoints of earlier attempts: never read, removed now
            for n in os.listdir(root):
                if ".tmp.a" in n:
                    shutil.rmtree(os.path.join(root, n), ignore_errors=True)
        self.saved: list[str] = []

    def save(self, state: dict[str, Any], meta: dict[str, Any], step: int) -> None:
        """Snapshot ``state`` now and write it in the background as ``step_<step>``."""
        self.wait()
        final = os.path.join(self.root, f"step_{step}")
        tmp = f"{final}.tmp.a{self.attempt}"
        snap = _snapshot(state)
        snap["rng"] = {f"rank{self.rank}": meta.pop("rng")}
        if self.rank == 0:
            os.makedirs(tmp, exist_ok=True)
            with open(os.path.join(tmp, TRAIN_STATE), "w") as f:
                json.dump(meta, f, indent=1)
        future = dcp.async_save(snap, checkpoint_id=tmp, process_group=self.group,
                                planner=_SavePlanner(), async_stager=_Staged())
        done = future.upload_completion if hasattr(future, "upload_completion") else future
        self._pending = (done, tmp, final)
        if self.rank == 0:
            # publish as soon as the write is complete everywhere, not at the next save: a
            # fault in between must find it
            done.add_done_callback(lambda f: f.exception() is None and self._publish(tmp, final))

    def _publish(self, tmp: str, final: str) -> None:
        with self._lock:
            if final in self.saved:
                return
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            self.saved.append(final)

    def wait(self) -> None:
        """Wait for the save in flight (raises its error); rank 0 then makes sure it is
        published."""
        if self._pending is None:
            return
        done, tmp, final = self._pending
        self._pending = None
        done.result()
        if self.rank == 0:
            self._publish(tmp, final)

    def close(self) -> None:
        self.wait()
        dist.destroy_process_group(self.group)


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, TRAIN_STATE)) as f:
        return json.load(f)


def load(path: str, state: dict[str, Any], *, rng_key: str | None,
         group=None) -> Any:
    """Load ``state`` (as built by ``build_state``) in place from the checkpoint ``path``;
    returns this rank's saved RNG state when ``rng_key`` (``rank<r>``) is given."""
    target = dict(state)
    if rng_key is not None:
        target["rng"] = {rng_key: None}
    dcp.load(target, checkpoint_id=path, planner=_LoadPlanner(), process_group=group)
    return target["rng"][rng_key] if rng_key is not None else None


def export_model(path: str, out: str) -> list[str]:
    """Write the checkpoint's unsharded model parameters (keys of ``GPT.state_dict()``) to
    ``out`` with ``torch.save``; one process, no process group. Returns the keys."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    md = reader.read_metadata()
    want = {k: torch.empty(v.size, dtype=v.properties.dtype)
            for k, v in md.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    dcp.load(want, storage_reader=reader, no_dist=True)
    sd = {k[len("model."):]: v for k, v in want.items()}
    torch.save(sd, out)
    return sorted(sd)
