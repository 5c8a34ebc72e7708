"""ParallelDims: the rank layout (pure), validation, and real groups on N gloo ranks.

Expected groups are computed here from the formula
``rank = ((d*pp + p)*cp + c)*tp + t`` with ``d*cp + c = edp*ep + ep_rank`` by brute force
over coordinates, independently of ``ParallelDims.all_groups``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from overlap.dist.dims import ParallelDims
from harness import run_ranks

AXES5 = ("tp", "cp", "pp", "dp", "ep", "edp", "dcp")


def factorizations(world: int) -> list[tuple[int, int, int, int]]:
    """Every ordered (dp, pp, cp, tp) with product ``world``."""
    divs = [k for k in range(1, world + 1) if world % k == 0]
    return [(dp, pp, cp, tp) for dp, pp, cp, tp in itertools.product(divs, repeat=4)
            if dp * pp * cp * tp == world]


def with_ep(world: int) -> list[tuple[int, int, int, int, int]]:
    return [(dp, pp, cp, tp, ep) for dp, pp, cp, tp in factorizations(world)
            for ep in range(1, dp * cp + 1) if dp * cp % ep == 0]


def expected_groups(dp, pp, cp, tp, ep) -> dict[str, dict[int, list[int]]]:
    """axis -> global rank -> sorted members of its group, from the formula alone."""
    coord = {}
    for d, p, c, t in itertools.product(range(dp), range(pp), range(cp), range(tp)):
        x = d * cp + c
        coord[((d * pp + p) * cp + c) * tp + t] = {"dp": d, "pp": p, "cp": c, "tp": t,
                                                   "edp": x // ep, "ep": x % ep, "dcp": x}
    # Members of an axis group agree on every coordinate except that axis.
    keep = {"tp": ("dp", "pp", "cp"), "cp": ("dp", "pp", "tp"), "pp": ("dp", "cp", "tp"),
            "dp": ("pp", "cp", "tp"), "ep": ("edp", "pp", "tp"), "edp": ("ep", "pp", "tp"),
            "dcp": ("pp", "tp")}
    out = {}
    for axis, fixed in keep.items():
        out[axis] = {r: sorted(q for q in coord if all(coord[q][k] == coord[r][k] for k in fixed))
                     for r in coord}
    return out


# ---------------------------------------------------------------------------- pure layout

@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_layout_and_groups_every_factorization(world, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for dp, pp, cp, tp, ep in with_ep(world):
        grid = ParallelDims.layout(world_size=world, tp=tp, cp=cp, pp=pp, dp=dp)
        assert grid.shape == (dp, pp, cp, tp) and grid.dtype == torch.int64
        for d, p, c, t in itertools.product(range(dp), range(pp), range(cp), range(tp)):
            assert grid[d, p, c, t].item() == ((d * pp + p) * cp + c) * tp + t

        dims = ParallelDims.resolve(world_size=world, tp=tp, cp=cp, pp=pp, ep=ep)
        assert (dims.dp, dims.pp, dims.cp, dims.tp, dims.ep) == (dp, pp, cp, tp, ep)
        assert ParallelDims.resolve(world_size=world, tp=tp, cp=cp, pp=pp, dp=dp, ep=ep) == dims
        want = expected_groups(dp, pp, cp, tp, ep)
        size = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep, "edp": dp * cp // ep,
                "dcp": dp * cp}
        for axis in AXES5:
            groups = dims.all_groups(axis)
            # A partition: every rank in exactly one group, each of the axis' size.
            assert sorted(r for g in groups for r in g) == list(range(world)), (axis, groups)
            assert all(len(g) == size[axis] for g in groups)
            for r in range(world):
                got = dims.group_ranks(axis, r)
                assert sorted(got) == want[axis][r], (dims, axis, r)
                # Group rank i is the member whose coordinate on the axis is i.
                assert [dims.coords(q)[axis] for q in got] == list(range(size[axis]))
        for g in dims.all_groups("tp"):
            assert g == list(range(g[0], g[0] + tp))


def test_str_and_inference():
    dims = ParallelDims.resolve(world_size=8, tp=2, pp=2, ranks_per_node=8)
    assert str(dims) == "ParallelDims(world=8: dp=2 x pp=2 x cp=1 x tp=2, ep=1)"
    assert ParallelDims.resolve(world_size=16, tp=2, cp=2, pp=2, ranks_per_node=8).dp == 2
    assert ParallelDims.resolve(world_size=16, tp=8, ep=2, ranks_per_node=8).dp == 2


def test_ranks_per_node_from_env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ParallelDims.resolve(world_size=16, tp=4).ranks_per_node == 4
    with pytest.raises(ValueError, match=r"tp=8 is larger than ranks_per_node=4"):
        ParallelDims.resolve(world_size=16, tp=8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ParallelDims.resolve(world_size=16, tp=8).ranks_per_node == 16


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=8, tp=2, pp=2, dp=3), r"dp\*pp\*cp\*tp = 3\*2\*1\*2 = 12 but the world "
                                           r"size is 8"),
    (dict(world_size=8, tp=2, dp=2), r"= 4 but the world size is 8"),
    (dict(world_size=12, tp=8, ranks_per_node=16), r"cannot infer dp: world size 12 is not "
                                                   r"divisible by tp\*cp\*pp = 8\*1\*1 = 8"),
    (dict(world_size=6, tp=1, cp=2, pp=2), r"world size 6 is not divisible by .* = 4"),
    (dict(world_size=8, tp=2, dp=4, ep=3), r"ep=3 must divide dp\*cp = 4\*1 = 4"),
    (dict(world_size=8, tp=2, ep=8), r"ep=8 must divide dp\*cp = 4\*1 = 4"),
    (dict(world_size=8, tp=2, cp=2, ep=3), r"ep=3 must divide dp\*cp = 2\*2 = 4 \(expert "
                                           r"parallelism is carved out"),
    (dict(world_size=16, tp=16, ranks_per_node=8), r"tp=16 is larger than ranks_per_node=8"),
    (dict(world_size=12, tp=4, ranks_per_node=6), r"tp=4 must divide ranks_per_node=6"),
    (dict(world_size=8, tp=0), r"tp must be a positive int, got 0"),
    (dict(world_size=8, cp=-2), r"cp must be a positive int, got -2"),
    (dict(world_size=8, pp=-1), r"pp must be a positive int, got -1"),
    (dict(world_size=8, dp=0), r"dp must be a positive int \(or -1 to infer it.*got 0"),
    (dict(world_size=8, tp=2.0), r"tp must be a positive int, got 2.0 \(float\)"),
    (dict(world_size=8, ep=True), r"ep must be a positive int, got True \(bool\)"),
    (dict(world_size=0), r"world_size must be a positive int, got 0"),
    (dict(world_size=8, ranks_per_node=0), r"ranks_per_node must be a positive int, got 0"),
])
def test_resolve_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.resolve(**kwargs)


def test_layout_and_unbuilt_reject():
    with pytest.raises(ValueError, match=r"= 6 but the world size is 8"):
        ParallelDims.layout(world_size=8, tp=3, cp=1, pp=2, dp=1)
    dims = ParallelDims.resolve(world_size=4, tp=2, ranks_per_node=4)
    with pytest.raises(ValueError, match=r"axis must be one of"):
        dims.all_groups("xp")
    with pytest.raises(ValueError, match=r"rank 4 is outside world 4"):
        dims.group_ranks("tp", 4)
    with pytest.raises(RuntimeError, match=r"use ParallelDims.build"):
        dims.ranks("tp")
    with pytest.raises(RuntimeError, match=r"use ParallelDims.build"):
        dims.is_first_stage


# ----------------------------------------------------------------- real groups on N ranks

def _check_groups(dp, pp, cp, tp, ep):
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims.build(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep)
    want = expected_groups(dp, pp, cp, tp, ep)
    assert dims.mesh.mesh_dim_names == ("dp", "pp", "cp", "tp")
    assert dims.mesh.mesh.tolist() == ParallelDims.layout(
        world_size=world, tp=tp, cp=cp, pp=pp, dp=dp).tolist()
    report = {"str": str(dims)}
    for axis in AXES5:
        group = getattr(dims, f"{axis}_group")
        members = dist.get_process_group_ranks(group)
        assert sorted(members) == want[axis][rank], (axis, members)
        assert dims.ranks(axis) == members
        assert dist.get_rank(group) == getattr(dims, f"{axis}_rank")
        # Numeric wiring check: slot q holds q+1 on rank q, so the sum over the group is
        # exactly the member indicator (scaled), which no mis-wired group can fake.
        x = torch.zeros(world, dtype=torch.float64)
        x[rank] = rank + 1
        dist.all_reduce(x, group=group)
        ref = torch.zeros(world, dtype=torch.float64)
        ref[want[axis][rank]] = torch.tensor(want[axis][rank], dtype=torch.float64) + 1
        # Exact (tolerance 0): small integers in float64. torch.equal, not assert_close,
        # whose first call costs seconds of imports in a fresh rank.
        assert torch.equal(x, ref), (axis, x.tolist(), ref.tolist())
        report[axis] = members
    # PP neighbours wrap around: a token sent to next comes back from prev.
    pp_ranks = want["pp"][rank]
    assert dims.pp_prev_rank == pp_ranks[(dims.pp_rank - 1) % pp]
    assert dims.pp_next_rank == pp_ranks[(dims.pp_rank + 1) % pp]
    assert dims.is_first_stage == (dims.pp_rank == 0)
    assert dims.is_last_stage == (dims.pp_rank == pp - 1)
    if pp > 1:
        out = torch.tensor([float(rank)])
        got = torch.tensor([-1.0])
        reqs = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, out, dims.pp_next_rank, group=dims.pp_group),
            dist.P2POp(dist.irecv, got, dims.pp_prev_rank, group=dims.pp_group),
        ])
        for req in reqs:
            req.wait()
        assert got.item() == dims.pp_prev_rank
    report["coords"] = (dims.dp_rank, dims.pp_rank, dims.cp_rank, dims.tp_rank, dims.ep_rank)
    return report


def _multi_cases():
    cases = [(1, 1, 1, 1, 1)]
    cases += [(dp, pp, cp, tp, 1) for dp, pp, cp, tp in factorizations(2)] + [(2, 1, 1, 1, 2)]
    cases += [(dp, pp, cp, tp, 1) for dp, pp, cp, tp in factorizations(4)]
    cases += [(4, 1, 1, 1, 2), (2, 1, 1, 2, 2), (4, 1, 1, 1, 4)]
    cases += [(2, 2, 1, 2, 1), (2, 1, 2, 2, 1), (4, 1, 1, 2, 2)]
    # EP across dp x cp (ep > dp), and the 4-axis layout of the main job (tp2 x pp2 x dp2, ep2)
    cases += [(1, 1, 2, 1, 2), (2, 1, 2, 1, 4), (1, 2, 2, 2, 2), (2, 2, 1, 2, 2),
              (2, 1, 2, 2, 4)]
    return cases


def _check_cases(cases):
    # Several configs per job: rank start-up (imports) costs more than building the groups.
    out = []
    for case in cases:
        try:
            out.append(_check_groups(*case))
        except AssertionError as exc:
            raise AssertionError(f"dp, pp, cp, tp, ep = {case}: {exc}") from exc
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_build_groups_are_wired(world):
    cases = [c for c in _multi_cases() if c[0] * c[1] * c[2] * c[3] == world]
    per_rank = run_ranks(_check_cases, world, cases)
    for i, (dp, pp, cp, tp, ep) in enumerate(cases):
        reports = [per_rank[rank][i] for rank in range(world)]
        for rank, rep in enumerate(reports):
            assert rep["str"] == (f"ParallelDims(world={world}: dp={dp} x pp={pp} x cp={cp} "
                                  f"x tp={tp}, ep={ep})")
            d, p, c, t, e = rep["coords"]
            assert rank == ((d * pp + p) * cp + c) * tp + t and e == (d * cp + c) % ep
            # Every member of a group reports the same group: the ranks agree with each other.
            for axis in AXES5:
                for q in rep[axis]:
                    assert reports[q][axis] == rep[axis], (cases[i], axis, rank, q)


def _build_bad():
    # A TP group wider than a node: caught by validation, before any group exists.
    with pytest.raises(ValueError, match=rf"tp=2 is larger than ranks_per_node=1; .*"
                                         rf"\(rank {dist.get_rank()}\)"):
        ParallelDims.build(tp=2, ranks_per_node=1)
    # Every rank failed before creating a group, so the default group is still in step.
    x = torch.ones(1)
    dist.all_reduce(x, group=dist.group.WORLD)
    return x.item()


def test_build_rejects_on_every_rank():
    assert run_ranks(_build_bad, 2) == [2.0, 2.0]


def _build_with_other_arguments():
    # The last rank asks for another layout: every rank refuses naming the argument, and no
    # rank is left waiting alone in init_device_mesh.
    last = dist.get_rank() == dist.get_world_size() - 1
    n = dist.get_world_size()
    try:
        ParallelDims.build(tp=1 if last else 2, dp=n if last else n // 2)
    except ValueError as exc:
        return str(exc)
    return "built"


@pytest.mark.parametrize("world", [2, 4])
def test_build_with_other_arguments_per_rank_refuses_on_every_rank(world):
    for rank, msg in enumerate(run_ranks(_build_with_other_arguments, world, timeout=60)):
        assert "ParallelDims.build" in msg and "'tp'" in msg, (rank, msg)
        assert f"(rank {rank})" in msg, (rank, msg)
