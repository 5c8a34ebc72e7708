"""overlap.tp layers: each parallel layer's forward and backward equal the unsharded layer.

One rank job per world size runs every case (launching is the expensive part); each case is
then its own pytest item reading the cached result. Errors are max|got - want| / max|want|
(max-relative): fp32 must be within 1e-5 (only the summation order differs), bf16 within 2e-2
(the reduce-scatter rounds to bf16 at every hop, the reference once). Shapes are awkward on
purpose: K = 9 or 10, uneven vocabularies (V % tp != 0), batch 3.
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from harness import run_ranks
from overlap.tp.comm import default_comm

HAVE_TRITON_TP = importlib.util.find_spec("overlap.kernels.triton.tp_gemm") is not None
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Conv1D(nn.Module):
    """The Hugging Face GPT-2 layer's semantics (weight [in, out]); matched by class name."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1)


def _linear_cases(world):
    backends = ["chunked"] if world == 1 else ["chunked", "symmetric"]
    cases = []
    for backend in backends:
        for sp in (False, True):
            common = dict(backend=backend, sp=sp, dtype=torch.float32)
            cases += [dict(kind="column", b=3, t=2 * world, K=9, N=4 * world, bias=True, **common),
                      dict(kind="column", b=2, t=world, K=10, N=2 * world, bias=False,
                           gather=True, **common),
                      dict(kind="qkv", b=2, t=2 * world, K=10, N=3 * 2 * world, bias=True,
                           **common),
                      dict(kind="column", b=2, t=world, K=9, N=4 * world + 1, bias=False,
                           gather=True, **common),
                      dict(kind="row", b=3, t=2 * world, K=4 * world, N=7, bias=True, **common),
                      dict(kind="row", b=2, t=world, K=2 * world, N=9, bias=True,
                           scatter_input=True, **common)]
    # Sequence-first (t, b, K) and 2-D (M, K) activations; the sharded features divide by tp.
    for extra in (dict(b=3, t=2 * world, seq_first=True), dict(b=0, t=3 * world)):
        cases += [dict(kind="column", K=10, N=2 * world, **extra),
                  dict(kind="row", K=2 * world, N=10, **extra)]
        for c in cases[-2:]:
            c.update(bias=True, backend="chunked", sp=True, dtype=torch.float32)
    cases += [dict(kind=k, b=2, t=2 * world, K=16, N=4 * world, bias=True, backend="chunked",
                   sp=sp, dtype=torch.bfloat16) for k in ("column", "row") for sp in (False, True)]
    if HAVE_TRITON_TP and world > 1:
        cases += [dict(kind=k, b=1, t=world, K=8, N=2 * world, bias=True, backend="triton", sp=sp,
                       dtype=torch.float32) for k in ("column", "row") for sp in (False, True)]
    return cases


def _name(c):
    extra = "".join(f"-{k}" for k in ("gather", "scatter_input", "seq_first") if c.get(k))
    shape = f"{c['b']}x{c['t']}x{c['K']}x{c['N']}" if c["b"] else f"{c['t']}x{c['K']}x{c['N']}"
    dt = "bf16" if c["dtype"] == torch.bfloat16 else "fp32"
    return f"{c['kind']}-{c['backend']}-{'sp' if c['sp'] else 'nosp'}-{shape}-{dt}{extra}"


def _rel(got, want):
    want = want.double()
    return ((got.double() - want).abs().max() / (want.abs().max() + 1e-12)).item()


def _check_linear(c, group):
    from overlap.nn.layers import ColumnParallelLinear, RowParallelLinear

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    b, t, K, N, dtype = c["b"], c["t"], c["K"], c["N"], c["dtype"]
    ref = (Conv1D(N, K) if c["kind"] == "qkv" else nn.Linear(K, N, bias=c["bias"])).to(dtype)
    lead = (t, b) if c.get("seq_first") else ((b, t) if b else (t,))
    x = torch.randn(*lead, K, dtype=dtype)
    dy = torch.randn(*lead, N, dtype=dtype)
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    y_ref = ref(x).detach()
    seq = 0 if (c.get("seq_first") or not b) else 1
    opts = dict(comm=default_comm(group, backend=c["backend"]), sequence_parallel=c["sp"],
                seq_dim=0 if c.get("seq_first") else 1)

    def sp_piece(z):
        return z.chunk(tp, seq)[r] if c["sp"] else z

    if c["kind"] == "row":
        layer = RowParallelLinear.from_linear(ref, input_is_parallel=not c.get("scatter_input"),
                                              **opts)
        x_in = x if c.get("scatter_input") else x.chunk(tp, -1)[r]
        dx_want = xr.grad if c.get("scatter_input") else xr.grad.chunk(tp, -1)[r]
        y_want, dy_in = sp_piece(y_ref), sp_piece(dy)
    else:
        layer = ColumnParallelLinear.from_linear(ref, gather_output=bool(c.get("gather")),
                                                 parts=3 if c["kind"] == "qkv" else 1, **opts)
        x_in, dx_want = sp_piece(x), sp_piece(xr.grad)
        lo = sum(layer.local_sizes[:r])
        cols = torch.arange(lo, lo + layer.local_sizes[r])
        if c["kind"] == "qkv":  # local output is [q_r; k_r; v_r]
            cols = torch.cat([p.chunk(tp)[r] for p in torch.arange(N).chunk(3)])
        y_want = y_ref if c.get("gather") else y_ref[..., cols]
        dy_in = dy if c.get("gather") else dy[..., cols]
    x_in = x_in.clone().requires_grad_()
    y = layer(x_in)
    y.backward(dy_in)
    grads = layer.full_state_dict(grads=True)
    errs = {"y": _rel(y, y_want), "dx": _rel(x_in.grad, dx_want),
            "dw": _rel(grads["weight"], ref.weight.grad)}
    if getattr(ref, "bias", None) is not None:
        errs["db"] = _rel(grads["bias"], ref.bias.grad)
    return errs


def _check_shared(sp, backend, group):
    """column_parallel_shared (q, k, v as one GEMM) equals three unsharded linears."""
    from overlap.nn.layers import ColumnParallelLinear, column_parallel_shared

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(3)
    refs = [nn.Linear(10, n * tp) for n in (2, 1, 2)]
    x = torch.randn(3, 2 * tp, 10)
    xr = x.clone().requires_grad_()
    dys = [torch.randn(3, 2 * tp, m.out_features) for m in refs]
    for m, dy in zip(refs, dys):
        m(xr).backward(dy)
    comm = default_comm(group, backend=backend)
    layers = [ColumnParallelLinear.from_linear(m, comm=comm, sequence_parallel=sp) for m in refs]
    x_in = (x.chunk(tp, 1)[r] if sp else x).clone().requires_grad_()
    ys = column_parallel_shared(x_in, layers)
    torch.autograd.backward(ys, [dy.chunk(tp, -1)[r] for dy in dys])
    errs = {"dx": _rel(x_in.grad, xr.grad.chunk(tp, 1)[r] if sp else xr.grad)}
    for i, (m, ref, y) in enumerate(zip(layers, refs, ys)):
        errs[f"y{i}"] = _rel(y, ref(x).detach().chunk(tp, -1)[r])
        grads = m.full_state_dict(grads=True)
        errs[f"dw{i}"] = _rel(grads["weight"], ref.weight.grad)
        errs[f"db{i}"] = _rel(grads["bias"], ref.bias.grad)
    return errs


def _check_embedding(V, sp, seq_first, padding_idx, group):
    from overlap.nn.embedding import VocabParallelEmbedding

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(1)
    ref = nn.Embedding(V, 6, padding_idx=padding_idx)
    ids = torch.randint(0, V, (2 * tp, 3) if seq_first else (3, 2 * tp))
    ids.view(-1)[::5] = padding_idx if padding_idx is not None else 0
    e_ref = ref(ids)
    dy = torch.randn_like(e_ref)
    e_ref.backward(dy)
    layer = VocabParallelEmbedding.from_embedding(ref, comm=default_comm(group),
                                                  sequence_parallel=sp,
                                                  seq_dim=0 if seq_first else 1)
    seq = 0 if seq_first else 1
    piece = (lambda z: z.chunk(tp, seq)[r]) if sp else (lambda z: z)
    e = layer(ids)
    e.backward(piece(dy))
    return {"y": _rel(e, piece(e_ref)),
            "dw": _rel(layer.full_state_dict(grads=True)["weight"], ref.weight.grad)}


def _check_cross_entropy(V, dtype, reduction, ignore_index, group):
    from overlap.nn.embedding import vocab_parallel_cross_entropy
    from overlap.nn.sharding import shard_sizes

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(2)
    logits = (3 * torch.randn(3, 5, V)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (3, 5))
    targets[0, :2] = ignore_index
    loss = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)
    dl = torch.rand_like(loss)
    loss.backward(dl)
    sizes = shard_sizes(V, tp)
    lo = sum(sizes[:r])
    shard = logits.detach()[..., lo:lo + sizes[r]].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(shard, targets, group=group, ignore_index=ignore_index,
                                       reduction=reduction)
    got.backward(dl.reshape(got.shape).to(got.dtype))
    return {"loss": _rel(got.float().reshape(-1), loss.detach().reshape(-1)),
            "dlogits": _rel(shard.grad, logits.grad[..., lo:lo + sizes[r]])}


def _all_cases(world):
    """(name, fn-spec) for every case of this world size, in a fixed order."""
    cases = [(_name(c), ("linear", c)) for c in _linear_cases(world)]
    for backend in (["chunked"] if world == 1 else ["chunked", "symmetric"]):
        for sp in (False, True):
            cases.append((f"shared-qkv-{backend}-{'sp' if sp else 'nosp'}",
                          ("shared", sp, backend)))
    for V in (4 * world + 3, 8 * world):
        for sp in (False, True):
            cases.append((f"embedding-V{V}-{'sp' if sp else 'nosp'}", ("emb", V, sp, False, None)))
    cases.append((f"embedding-V{4 * world + 1}-sp-seqfirst-pad", ("emb", 4 * world + 1, True,
                                                                 True, 2)))
    for V in (4 * world + 3, 16):
        for dtype in (torch.float32, torch.bfloat16):
            for reduction in ("mean", "none"):
                dt = "bf16" if dtype == torch.bfloat16 else "fp32"
                cases.append((f"xent-V{V}-{dt}-{reduction}", ("xent", V, dtype, reduction, -100)))
    cases.append(("xent-V13-fp32-mean-ignore0", ("xent", 13, torch.float32, "mean", 0)))
    return cases


def _tol(spec):
    if spec[0] == "linear":
        return TOL[spec[1]["dtype"]]
    if spec[0] == "xent":
        return TOL[spec[2]]
    return TOL[torch.float32]


def _run_all(world):
    from overlap.tp import close_default_comms

    group, out = dist.group.WORLD, {}
    try:
        for name, spec in _all_cases(world):
            if spec[0] == "linear":
                out[name] = _check_linear(spec[1], group)
            elif spec[0] == "shared":
                out[name] = _check_shared(*spec[1:], group)
            elif spec[0] == "emb":
                out[name] = _check_embedding(*spec[1:], group)
            else:
                out[name] = _check_cross_entropy(*spec[1:], group)
    finally:
        close_default_comms()
    return out


_results: dict[int, list[dict]] = {}


def _results_for(world):
    if world not in _results:
        _results[world] = run_ranks(_run_all, world, world, timeout=240)
    return _results[world]


PARAMS = [pytest.param(w, name, _tol(spec), id=f"w{w}-{name}")
          for w in (1, 2, 4) for name, spec in _all_cases(w)]


@pytest.mark.parametrize("world,name,tol", PARAMS)
def test_layer_matches_unsharded(world, name, tol):
    for rank, res in enumerate(_results_for(world)):
        errs = res[name]
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, f"rank {rank}: {name}: max-relative errors {bad} exceed {tol}"


def _init_and_errors():
    from overlap.nn.embedding import VocabParallelEmbedding
    from overlap.nn.layers import ColumnParallelLinear, RowParallelLinear

    group, out = dist.group.WORLD, {}
    # Same seed -> the shards of the weight the unsharded layer would have drawn.
    for name, make, make_ref in (
            ("column", lambda: ColumnParallelLinear(9, 12, comm=default_comm(group)),
             lambda: nn.Linear(9, 12)),
            ("row", lambda: RowParallelLinear(12, 7, bias=False, comm=default_comm(group)),
             lambda: nn.Linear(12, 7, bias=False)),
            ("embedding", lambda: VocabParallelEmbedding(13, 5, comm=default_comm(group)),
             lambda: nn.Embedding(13, 5))):
        torch.manual_seed(7)
        full = make().full_state_dict()
        torch.manual_seed(7)
        want = make_ref().state_dict()
        out[f"init-{name}"] = all(torch.equal(full[k], want[k]) for k in want) and \
            full.keys() == want.keys()
    errors = []
    comm = default_comm(group)
    for fn in (lambda: RowParallelLinear(10, 4, comm=comm),                      # 10 % 4
               lambda: ColumnParallelLinear(4, 9, parts=3, comm=comm),          # 3 % 4
               lambda: ColumnParallelLinear(4, 8),                              # no comm
               lambda: ColumnParallelLinear(4, 8, comm=group),                  # not a TPComm
               lambda: ColumnParallelLinear.from_linear(nn.Conv2d(2, 2, 1), comm=comm),
               lambda: ColumnParallelLinear(4, 8, comm=comm)(torch.randn(2, 5)),
               lambda: ColumnParallelLinear(4, 8, tp_group=group)):             # removed form
        try:
            fn()
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    out["errors"] = errors
    return out


def test_same_init_as_unsharded_and_clear_errors():
    res = run_ranks(_init_and_errors, 4)
    for rank, r in enumerate(res):
        for key in ("init-column", "init-row", "init-embedding"):
            assert r[key] is True, f"rank {rank}: {key} differs from the unsharded init"
        errs = r["errors"]
        assert all(e is not None for e in errs), f"rank {rank}: some bad input passed: {errs}"
        assert "in_features=10 must be divisible by tp=4" in errs[0]
        assert "parts" in errs[1] and "tp=4" in errs[1]
        assert errs[2].startswith("TypeError") and "comm= must be a TPComm" in errs[2]
        assert "got nothing" in errs[2] and "ColumnParallelLinear" in errs[2]
        assert "comm= must be a TPComm" in errs[3] and "ProcessGroup" in errs[3]
        assert errs[4].startswith("TypeError") and "Conv2d" in errs[4]
        assert "input last dim must be 4" in errs[5] and f"tp rank {rank}" in errs[5]
        assert errs[6].startswith("TypeError") and "tp_group" in errs[6]


def _cross_entropy_disagreements():
    """Every rank passes a vocab shard of its own and the same targets, except that the last
    rank changes one of: a target, ignore_index, reduction, the logits' dtype."""
    from overlap.nn.embedding import vocab_parallel_cross_entropy

    group, rank, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    last = rank == n - 1
    out = {}
    for case in ("agree", "target", "ignore_index", "reduction", "dtype"):
        g = torch.Generator().manual_seed(3)
        targets = torch.randint(0, 4 * n, (2, 5), generator=g)
        shard = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(rank))
        kw = dict(ignore_index=-100, reduction="mean")
        if last and case == "target":
            targets[1, 3] = (targets[1, 3] + 1) % (4 * n)
        if last and case == "ignore_index":
            kw["ignore_index"] = 0
        if last and case == "reduction":
            kw["reduction"] = "none"
        if last and case == "dtype":
            shard = shard.double()
        try:
            got = vocab_parallel_cross_entropy(shard, targets, group=group, **kw)
            out[case] = ("numbers", got.detach().double())
        except ValueError as exc:
            out[case] = ("ValueError", str(exc))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_cross_entropy_ranks_that_disagree_raise_on_every_rank(world):
    """Replicated targets and options are compared in the all-gather the op makes anyway: a
    rank with another target, ignore_index, reduction or logits dtype would compute another
    loss (or abort gloo on a dtype mismatch) without it."""
    want = {"target": "checksum of the targets", "ignore_index": "ignore_index differs",
            "reduction": "reduction", "dtype": "dtype differs"}
    res = run_ranks(_cross_entropy_disagreements, world)
    for rank, r in enumerate(res):
        assert r["agree"][0] == "numbers", (rank, r["agree"])
        for case, words in want.items():
            kind, msg = r[case]
            assert kind == "ValueError" and words in msg, (rank, case, r[case])
            assert f"(rank {rank})" in msg, (rank, msg)
