"""The checks. Each runs on every rank, on that rank's device, against its reference, and
returns what it measured (``Measured``: value <= limit passes) or raises.

Every rank builds every input from fixed seeds and computes the unsharded reference locally;
every check gets its own process group (``ctx.new_group()``), so a failure stays in it.
Tolerances:
- fused TP ops, the pipeline step, the MoE layer and CP attention: max |got - ref| / (1 + max |ref|) <= 1e-5
  over the output and every gradient (fp32); the INT8 EP dispatch: err / Q(M) <= 1;
- INT8 collectives: max |err| / bound <= 1, the per-element bound of ``overlap.comm.quant``
  (Q(M) = M/254 + M*2^-21 + 2^-118 per quantization of a block with absmax M);
- BF16 collectives, u = 2^-8, A_i = sum_r |x_r,i|: all_gather u*|x_i|; reduce_scatter
  e = (u + n*2^-24)(1 + u)*A_i; all_reduce e + u*(|sum_i| + e);
- signal rings: exact.
The narrative: docs/design/planner.md.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from overlap.dist.device import ranks_per_gpu
from overlap.errors import OverlapError

__all__ = ["Measured", "CheckFailed", "RankContext", "plan", "TP_OPS", "TP_BACKENDS",
           "QUANT_OPS", "QUANT_DTYPES", "TIMEOUT_SLACK"]

TP_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
TP_BACKENDS = ("chunked", "symmetric", "triton")
QUANT_OPS = ("all_reduce", "reduce_scatter", "all_gather")
QUANT_DTYPES = ("int8", "bf16")
REL_TOL = 1e-5
TIMEOUT_SLACK = 10.0  # seconds on top of the timeout: a loaded machine schedules late
_BLOCK = 128          # INT8 block size (quant.DEFAULT_BLOCK_SIZE)


@dataclasses.dataclass(slots=True)
class Measured:
    value: float
    limit: float
    metric: str
    detail: str = ""  # what the check saw besides the number, e.g. the error it expected

    @property
    def passed(self) -> bool:
        return self.value <= self.limit  # NaN compares False: a NaN never passes


class CheckFailed(OverlapError, AssertionError):
    """A check's own verdict (as opposed to an error raised by the code under test)."""


@dataclasses.dataclass(kw_only=True)
class RankContext:
    check: str
    rank: int
    world: int
    device: torch.device
    op_timeout: float
    peer_timeout: float
    corrupt: bool                  # tests: perturb what this check observes
    barrier: Callable[[], None]    # over the control group, outside the groups under test

    def new_group(self) -> dist.ProcessGroup:
        return dist.new_group(timeout=timedelta(seconds=self.op_timeout))

    def randn(self, *shape: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=gen).to(self.device)

    def observed(self, t: torch.Tensor) -> torch.Tensor:
        if not self.corrupt:
            return t
        t = t.detach().clone()
        t.view(-1)[0] += 1e3  # far outside every check's limit
        return t


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / (1.0 + ref.abs().max()))


# ------------------------------------------------------------------------ fused TP ops
def _tp(op: str, backend: str) -> Callable[[RankContext], Measured]:
    def run(ctx: RankContext) -> Measured:
        from overlap.tp import TPComm, all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

        n, r, m, k, f = ctx.world, ctx.rank, 8, 16, 8
        xs, ws = ctx.randn(n, n * m, k, seed=1), ctx.randn(n, k, f, seed=2)
        gs = ctx.randn(n, n * m, f, seed=3)
        w = ws[r].clone().requires_grad_()
        with TPComm(ctx.new_group(), backend=backend, timeout=ctx.op_timeout,
                    device=ctx.device) as comm:
            if op == "all_gather_matmul":   # y = all_gather(x_shard) @ w_shard_n
                x = xs[0].chunk(n)[r].clone().requires_grad_()
                y = all_gather_matmul(x, w, comm=comm)
                dy = gs[r]
                ref_y = xs[0] @ ws[r]
                ref_dx = sum(gs[q] @ ws[q].T for q in range(n)).chunk(n)[r]
                ref_dw = xs[0].T @ dy
            else:                           # x_shard_k @ w_shard_k, reduced over ranks
                x = xs[r].clone().requires_grad_()
                full = sum(xs[q] @ ws[q] for q in range(n))
                if op == "matmul_reduce_scatter":
                    y = matmul_reduce_scatter(x, w, comm=comm)
                    dy, ref_y = gs[0].chunk(n)[r], full.chunk(n)[r]
                else:                       # dy is replicated, as the op's contract requires
                    y = matmul_all_reduce(x, w, comm=comm)
                    dy, ref_y = gs[0], full
                ref_dx, ref_dw = gs[0] @ ws[r].T, xs[r].T @ gs[0]
            y.backward(dy)
        err = max(_rel_err(ctx.observed(y), ref_y), _rel_err(x.grad, ref_dx),
                  _rel_err(w.grad, ref_dw))
        return Measured(err, REL_TOL, "rel err")

    return run


# ------------------------------------------------------------------ quantized collectives
def _int8_q(amax: torch.Tensor) -> torch.Tensor:
    return amax / 254 + amax * 2.0**-21 + 2.0**-118


def _quant_bound(op: str, dtype: str, xs: torch.Tensor, rank: int) -> torch.Tensor:
    """Per-element error bound (float64) of rank ``rank``'s output; xs [n, numel] in fp64."""
    n = xs.shape[0]
    if dtype == "int8":
        amax = xs.abs().view(n, -1, _BLOCK).amax(-1)          # [n, blocks]
        if op == "all_gather":
            return _int8_q(amax).repeat_interleave(_BLOCK, -1).reshape(-1)
        s = amax.sum(0)
        bound = _int8_q(amax).sum(0) + n * 2.0**-23 * s
        if op == "all_reduce":
            bound = bound + _int8_q(s * (1 + 2.0**-7) + n * 2.0**-142)
        bound = bound.repeat_interleave(_BLOCK)
    else:
        u, tiny = 2.0**-8, 2.0**-118  # tiny: subnormals may flush to zero
        if op == "all_gather":
            return (u * xs.abs() + tiny).reshape(-1)
        e = (u + n * 2.0**-24) * (1 + u) * xs.abs().sum(0)
        bound = e + tiny if op == "reduce_scatter" else e + u * (xs.sum(0).abs() + e) + tiny
    return bound if op == "all_reduce" else bound.chunk(n)[rank]


def _quant(op: str, dtype: str, mode: str) -> Callable[[RankContext], Measured]:
    def run(ctx: RankContext) -> Measured:
        from overlap.comm import quant

        n, r, shard = ctx.world, ctx.rank, 2 * _BLOCK  # shards of whole INT8 blocks
        numel = shard if op == "all_gather" else n * shard
        # Blocks spanning six orders of magnitude, so a wrong per-block scale shows.
        mag = 10.0 ** (4 * torch.rand(n, numel // _BLOCK, 1, generator=torch.Generator()
                                      .manual_seed(5)) - 2)
        xs = (ctx.randn(n, numel // _BLOCK, _BLOCK, seed=4) * mag.to(ctx.device)).view(n, -1)
        out = getattr(quant, op)(xs[r].clone(), group=ctx.new_group(), comm_dtype=dtype,
                                 async_op=mode == "async", timeout=ctx.op_timeout)
        if mode == "async":
            out = out.wait()
        x64 = xs.double()
        ref = {"all_gather": x64.reshape(-1), "all_reduce": x64.sum(0),
               "reduce_scatter": x64.sum(0).chunk(n)[r]}[op]
        got = ctx.observed(out).double().reshape(-1)
        ratio = (got - ref).abs() / _quant_bound(op, dtype, x64, r)
        return Measured(float(ratio.max()), 1.0, "err/bound")

    return run


# ------------------------------------------------------------------------ signal kernels
def _payload(ctx: RankContext, owner: int, k: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32, device=ctx.device) + 1000.0 * owner + k


def signal_ring(ctx: RankContext, rounds: int = 3, numel: int = 64) -> Measured:
    """Each round every rank writes into its right neighbour's buffer and signals it (slot 0),
    waits for its left neighbour's data, and acknowledges it (slot 1, so the writer may
    reuse the buffer next round). Host API: C++ atomics on CPU, stream-ordered kernels on GPU."""
    from overlap.symm.workspace import create_workspace

    n, r = ctx.world, ctx.rank
    right, left, worst = (r + 1) % n, (r - 1) % n, 0.0
    with create_workspace(ctx.new_group(), numel * 4, num_signals=2, device=ctx.device,
                          timeout=ctx.op_timeout) as ws:
        for k in range(1, rounds + 1):
            ws.wait(1, k - 1)                        # right has read round k-1
            ws.view(right, torch.float32, (numel,)).copy_(_payload(ctx, r, k, numel))
            ws.signal(right, 0, k)                   # release: payload before flag
            ws.wait(0, k)                            # acquire: left's payload is here
            got = ws.view(r, torch.float32, (numel,)).clone()
            ws.signal(left, 1, k)
            worst = max(worst, _rel_err(ctx.observed(got), _payload(ctx, left, k, numel)))
        ws.barrier()
        if hasattr(ws, "check_errors"):              # device-side wait errors (GPU)
            ws.check_errors()
    return Measured(worst, 0.0, "max |err|")


def signal_ring_triton(ctx: RankContext, rounds: int = 3, numel: int = 64) -> Measured:
    """The same ring with the Triton device functions (overlap.kernels.triton.signal): each
    rank publishes its own buffer, and its right neighbour's kernel waits on the flag, then
    pulls the data through the raw peer address. CPU (interpreter) only: pull_from_peer
    returns host tensors."""
    from overlap.kernels.triton.signal import pull_from_peer, signal_from_kernel
    from overlap.symm.workspace import create_workspace

    n, r = ctx.world, ctx.rank
    right, left, worst = (r + 1) % n, (r - 1) % n, 0.0
    with create_workspace(ctx.new_group(), numel * 4, num_signals=2, device=ctx.device,
                          timeout=ctx.op_timeout) as ws:
        for k in range(1, rounds + 1):
            ws.wait(1, k - 1)                        # right has pulled round k-1
            ws.view(r, torch.float32, (numel,)).copy_(_payload(ctx, r, k, numel))
            signal_from_kernel(ws.signal_ptr(right), k)
            got = pull_from_peer(ws.data_ptr(left), ws.signal_ptr(r), k, numel)
            signal_from_kernel(ws.signal_ptr(left) + 8, k)
            worst = max(worst, _rel_err(ctx.observed(got), _payload(ctx, left, k, numel)))
        ws.barrier()
    return Measured(worst, 0.0, "max |err|")


def torch_symmetric_memory(ctx: RankContext, numel: int = 64) -> Measured:
    """GPU only: allocate, rendezvous, and read the right neighbour's buffer."""
    import torch.distributed._symmetric_memory as symm_mem

    group = ctx.new_group()
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # torch 2.5-2.7 need it
        symm_mem.enable_symm_mem_for_group(group.group_name)
    t = symm_mem.empty(numel, dtype=torch.float32, device=ctx.device)
    t.copy_(_payload(ctx, ctx.rank, 1, numel))
    handle = symm_mem.rendezvous(t, group.group_name)
    handle.barrier()
    right = (ctx.rank + 1) % ctx.world
    got = handle.get_buffer(right, (numel,), torch.float32).clone()
    handle.barrier()
    return Measured(_rel_err(ctx.observed(got), _payload(ctx, right, 1, numel)), 0.0,
                    "max |err|")


def shared_gpu_memory(ctx: RankContext) -> None:
    """GPU, ranks sharing a GPU: a workspace maps its peers by CUDA IPC (torch's symmetric
    memory takes one rank per device) and says why; signal_ring runs the ring over it."""
    from overlap.symm.cuda import CUDA_IPC
    from overlap.symm.workspace import create_workspace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's own warning
        with create_workspace(ctx.new_group(), 1024, num_signals=2, device=ctx.device,
                              timeout=ctx.op_timeout) as ws:
            memory, why = ws.memory, ws.memory_fallback
    if memory != CUDA_IPC or "share a GPU" not in why:
        raise CheckFailed(f"ranks sharing a GPU: workspace memory {memory!r} ({why!r}), "
                          f"expected {CUDA_IPC!r} naming the shared GPU")


# --------------------------------------------------------------------------- pipeline
def pipeline_step(ctx: RankContext, steps: int = 2) -> Measured:
    """1F1B over all ranks (one GPT block per stage) vs the unsplit model: loss on the last
    stage's rank and every rank's parameter gradients, for a first and a steady-state step."""
    from overlap.models import GPT, GPTConfig, gpt_loss
    from overlap.pp import Pipeline, build_schedule, pipeline_stages

    n, m, vocab, seq = ctx.world, 2 * ctx.world, 37, 8
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, seq_len=seq, d_model=16, n_layer=n, n_head=2))
    model = model.to(ctx.device)
    reference = copy.deepcopy(model)
    group = ctx.new_group()
    stages = pipeline_stages(model, pp_group=group, num_virtual=1)
    owned = {id(p) for s in stages for p in s.module.parameters()}
    pipe = Pipeline(stages, build_schedule("1f1b", pp_size=n, num_microbatches=m),
                    loss_fn=gpt_loss, pp_group=group, timeout=ctx.op_timeout)
    if not owned:
        raise CheckFailed(f"rank {ctx.rank} holds no pipeline parameters")
    worst, compared = 0.0, 0
    try:
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            idx, tgt = (torch.randint(0, vocab, (2 * m, seq), generator=gen).to(ctx.device)
                        for _ in range(2))
            losses = []
            for x, y in zip(idx.chunk(m), tgt.chunk(m)):
                loss = gpt_loss(reference(x), y)
                (loss / m).backward()
                losses.append(loss.detach())
            out = pipe.step(idx, tgt)
            if out.loss is not None:
                worst = max(worst, _rel_err(ctx.observed(out.loss), torch.stack(losses).mean()))
                compared += 1
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                if id(p) in owned:
                    if p.grad is None:
                        raise CheckFailed(f"stage parameter {name} got no gradient")
                    worst = max(worst, _rel_err(ctx.observed(p.grad), q.grad))
                    compared += 1
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
    finally:
        pipe.close()
    return Measured(worst, REL_TOL, "rel err",
                    detail=f"{compared} tensors (losses, gradients) over {steps} steps")


# --------------------------------------------------------------------------- timeout
def missing_peer(ctx: RankContext) -> Measured | None:
    """all_gather_matmul (symmetric backend) after a warm-up call, on rank 0 only: rank 1 never
    joins, so rank 0 must raise within the communicator's timeout, naming the op."""
    from overlap.tp import TPComm, all_gather_matmul

    op, limit = "all_gather_matmul", ctx.peer_timeout + TIMEOUT_SLACK
    x, w = ctx.randn(8, 16, seed=6), ctx.randn(16, 8, seed=7)
    comm = TPComm(ctx.new_group(), backend="symmetric", timeout=ctx.peer_timeout,
                  device=ctx.device)
    try:
        all_gather_matmul(x, w, comm=comm)  # every rank: workspace built, shapes agreed
        if ctx.rank != 0:
            return None
        t0 = time.monotonic()
        try:
            all_gather_matmul(x, w, comm=comm)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
        except Exception as exc:  # noqa: BLE001 - any error type, as long as it names the op
            took, message = time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
        else:
            raise CheckFailed(f"{op} returned after {time.monotonic() - t0:.1f}s although "
                              f"rank 1 never joined; it must raise within {ctx.peer_timeout}s")
        if op not in message:
            raise CheckFailed(f"the error does not name the op {op}: {message}")
        if took < 0.5 * ctx.peer_timeout:
            raise CheckFailed(f"raised after {took:.2f}s, before the {ctx.peer_timeout}s "
                              f"timeout, so not by it: {message}")
        return Measured(float(ctx.observed(torch.tensor([took]))[0]), limit, "seconds to raise",
                        detail=message)
    finally:
        ctx.barrier()  # rank 1 stays out of the op until rank 0 has raised
        comm.close()


def stream_order(ctx: RankContext, rounds: int = 4, numel: int = 1 << 16) -> Measured:
    """The stream layer (overlap.dist.streams): a producer stream writes a buffer, a consumer
    stream waits on the producer's event and copies it out, the caller's stream waits on the
    consumer's event and reads. On a GPU these are CUDA streams; on CPU the twin's workers. A
    consumer that did not really wait would read the previous round's values."""
    from overlap.dist.streams import Stream

    prod = Stream(ctx.device, name="selftest producer")
    cons = Stream(ctx.device, name="selftest consumer")
    try:
        src = torch.zeros(numel, device=ctx.device)
        dst = torch.zeros(numel, device=ctx.device)
        worst = 0.0
        for k in range(1, rounds + 1):
            value = float(k * (ctx.rank + 1))
            prod.wait_current()
            prod.enqueue(lambda v=value: src.fill_(v), (src,))
            cons.wait_event(prod.record_event())
            cons.enqueue(lambda: dst.copy_(src), (src, dst))
            cons.record_event().wait(ctx.op_timeout, "selftest stream_order")
            got = ctx.observed(dst.clone())
            worst = max(worst, float((got - value).abs().max()))
    finally:
        prod.close(ctx.op_timeout)
        cons.close(ctx.op_timeout)
    return Measured(worst, 0.0, "max |err|")


def poisoned_output(ctx: RankContext, numel: int = 256) -> Measured:
    """The poisoned-output contract of the symmetric backend (overlap.symm.base): a workspace
    whose device-side wait gave up must turn an op's output into NaN (fp32, bf16 and fp16) and
    make the next op raise; a clean one must leave it alone. Runs the workspace's own
    poison_if_error (the CUDA kernel on GPUs, the C++ twin on CPU) on a local error record."""
    from overlap.symm.workspace import create_workspace

    bad = 0.0
    with create_workspace(ctx.new_group(), 1024, num_signals=2, device=ctx.device,
                          timeout=ctx.op_timeout) as ws:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch.ones(numel, dtype=dtype, device=ctx.device)
            ws.poison_if_error(out)  # clean record: unchanged
            bad += float((ctx.observed(out.float()) - 1).abs().max())
        record = ws._error_np
        saved = record.copy()
        record[:5] = (1, 0, 0, 0, (ctx.rank + 1) % ctx.world)  # as a timed-out wait writes it
        try:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                out = torch.ones(numel, dtype=dtype, device=ctx.device)
                ws.poison_if_error(out)
                bad += float((~out.float().isnan()).sum())
            try:
                ws.raise_pending("selftest.poisoned_output")
                bad += 1.0  # it must raise
            except TimeoutError as exc:
                if "selftest.poisoned_output" not in str(exc):
                    bad += 1.0
        finally:
            record[:] = saved
    return Measured(bad, 0.0, "wrong elements")


# ---------------------------------------------------------------- expert parallelism
def _ep_layer(mode: str, backend: str = "chunked") -> Callable[[RankContext], Measured]:
    """The MoE layer over an EP group of every rank vs the single-process reference: output,
    input gradient and every gradient of this rank's experts and the router."""
    def run(ctx: RankContext) -> Measured:
        from overlap.moe import EPComm, MoE, reference_moe

        n, r, d, f, e, k = ctx.world, ctx.rank, 16, 16, 2 * ctx.world, 2
        cf = 1.0 if mode == "capacity" else None
        xs, gs = ctx.randn(n, 12, d, seed=11), ctx.randn(n, 12, d, seed=12)
        torch.manual_seed(5)
        comm = EPComm(ctx.new_group(), chunks=2, timeout=ctx.op_timeout, backend=backend,
                      max_tokens=12 if backend == "symmetric" else None)
        layer = MoE(d, f, e, k, capacity_factor=cf, device=ctx.device, comm=comm)
        torch.manual_seed(5)
        ref = MoE(d, f, e, k, capacity_factor=cf, device=ctx.device)
        x = xs[r].clone().requires_grad_()
        y = layer(x)
        y.backward(gs[r])
        xr = [xs[q].clone().requires_grad_() for q in range(n)]
        outs = [reference_moe(xr[q], ref)[0] for q in range(n)]
        sum((o * gs[q]).sum() for q, o in enumerate(outs)).backward()
        mine = slice(r * (e // n), (r + 1) * (e // n))
        err = max(_rel_err(ctx.observed(y), outs[r]), _rel_err(x.grad, xr[r].grad),
                  _rel_err(layer.experts.w_gate_up.grad, ref.experts.w_gate_up.grad[mine]),
                  _rel_err(layer.experts.w_down.grad, ref.experts.w_down.grad[mine]))
        comm.close()
        return Measured(err, REL_TOL, "rel err",
                        f"EP {n}, {mode}, " + ("chunks 2" if backend == "chunked" else backend))

    return run


def ep_int8_dispatch(ctx: RankContext) -> Measured:
    """The INT8 dispatch with identity experts: every value the owner received within Q(M) of
    the exact one (M: its block's absmax)."""
    from overlap.moe import EPComm
    from overlap.moe.exchange import exchange, static_pieces

    n, r, el, cap, d = ctx.world, ctx.rank, 2, 3, 2 * _BLOCK
    comm = EPComm(ctx.new_group(), chunks=2, dispatch="int8", quant_block=_BLOCK,
                  timeout=ctx.op_timeout)
    rows = ctx.randn(n * el * cap, d, seed=20 + r)
    one = torch.zeros(1, device=ctx.device)
    back, _ = exchange(rows, one, one, static_pieces(n, el, cap, 2, ctx.device), comm,
                       lambda x, a, b, offs: x)
    bound = _int8_q(rows.reshape(-1, _BLOCK).abs().amax(1, keepdim=True))
    err = (ctx.observed(back) - rows).abs().reshape(-1, _BLOCK)
    return Measured(float((err / bound).max()), 1.0, "err/bound", f"EP {n}, block {_BLOCK}")


def ep_pipeline_pairs(ctx: RankContext) -> Measured:
    """A 1F1B step (m 4) of a two-block MoE GPT whose experts shard over every rank, with the
    forward/backward pairs that run under each other's all-to-alls vs the same step without:
    the loss and every gradient (a pair reorders the launches, never the arithmetic)."""
    from overlap.models import GPT, GPTConfig, gpt_loss
    from overlap.moe import EPComm
    from overlap.pp import Pipeline, build_schedule, pipeline_stages

    cfg = GPTConfig(vocab_size=37, seq_len=8, d_model=16, n_layer=2, n_head=2,
                    moe_experts=2 * ctx.world, moe_top_k=2)
    gen = torch.Generator().manual_seed(30 + ctx.rank)
    ids = torch.randint(0, 37, (8, 9), generator=gen).to(ctx.device)
    got, pairs = [], 0
    for paired in (True, False):
        torch.manual_seed(7)
        comm = EPComm(ctx.new_group(), chunks=2, timeout=ctx.op_timeout)
        model = GPT(cfg, ep_comm=comm).to(ctx.device)
        # pp 1: each rank its own pipeline (every rank creates every one-rank group)
        group = [dist.new_group([r], timeout=timedelta(seconds=ctx.op_timeout))
                 for r in range(ctx.world)][ctx.rank]
        pipe = Pipeline(pipeline_stages(model, pp_group=group),
                        build_schedule("1f1b", pp_size=1, num_microbatches=4),
                        loss_fn=gpt_loss, pp_group=group, timeout=ctx.op_timeout,
                        ep_comms=[comm] if paired else [])
        try:
            loss = pipe.step(ids[:, :-1], ids[:, 1:]).loss
            pairs = max(pairs, len(pipe.pairs))
            got.append([loss.detach()] + [p.grad for p in model.parameters()])
        finally:
            pipe.close()
            comm.close()
    if pairs == 0:
        raise CheckFailed("the schedule formed no forward/backward pair")
    err = max(_rel_err(ctx.observed(a) if i == 0 else a, b)
              for i, (a, b) in enumerate(zip(*got)))
    return Measured(err, REL_TOL, "rel err", f"EP {ctx.world}, {pairs} pairs per step")


# ---------------------------------------------------------------- context parallelism
def _cp_attention(method: str) -> Callable[[RankContext], Measured]:
    """Causal attention with grouped-query heads over a CP group of every rank (zig-zag
    pieces of one sequence) vs SDPA on the whole sequence: this rank's output rows and dQ,
    dK, dV."""
    def run(ctx: RankContext) -> Measured:
        import torch.nn.functional as F
        from overlap.cp import CPComm, cp_attention, zigzag_shard

        n, r, b, d = ctx.world, ctx.rank, 2, 8
        h, hk, s = 2 * n, n, 2 * n * 3
        q, do = ctx.randn(b, h, s, d, seed=40), ctx.randn(b, h, s, d, seed=41)
        k, v = ctx.randn(b, hk, s, d, seed=42), ctx.randn(b, hk, s, d, seed=43)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True).backward(do)
        ref_out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mine = [zigzag_shard(t, 2, cp=n, rank=r).clone().requires_grad_() for t in (q, k, v)]
        comm = CPComm(ctx.new_group(), timeout=ctx.op_timeout, device=ctx.device)
        try:
            out = cp_attention(*mine, comm=comm, causal=True, method=method)
            out.backward(zigzag_shard(do, 2, cp=n, rank=r))
        finally:
            comm.close()
        err = max(_rel_err(ctx.observed(out), zigzag_shard(ref_out, 2, cp=n, rank=r)),
                  *(_rel_err(m.grad, zigzag_shard(f.grad, 2, cp=n, rank=r))
                    for m, f in zip(mine, full)))
        return Measured(err, REL_TOL, "rel err", f"CP {n}, {method}, causal, GQA {h}/{hk}")

    return run


def plan(device: torch.device) -> list[tuple[str, Callable[[RankContext], Measured | None]]]:
    """Every check for this device type, in run order (the same list on every rank)."""
    checks: list[tuple[str, Callable[[RankContext], Measured | None]]] = [
        (f"tp.{op}.{be}", _tp(op, be)) for op in TP_OPS for be in TP_BACKENDS]
    checks += [(f"quant.{op}.{dt}.{mode}", _quant(op, dt, mode)) for op in QUANT_OPS
               for dt in QUANT_DTYPES for mode in ("sync", "async")]
    checks.append(("symm.signal_ring", signal_ring))
    if device.type == "cpu":
        checks.append(("symm.signal_ring.triton", signal_ring_triton))
    elif ranks_per_gpu() > 1:
        checks.append(("symm.shared_gpu_memory", shared_gpu_memory))
    else:
        checks.append(("symm.torch_symmetric_memory", torch_symmetric_memory))
    checks.append(("streams.event_order", stream_order))
    checks.append(("symm.poisoned_output", poisoned_output))
    checks.append(("pp.1f1b_step", pipeline_step))
    checks += [(f"ep.moe.{mode}", _ep_layer(mode)) for mode in ("capacity", "dropless")]
    checks.append(("ep.moe.symmetric", _ep_layer("dropless", "symmetric")))
    checks.append(("ep.int8_dispatch", ep_int8_dispatch))
    checks.append(("ep.pipeline_pairs", ep_pipeline_pairs))
    checks += [(f"cp.attention.{m}", _cp_attention(m)) for m in ("ring", "allgather",
                                                                  "ulysses")]
    checks.append(("timeout.missing_peer.all_gather_matmul", missing_peer))
    return checks
