"""Zero host-device syncs in steady state, counted by the runtime's own counter
(overlap.profile.syncs): after the first calls with a shape, every fused op x backend (forward
and backward), every quantized collective (sync and async), a pipeline step of every schedule,
a GradReducer bucket and a ShardedOptimizer step make none. The counter counts on CPU tensors
too, so the twin is as strict as a GPU here."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

WARMUP, STEADY = 2, 3


def test_the_counter_counts():
    from overlap.profile.syncs import count_host_syncs, not_a_device_sync

    t = torch.ones(3)
    with count_host_syncs() as c:
        t.sum().item()
        t.tolist()
        bool(t[0] > 0)
        with not_a_device_sync("a host-side counter"):
            t.sum().item()
    assert c.count == 3 and [w for w, _ in c.where] == ["item", "tolist", "__bool__"]


def _steady(fn):
    from overlap.profile.syncs import count_host_syncs

    for _ in range(WARMUP):
        fn()
    counts = []
    for _ in range(STEADY):
        with count_host_syncs() as c:
            fn()
        counts.append((c.count, c.where[:3]))
    return counts


def _fused_ops(backend, chunks=None):
    from overlap.tp import TPComm, all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

    world = dist.get_world_size()
    comm = TPComm(dist.group.WORLD, backend=backend, timeout=30, chunks=chunks)
    x = torch.randn(4, 8, requires_grad=True)
    xr = torch.randn(4 * world, 8, requires_grad=True)
    w = torch.randn(8, 6, requires_grad=True)

    def step():
        all_gather_matmul(x, w, comm=comm).sum().backward()
        matmul_reduce_scatter(xr, w, comm=comm).sum().backward()
        matmul_all_reduce(xr, w, comm=comm).sum().backward()

    if chunks == "auto":  # the race may sync (its one all-reduce of timings); after it, none
        for _ in range(1000):
            if comm.auto.kind is not None:
                break
            step()
        assert comm.auto.kind is not None
    out = _steady(step)
    comm.close()
    return out


# Triton at world 2 only: the interpreter is slow, and 4 ranks share 2 cores.
@pytest.mark.parametrize("backend, world", [("chunked", 2), ("chunked", 4), ("symmetric", 2),
                                            ("symmetric", 4), ("triton", 2), ("unfused", 2),
                                            ("unfused", 4)])
def test_fused_ops_make_no_host_sync(backend, world):
    for counts in run_ranks(_fused_ops, world, backend, timeout=120):
        assert all(n == 0 for n, _ in counts), counts


# chunks=1 (the whole collective: its stamps in an all-gather of their own) and "auto" once its
# race has decided, whatever it chose.
@pytest.mark.parametrize("chunks", (1, "auto"))
@pytest.mark.parametrize("backend, world", [("chunked", 2), ("chunked", 4), ("symmetric", 2)])
def test_whole_and_raced_calls_make_no_host_sync(backend, world, chunks):
    for counts in run_ranks(_fused_ops, world, backend, chunks, timeout=240):
        assert all(n == 0 for n, _ in counts), counts


def _quant(comm_dtype):
    from overlap.comm import quant

    g = dist.group.WORLD
    b = torch.randn(1024)
    shard = torch.randn(256)

    def step():
        quant.all_reduce(b, group=g, comm_dtype=comm_dtype)
        quant.reduce_scatter(b, group=g, comm_dtype=comm_dtype)
        quant.all_gather(shard, group=g, comm_dtype=comm_dtype)
        quant.all_reduce(b, group=g, comm_dtype=comm_dtype, async_op=True).wait()

    return _steady(step)


@pytest.mark.parametrize("comm_dtype", ["fp32", "bf16", "int8"])
def test_quantized_collectives_make_no_host_sync(comm_dtype):
    for counts in run_ranks(_quant, 2, comm_dtype):
        assert all(n == 0 for n, _ in counts), counts


def _pipeline(name, v):
    from overlap.models import GPT, GPTConfig, gpt_loss
    from overlap.pp import Pipeline, build_schedule, pipeline_stages

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, seq_len=8, d_model=16, n_layer=4, n_head=2))
    stages = pipeline_stages(model, pp_group=dist.group.WORLD, num_virtual=v)
    pipe = Pipeline(stages, build_schedule(name, pp_size=2, num_microbatches=4, num_virtual=v),
                    loss_fn=gpt_loss, pp_group=dist.group.WORLD, timeout=30)
    idx, tgt = torch.randint(0, 37, (8, 8)), torch.randint(0, 37, (8, 8))

    def step():
        pipe.step(idx, tgt)
        model.zero_grad(set_to_none=True)

    out = _steady(step)
    pipe.close()
    return out


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                     ("zb_h1", 1)])
def test_pipeline_step_makes_no_host_sync(name, v):
    for counts in run_ranks(_pipeline, 2, name, v):
        assert all(n == 0 for n, _ in counts), counts


def _data_parallel(comm_dtype, shard, cap=0):
    from overlap.dp.grad_reducer import GradReducer
    from overlap.dp.sharded_optimizer import ShardedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    red = GradReducer(model, dp_group=dist.group.WORLD, comm_dtype=comm_dtype, shard=shard,
                      bucket_cap_mb=cap, first_bucket_cap_mb=0, auto_trials=1)
    opt = (ShardedOptimizer(red, torch.optim.AdamW, lr=1e-3) if shard
           else torch.optim.SGD(model.parameters(), lr=1e-3))
    x = torch.randn(6, 16) * (dist.get_rank() + 1)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    while red.tuning:  # bucket_cap_mb="auto": the timed candidate layouts come first
        step()
    out = _steady(step)
    if shard:
        opt.close()
    red.close()
    return out


@pytest.mark.parametrize("comm_dtype, shard, cap", [
    ("fp32", False, 0), ("int8", False, 0), ("fp32", True, 0), ("bf16", True, 0),
    ("fp32", False, "auto"), ("bf16", True, "auto")])
def test_dp_buckets_and_sharded_step_make_no_host_sync(comm_dtype, shard, cap):
    for counts in run_ranks(_data_parallel, 2, comm_dtype, shard, cap):
        assert all(n == 0 for n, _ in counts), counts


def _region_collectives():
    """The region collectives of overlap.nn, stamped on the layer's TPComm (forward and
    backward of each): after the first calls, no host sync."""
    from overlap.nn.regions import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
    from overlap.tp import TPComm

    world = dist.get_world_size()
    comm = TPComm(dist.group.WORLD, backend="unfused", timeout=30)
    x = torch.randn(4 * world, 6, requires_grad=True)

    def step():
        y = reduce_from_tp(copy_to_tp(x, comm=comm), comm=comm)
        z = gather_from_sp(reduce_scatter_to_sp(y, 0, comm=comm), 0, comm=comm)
        z.sum().backward()

    out = _steady(step)
    comm.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_region_collectives_make_no_host_sync(world):
    for counts in run_ranks(_region_collectives, world, timeout=120):
        assert all(n == 0 for n, _ in counts), counts
