"""ParallelDims: one object that splits the world into tp x cp x pp x dp process groups, plus
the expert-parallel (ep) and expert-data-parallel (edp) groups carved out of dp x cp.

Built once (``ParallelDims.build(...)``, a collective) and passed explicitly; no global
registry. ``resolve(...)`` validates without any process group. TP innermost, DP outermost::

    global rank = ((d * pp + p) * cp + c) * tp + t        d < dp, p < pp, c < cp, t < tp
    layout(...)[d, p, c, t] = global rank                 shape (dp, pp, cp, tp)
    ep divides dp*cp:  x = d * cp + c = edp_rank * ep + ep_rank

An EP group varies ep_rank (same edp_rank, p, t): the ranks that split the experts; an EDP
group varies edp_rank (same ep_rank, p, t): the ranks holding the same experts. A dcp group
(dp x cp, rank x) reduces a CP job's dense gradients. Groups come from a torch ``DeviceMesh``
of shape (dp, pp, cp, tp), NCCL or gloo; EP, EDP and DCP groups are separate communicators;
``comm_options(axis)`` their communicators' CommOptions. The narrative: docs/design/dist.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from overlap.defaults import positive_int
from overlap.dist import nccl_twin
from overlap.dist.communicator import CommOptions, options_of

__all__ = ["ParallelDims", "AXES"]

# Mesh order, outermost first. ep and edp are not mesh dims: they split dp x cp.
AXES = ("dp", "pp", "cp", "tp")
_ALL_AXES = ("tp", "cp", "pp", "dp", "ep", "edp", "dcp")
# The axes with a communicator (comm_options), and each one's default backend.
_COMM_BACKENDS = {"tp": "auto", "cp": None, "ep": "chunked"}


def _check_degree(name: str, value: Any, *, allow_infer: bool = False) -> None:
    if value == -1 and allow_infer and type(value) is int:
        return
    positive_int(value, f"ParallelDims: {name}",
                 extra=" (or -1 to infer it from the world size)" if allow_infer else "")


def _ranks_per_node_default(world_size: int) -> int:
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is None:
        return world_size
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"ParallelDims: env LOCAL_WORLD_SIZE={env!r} is not an int; "
                         "pass ranks_per_node explicitly") from None


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelDims:
    """Resolved degrees (``dp`` is never -1 here) and, after ``build``, this rank's groups.

    After ``resolve`` only the degrees are set; ``group_ranks(axis, rank)`` and ``layout`` work
    without a process group. After ``build`` every ``*_group``, ``*_rank``, ``mesh``, ``rank``
    and the PP neighbours are set too.
    """

    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    world_size: int
    ranks_per_node: int | None = None
    # Set by build(); None on a resolve()-only object.
    rank: int | None = None
    mesh: Any = dataclasses.field(default=None, repr=False)
    tp_group: Any = dataclasses.field(default=None, repr=False)
    cp_group: Any = dataclasses.field(default=None, repr=False)
    pp_group: Any = dataclasses.field(default=None, repr=False)
    dp_group: Any = dataclasses.field(default=None, repr=False)
    ep_group: Any = dataclasses.field(default=None, repr=False)
    edp_group: Any = dataclasses.field(default=None, repr=False)
    dcp_group: Any = dataclasses.field(default=None, repr=False)
    tp_rank: int | None = None
    cp_rank: int | None = None
    pp_rank: int | None = None
    dp_rank: int | None = None
    ep_rank: int | None = None
    edp_rank: int | None = None
    dcp_rank: int | None = None
    pp_prev_rank: int | None = None
    pp_next_rank: int | None = None

    @staticmethod
    def resolve(*, world_size: int, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = -1,
                ep: int = 1, ranks_per_node: int | None = None) -> "ParallelDims":
        """Validate the degrees against ``world_size`` and infer ``dp`` if it is -1.

        Pure: needs no process group. ``ranks_per_node`` defaults to env ``LOCAL_WORLD_SIZE``,
        else ``world_size`` (one node). Raises ValueError naming the offending numbers.
        """
        _check_degree("world_size", world_size)
        for name, value in (("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep)):
            _check_degree(name, value)
        _check_degree("dp", dp, allow_infer=True)
        if ranks_per_node is None:
            ranks_per_node = _ranks_per_node_default(world_size)
        _check_degree("ranks_per_node", ranks_per_node)

        model = tp * cp * pp
        if dp == -1:
            if world_size % model:
                raise ValueError(
                    f"ParallelDims: cannot infer dp: world size {world_size} is not divisible "
                    f"by tp*cp*pp = {tp}*{cp}*{pp} = {model}")
            dp = world_size // model
        elif dp * model != world_size:
            raise ValueError(
                f"ParallelDims: dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * model} but the world "
                f"size is {world_size}")
        if (dp * cp) % ep:
            raise ValueError(f"ParallelDims: ep={ep} must divide dp*cp = {dp}*{cp} = {dp * cp} "
                             "(expert parallelism is carved out of the data- and "
                             "context-parallel ranks)")
        if tp > ranks_per_node:
            raise ValueError(
                f"ParallelDims: tp={tp} is larger than ranks_per_node={ranks_per_node}; a TP "
                "group must stay inside one node")
        if ranks_per_node % tp:
            raise ValueError(
                f"ParallelDims: tp={tp} must divide ranks_per_node={ranks_per_node}, or TP "
                "groups would straddle nodes")
        return ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, world_size=world_size,
                            ranks_per_node=ranks_per_node)

    @staticmethod
    def layout(*, world_size: int, tp: int, cp: int, pp: int, dp: int) -> torch.Tensor:
        """Global ranks as an int64 tensor of shape (dp, pp, cp, tp):
        ``layout[d, p, c, t] = ((d*pp + p)*cp + c)*tp + t``."""
        for name, value in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)):
            _check_degree(name, value)
        if dp * pp * cp * tp != world_size:
            raise ValueError(
                f"ParallelDims.layout: dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * pp * cp * tp} "
                f"but the world size is {world_size}")
        return torch.arange(world_size, dtype=torch.int64).reshape(dp, pp, cp, tp)

    def rank_layout(self) -> torch.Tensor:
        """``layout`` for these degrees."""
        return ParallelDims.layout(world_size=self.world_size, tp=self.tp, cp=self.cp,
                                   pp=self.pp, dp=self.dp)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of global ``rank`` on every axis (``x = d*cp + c``: ``ep = x % ep``,
        ``edp = x // ep``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ParallelDims.coords: rank {rank} is outside world {self.world_size}")
        t = rank % self.tp
        c = rank // self.tp % self.cp
        p = rank // (self.tp * self.cp) % self.pp
        d = rank // (self.tp * self.cp * self.pp)
        x = d * self.cp + c
        return {"tp": t, "cp": c, "pp": p, "dp": d, "ep": x % self.ep, "edp": x // self.ep,
                "dcp": x}

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group on ``axis`` as a list of global ranks, in group-rank order. The groups
        of one axis partition the world."""
        grid = self.rank_layout()
        if axis == "dcp":  # dp x cp flattened, group rank x = d*cp + c
            grid = grid.permute(0, 2, 1, 3).reshape(self.dp * self.cp, self.pp, self.tp)
            return grid.movedim(0, -1).reshape(-1, self.dp * self.cp).tolist()
        if axis in ("ep", "edp"):
            # (d, p, c, t) -> (x = d*cp + c, p, t) -> (edp, ep, p, t); the axis last.
            grid = grid.permute(0, 2, 1, 3).reshape(self.dp * self.cp // self.ep, self.ep,
                                                    self.pp, self.tp)
            order = (0, 2, 3, 1) if axis == "ep" else (1, 2, 3, 0)
            return grid.permute(*order).reshape(-1, grid.shape[order[-1]]).tolist()
        if axis not in AXES:
            raise ValueError(f"ParallelDims: axis must be one of {_ALL_AXES}, got {axis!r}")
        i = AXES.index(axis)
        return grid.movedim(i, -1).reshape(-1, grid.shape[i]).tolist()

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """Global ranks of the group on ``axis`` that contains global ``rank`` (pure)."""
        self.coords(rank)  # range check
        for group in self.all_groups(axis):
            if rank in group:
                return group
        raise AssertionError("unreachable: the groups of an axis partition the world")

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group on ``axis`` (after ``build``)."""
        self._require_built("ranks")
        return self.group_ranks(axis, self.rank)

    @classmethod
    def build(cls, *, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = -1, ep: int = 1,
              ranks_per_node: int | None = None, device_type: str = "cpu") -> "ParallelDims":
        """Validate against ``dist.get_world_size()`` and create every group.

        Collective: every rank of the default group must call it with the same arguments.
        Validation happens before any group is created, so a bad config fails on every rank
        with the same ValueError instead of leaving some ranks waiting in ``new_group``.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build: the default process group is not "
                               "initialised (call dist.init_process_group first)")
        rank = dist.get_rank()
        # Checked before validation: a rank with other arguments must not wait alone in
        # init_device_mesh while its peers raise (or build other groups). One small all-gather.
        from overlap.dist.stamp import agree_on

        from overlap.dist.device import comm_device

        device = comm_device(dist.group.WORLD)
        agree_on("ParallelDims.build", dict(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep,
                                            ranks_per_node=ranks_per_node,
                                            device_type=device_type), device)
        try:
            dims = cls.resolve(world_size=dist.get_world_size(), tp=tp, cp=cp, pp=pp, dp=dp,
                               ep=ep, ranks_per_node=ranks_per_node)
        except ValueError as exc:
            raise ValueError(f"{exc} (rank {rank})") from None

        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (dims.dp, dims.pp, dims.cp, dims.tp),
                                mesh_dim_names=AXES)
        dims.mesh = mesh
        dims.rank = rank
        dims.tp_group = mesh.get_group("tp")
        dims.cp_group = mesh.get_group("cp")
        dims.pp_group = mesh.get_group("pp")
        dims.dp_group = mesh.get_group("dp")
        # Every rank calls new_group for every EP group, in the same order (new_group is
        # collective over the default group unless local synchronisation is used).
        dims.ep_group, _ = dist.new_subgroups_by_enumeration(dims.all_groups("ep"),
                                                             group_desc="ep")
        dims.edp_group, _ = dist.new_subgroups_by_enumeration(dims.all_groups("edp"),
                                                              group_desc="edp")
        # dense gradients of a CP job reduce over dp x cp (without CP: the dp group itself)
        dims.dcp_group = (dims.dp_group if dims.cp == 1 else dist.new_subgroups_by_enumeration(
            dims.all_groups("dcp"), group_desc="dcp")[0])
        # traced ops of the twin: gradient reductions over dcp and edp are data parallel's
        for axis, group in (("tp", dims.tp_group), ("cp", dims.cp_group), ("ep", dims.ep_group),
                            ("pp", dims.pp_group), ("dp", dims.dp_group),
                            ("dp", dims.dcp_group), ("dp", dims.edp_group)):
            nccl_twin.label(group, axis)
        coords = dims.coords(rank)
        dims.tp_rank, dims.cp_rank = coords["tp"], coords["cp"]
        dims.pp_rank, dims.dp_rank, dims.ep_rank = coords["pp"], coords["dp"], coords["ep"]
        dims.edp_rank, dims.dcp_rank = coords["edp"], coords["dcp"]
        pp_ranks = dims.group_ranks("pp", rank)
        dims.pp_prev_rank = pp_ranks[(dims.pp_rank - 1) % dims.pp]
        dims.pp_next_rank = pp_ranks[(dims.pp_rank + 1) % dims.pp]
        dims._check_wiring()
        return dims

    def comm_options(self, axis: str, **settings) -> CommOptions:
        """The CommOptions of a communicator on ``axis`` ("tp", "cp" or "ep"): the axis's
        default backend ("auto" for TP, "chunked" for EP), with ``settings`` (CommOptions
        fields; None keeps the default) put over them."""
        if axis not in _COMM_BACKENDS:
            raise ValueError(f"ParallelDims.comm_options: axis must be one of "
                             f"{sorted(_COMM_BACKENDS)}, got {axis!r}")
        return options_of(CommOptions(backend=_COMM_BACKENDS[axis]),
                          f"ParallelDims.comm_options({axis!r})", **settings)

    def tp_comm(self, options: CommOptions | None = None, *, backend: str | None = None,
                chunks: int | str | None = None, timeout: float | None = None,
                check_inputs: bool | None = None):
        """A TPComm on this rank's TP group with these settings (``options``, default
        ``comm_options("tp")``; the keywords override it). Collective over the TP group: every
        TP rank calls it with the same arguments. ``close_default_comms()`` closes it; an owner
        that wants its own lifetime builds ``TPComm(dims.tp_group, ...)`` instead."""
        self._require_built("tp_comm")
        from overlap.tp.comm import owned_comm

        opts = options_of(options or self.comm_options("tp"), "ParallelDims.tp_comm",
                          backend=backend, chunks=chunks, timeout=timeout,
                          check_inputs=check_inputs)
        return owned_comm(self.tp_group, opts)

    def cp_comm(self, options: CommOptions | None = None, **kwargs):
        """A CPComm on this rank's CP group (``options``, default ``comm_options("cp")``;
        ``kwargs`` as CPComm's); collective over the CP group; the caller closes it."""
        self._require_built("cp_comm")
        from overlap.cp.comm import CPComm

        return CPComm(self.cp_group, options or self.comm_options("cp"), **kwargs)

    def _check_wiring(self) -> None:
        # The mesh and our formula must agree, or every later collective is silently wrong.
        for axis in _ALL_AXES:
            got = dist.get_process_group_ranks(getattr(self, f"{axis}_group"))
            want = self.group_ranks(axis, self.rank)
            if got != want:
                raise RuntimeError(f"ParallelDims.build: rank {self.rank}: {axis} group has "
                                   f"ranks {got}, the layout says {want}")

    def _require_built(self, what: str) -> None:
        if self.rank is None:
            raise RuntimeError(f"ParallelDims.{what}: needs the groups; this object came from "
                               "resolve(), use ParallelDims.build()")

    @property
    def is_first_stage(self) -> bool:
        self._require_built("is_first_stage")
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        self._require_built("is_last_stage")
        return self.pp_rank == self.pp - 1

    def ep_comm(self, options: CommOptions | None = None, **kwargs):
        """An EPComm on this rank's EP group (``options``, default ``comm_options("ep")``;
        ``kwargs`` as EPComm's); the caller closes it."""
        self._require_built("ep_comm")
        from overlap.moe.comm import EPComm

        return EPComm(self.ep_group, options or self.comm_options("ep"), **kwargs)

    def __str__(self) -> str:
        return (f"ParallelDims(world={self.world_size}: dp={self.dp} x pp={self.pp} x "
                f"cp={self.cp} x tp={self.tp}, ep={self.ep})")
