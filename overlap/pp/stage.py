"""Pipeline stages: the model chunk a pp rank owns, and helpers that split a model into chunks.

A model is split into ``S = v * p`` contiguous chunks of *pieces* (``nn.Sequential`` children,
a list of modules, or ``model.pipeline_pieces()`` such as ``overlap.models.GPT``). Chunk ``s``
becomes stage ``s`` and lives on pp rank ``s % p``, so with ``v > 1`` rank r holds the
non-adjacent chunks r, r+p, ... (interleaving).

Between stages exactly one floating tensor flows (the activation); the first stage's input
can be anything its first piece accepts (token ids). Stages keep one autograd graph per
in-flight micro-batch, from F until B (or until W when the backward is split).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.pp.backward import WeightGradState, backward_input, backward_weight

__all__ = ["PipelineStage", "split_pieces", "model_pieces", "pipeline_stages"]


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``; must live on pp rank ``stage_index % p``.

    ``last_backward`` is True while the executor runs this stage's final gradient-accumulating
    action of a step (the last B, or the last W; the last I on the first stage, whose I is
    a full backward because its input needs no gradient). A data-parallel reducer driven by
    post-accumulate-grad hooks reads it to start reducing only once per step.
    """

    def __init__(self, module: nn.Module, *, stage_index: int, num_stages: int,
                 pp_group: dist.ProcessGroup):
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage: module must be an nn.Module, got "
                            f"{type(module).__name__}")
        pp_size, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        if not (isinstance(num_stages, int) and num_stages >= 1 and num_stages % pp_size == 0):
            raise ValueError(f"PipelineStage: num_stages={num_stages!r} must be a positive "
                             f"multiple of the pp group size {pp_size} (rank {pp_rank})")
        if not (isinstance(stage_index, int) and 0 <= stage_index < num_stages):
            raise ValueError(f"PipelineStage: stage_index={stage_index!r} must be in "
                             f"[0, {num_stages}) (pp rank {pp_rank})")
        if stage_index % pp_size != pp_rank:
            raise ValueError(f"PipelineStage: stage {stage_index} belongs to pp rank "
                             f"{stage_index % pp_size}, but this is pp rank {pp_rank}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.pp_group = pp_group
        self.last_backward = False
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._wgrad: dict[int, WeightGradState] = {}

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward(self, mb: int, x: torch.Tensor, *, target=None,
                loss_fn: Callable | None = None, loss_scale: float = 1.0) -> torch.Tensor:
        """Run the chunk on micro-batch ``mb``; returns the output activation, or on the last
        stage the detached loss ``loss_fn(output, target)`` (backward uses it times
        ``loss_scale``)."""
        if not self.is_first:
            x.requires_grad_(True)
        out = self.module(x)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"PipelineStage {self.stage_index}: a stage must return one "
                            f"tensor, got {type(out).__name__}")
        self._inputs[mb] = x
        if self.is_last:
            loss = loss_fn(out, target)
            self._outputs[mb] = loss * loss_scale
            return loss.detach()
        self._outputs[mb] = out
        return out

    def backward(self, mb: int, grad_output: torch.Tensor | None, *,
                 split: bool) -> torch.Tensor | None:
        """B (``split=False``) or I (``split=True``) of micro-batch ``mb``; returns the
        gradient of the stage input (None on the first stage)."""
        out, inp = self._outputs.pop(mb), self._inputs.pop(mb)
        if split and not self.is_first:
            grad_inp, self._wgrad[mb] = backward_input(out, grad_output, inp, self.parameters())
            return grad_inp
        torch.autograd.backward(out, grad_output)
        if self.is_first:
            return None
        return inp.grad if inp.grad is not None else torch.zeros_like(inp)

    def backward_weight(self, mb: int) -> None:
        """W of micro-batch ``mb`` (a no-op on the first stage, whose I did everything)."""
        state = self._wgrad.pop(mb, None)
        if state is not None:
            backward_weight(state)

    def pending(self) -> list[int]:
        """Micro-batches whose graphs are still held (empty after a complete step)."""
        return sorted(set(self._inputs) | set(self._wgrad))

    def reset(self) -> None:
        self._inputs.clear()
        self._outputs.clear()
        self._wgrad.clear()
        self.last_backward = False


def split_pieces(pieces: Sequence[nn.Module], num_chunks: int, *,
                 costs: Sequence[float] | None = None) -> list[nn.Sequential]:
    """Split pieces into ``num_chunks`` contiguous non-empty chunks minimising the largest
    chunk cost (sum of ``costs``, default 1 per piece). The chunks share the pieces' modules."""
    n = len(pieces)
    if not isinstance(num_chunks, int) or not 1 <= num_chunks <= n:
        raise ValueError(f"split_pieces: num_chunks={num_chunks!r} must be in [1, {n}] "
                         f"(one piece at least per chunk; the model has {n} pieces)")
    costs = [1.0] * n if costs is None else [float(c) for c in costs]
    if len(costs) != n or any(c < 0 for c in costs):
        raise ValueError(f"split_pieces: costs must be {n} non-negative numbers, got {costs}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max-chunk cost splitting the first i pieces into k chunks.
    best = [[inf] * (n + 1) for _ in range(num_chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(num_chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, num_chunks + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                val = max(best[k - 1][j], prefix[i] - prefix[j])
                if val < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = val, j
    bounds, i = [], n
    for k in range(num_chunks, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return [nn.Sequential(*pieces[a:b]) for a, b in reversed(bounds)]


def model_pieces(model) -> list[nn.Module]:
    """The pipeline-splittable pieces of a model: ``pipeline_pieces()`` if it has one, else
    the children of an ``nn.Sequential``/``nn.ModuleList``, else the list itself."""
    if hasattr(model, "pipeline_pieces"):
        return list(model.pipeline_pieces())
    if isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        return list(model)
    raise TypeError(f"model_pieces: cannot split a {type(model).__name__}; give an "
                    "nn.Sequential, a list of modules, or a model with pipeline_pieces()")


def pipeline_stages(model, *, pp_group: dist.ProcessGroup, num_virtual: int = 1,
                    costs: Sequence[float] | None = None) -> list[PipelineStage]:
    """This rank's stages of ``model`` split into ``num_virtual * p`` chunks, ordered by stage
    index. Chunks owned by other ranks are not returned (their parameters can be freed)."""
    pp_size, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    num_stages = num_virtual * pp_size
    chunks = split_pieces(model_pieces(model), num_stages, costs=costs)
    return [PipelineStage(chunks[s], stage_index=s, num_stages=num_stages, pp_group=pp_group)
            for s in range(pp_rank, num_stages, pp_size)]
