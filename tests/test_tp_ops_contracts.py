"""overlap.tp.ops contracts beyond the numbers: bad input gets a clear error naming the op, the
argument and the rank (before any collective, and on every rank when ranks disagree); a
workspace that is too small is refused; a missing peer times out instead of hanging; >= 100
back-to-back calls with varying shapes neither deadlock nor leak (threads, mappings, /dev/shm);
every chunk's comm and GEMM shows up as a profiler range."""

import gc
import importlib.util
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

HAVE_TRITON_TP = importlib.util.find_spec("overlap.kernels.triton.tp_gemm") is not None


def _raises(exc, fn) -> str:
    with pytest.raises(exc) as info:
        fn()
    return str(info.value)


def _refused(exc, fn, after=None) -> str:
    """The refusal's message. A refused call fails the (default) communicator: a good call
    after it raises 'failed earlier' with the first error, until close_default_comms()."""
    from overlap.tp import TPCommFailed, close_default_comms

    msg = _raises(exc, fn)
    if after is not None:
        again = _raises(TPCommFailed, after)
        assert "communicator failed earlier" in again and msg in again, (msg, again)
    close_default_comms()
    return msg


def _bad_inputs(backend):
    from overlap.tp import (all_gather_matmul, close_default_comms, matmul_all_reduce,
                            matmul_reduce_scatter)

    g, r = dist.group.WORLD, dist.get_rank()
    x, w = torch.randn(12, 72), torch.randn(72, 40)
    kw = dict(group=g, backend=backend)

    def refuse(exc, fn) -> str:
        return _refused(exc, fn, after=lambda: all_gather_matmul(x, w, **kw))

    m = {}
    m["rs_m"] = refuse(ValueError, lambda: matmul_reduce_scatter(torch.randn(13, 72), w, **kw))
    m["k"] = refuse(ValueError, lambda: all_gather_matmul(x, torch.randn(71, 40), **kw))
    m["dtype"] = refuse(TypeError, lambda: matmul_all_reduce(x, w.bfloat16(), **kw))
    m["int"] = refuse(TypeError, lambda: matmul_all_reduce(x.long(), w.long(), **kw))
    m["x_dims"] = refuse(ValueError, lambda: all_gather_matmul(torch.randn(72), w, **kw))
    m["w_dims"] = refuse(ValueError, lambda: matmul_all_reduce(x, w[None], **kw))
    m["chunks"] = refuse(ValueError, lambda: all_gather_matmul(x, w, chunks=3, **kw))
    m["group"] = _raises(TypeError, lambda: all_gather_matmul(x, w, group=None))
    m["seq_dim"] = refuse(ValueError, lambda: all_gather_matmul(x, w, seq_dim=1, **kw))
    # Ranks that disagree: detected by the metadata check on every rank (symmetric: when the
    # context for these shapes is created, i.e. on this first call).
    m["ranks_x"] = refuse(ValueError, lambda: all_gather_matmul(torch.randn(12 + r, 72), w, **kw))
    m["ranks_w"] = refuse(ValueError, lambda: matmul_reduce_scatter(
        torch.randn(12, 72), torch.randn(72, 40 + 2 * r), **kw))
    if not HAVE_TRITON_TP:
        m["triton"] = refuse(ValueError,
                              lambda: all_gather_matmul(x, w, group=g, backend="triton"))
    else:  # the kernels have no float64: refused before anything runs
        m["triton64"] = _refused(TypeError, lambda: all_gather_matmul(
            x.double(), w.double(), group=g, backend="triton"))
    ok = []
    # A rebuilt communicator works: nothing above left the group in a bad state.
    y = all_gather_matmul(x, w, **kw)
    ok.append(float((y - torch.cat(_all(x)) @ w).abs().max()))
    close_default_comms()
    return m, ok


def _all(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t, group=dist.group.WORLD)
    return out


@pytest.mark.parametrize("backend", ["chunked", "symmetric"])
def test_bad_inputs_get_clear_errors(backend):
    for r, (m, ok) in enumerate(run_ranks(_bad_inputs, 2, backend)):
        at = f"(rank {r} of group [0, 1])"
        assert all(at in v for k, v in m.items() if k != "group"), m
        assert "matmul_reduce_scatter: x.shape[0] = 13 (the scattered dim M) must be divisible " \
               "by the group size 2" in m["rs_m"]
        assert "all_gather_matmul: K mismatch: x_shard.shape[-1] = 72 but w.shape[0] = 71" in m["k"]
        assert "must have the same dtype, got x torch.float32 and w torch.bfloat16" in m["dtype"]
        assert "dtype must be one of float32" in m["int"]
        assert "x_shard must be 2-D [M, K] or 3-D" in m["x_dims"]
        assert "w must be 2-D [K, N]" in m["w_dims"]
        assert "chunks = 3 must be 1 (the whole collective) or a multiple of the group size 2" in m["chunks"]
        assert "group must be a torch.distributed ProcessGroup" in m["group"]
        assert "seq_dim must be 0, or 1 for a batch-first 3-D" in m["seq_dim"]
        assert ("all_gather_matmul: ranks disagree on x shape: rank 0=(12, 72), rank 1=(13, 72) "
                "(ranks [1] differ from rank 0)") in m["ranks_x"]
        assert "matmul_reduce_scatter: ranks disagree on w shape: rank 0=(72, 40), " \
               "rank 1=(72, 42)" in m["ranks_w"]
        if not HAVE_TRITON_TP:
            assert "backend='triton' needs overlap.kernels.triton.tp_gemm" in m["triton"]
        else:
            assert "backend='triton' supports float32, bfloat16 and float16, got " \
                   "torch.float64" in m["triton64"]
        assert ok == [0.0] * len(ok)


def _missing_peer(backend):
    from overlap.symm.workspace import SignalTimeout
    from overlap.tp import TPComm, all_gather_matmul, matmul_reduce_scatter

    g, r = dist.group.WORLD, dist.get_rank()
    op = all_gather_matmul if backend == "ag" else matmul_reduce_scatter
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    comm = TPComm(g, backend="symmetric", timeout=0.5, check_inputs=False)
    out = None
    if r == 0:  # rank 1 never joins this op
        t0 = time.monotonic()
        with pytest.raises(SignalTimeout) as info:
            op(x, w, comm=comm)
        out = (time.monotonic() - t0, str(info.value), comm.failed is not None)
    dist.barrier(group=g)
    comm.close()
    return out


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_missing_peer_times_out_instead_of_hanging(op):
    took, msg, closed = run_ranks(_missing_peer, 2, op)[0]
    assert 0.5 <= took < 10 and closed
    assert "of rank 0 in group [0, 1] did not reach 1 within 0.5s" in msg


def _chunked_missing_peer(op_name):
    from overlap.tp import TPComm, all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

    # A group of its own: the timed-out transfer fails its communicator (as NCCL's would).
    g, r = dist.new_group([0, 1]), dist.get_rank()
    op = {"ag": all_gather_matmul, "rs": matmul_reduce_scatter, "ar": matmul_all_reduce}[op_name]
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    comm = TPComm(g, backend="chunked", chunks=2, timeout=0.5, check_inputs=False)
    out = None
    if r == 0:  # rank 1 never joins this op: rank 0's receive from it must give up, named
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            op(x, w, comm=comm)
        out = (time.monotonic() - t0, str(info.value), comm.failed is not None)
    dist.barrier()
    return out


@pytest.mark.parametrize("op,what", [
    ("ag", "receive of piece 1 from the left neighbour (rank 1)"),
    ("rs", "receive of partial sum 1 from the left neighbour (rank 1)"),
    ("ar", "exchange of partial product block 0 with rank 1")])
def test_chunked_missing_peer_names_the_transfer_and_times_out(op, what):
    took, msg, failed = run_ranks(_chunked_missing_peer, 2, op)[0]
    assert 0.4 <= took < 10 and failed
    assert f"(chunked): {what} timed out after at most 0.5s on rank 0 of group [0, 1]" in msg, msg


def _mapped_segments() -> int:
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/overlap_" in line for line in f)


def _many_calls(num_calls):
    from overlap.tp import (TPComm, all_gather_matmul, close_default_comms, matmul_all_reduce,
                            matmul_reduce_scatter)
    from overlap.tp.comm import MAX_CONTEXTS, default_comm

    g, r, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    threads0, maps0, fds0 = threading.active_count(), _mapped_segments(), len(os.listdir(
        "/proc/self/fd"))
    backends = ["chunked", "symmetric", "auto"]
    worst, most_cached = 0.0, 0
    for i in range(num_calls):
        gen = torch.Generator().manual_seed(i)
        m, k, n = 2 + (i % 7) * 3, 8 + (i % 5) * 4, 4 + (i % 3) * 4
        backend = backends[(i // 3) % 3]
        xs = torch.randn(world, world * m, k, generator=gen)
        ws = torch.randn(world, k, n, generator=gen)
        total = sum(xs[q] @ ws[q] for q in range(world))
        if i % 3 == 0:
            x = xs[0][r * m:(r + 1) * m].requires_grad_(i % 10 == 0)
            y, ref = all_gather_matmul(x, ws[r], group=g, backend=backend), xs[0] @ ws[r]
        elif i % 3 == 1:
            x = xs[r].requires_grad_(i % 10 == 1)
            y = matmul_reduce_scatter(x, ws[r], group=g, backend=backend)
            ref = total[r * m:(r + 1) * m]
        else:
            x = xs[r].requires_grad_(i % 10 == 2)
            y, ref = matmul_all_reduce(x, ws[r], group=g, backend=backend), total
        if x.requires_grad:
            y.sum().backward()
        worst = max(worst, float((y.detach() - ref).abs().max() / ref.abs().max()))
        most_cached = max(most_cached, max(default_comm(g, backend=b).num_contexts()
                                           for b in backends))
    # Bursts on the same contexts, ranks skewed by random sleeps: the phase-parity double
    # buffers and acks must keep a fast rank from overwriting what a slow one has not read.
    skew = torch.Generator().manual_seed(r)
    x_ag, x_rs, w = torch.randn(6, 8), torch.randn(6 * world, 8), torch.randn(8, 4)
    ag_ref, rs_ref = torch.cat(_all(x_ag)) @ w, sum(_all(x_rs @ w))
    for i in range(40):
        time.sleep(float(torch.rand((), generator=skew)) * 2e-3)
        x_ag.add_(1.0)  # a different payload every call: a stale read shows up
        ag_ref += torch.ones(6 * world, 8) @ w
        x_rs.add_(1.0)
        rs_ref += world * (torch.ones(6 * world, 8) @ w)
        y = all_gather_matmul(x_ag, w, group=g, backend="symmetric")
        z = matmul_reduce_scatter(x_rs, w, group=g, backend="symmetric")
        worst = max(worst, float((y - ag_ref).abs().max() / ag_ref.abs().max()),
                    float((z - rs_ref[r * 6:(r + 1) * 6]).abs().max() / rs_ref.abs().max()))
    with TPComm(g) as picked:  # what backend='auto' resolves to here
        auto = picked.backend
    close_default_comms()
    gc.collect()
    time.sleep(0.1)  # joined copier threads are gone from threading.enumerate() at once
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"overlap_{os.getpid()}_")]
    return dict(worst=worst, auto=auto, most_cached=most_cached, max_cached=MAX_CONTEXTS,
                threads=(threads0, threading.active_count()), maps=(maps0, _mapped_segments()),
                fds=(fds0, len(os.listdir("/proc/self/fd"))), shm=leftovers)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_many_back_to_back_calls_neither_hang_nor_leak(world):
    num_calls = {1: 30, 2: 120, 4: 102}[world]
    for res in run_ranks(_many_calls, world, num_calls, timeout=120):
        assert res["worst"] < 1e-5
        assert res["auto"] == ("symmetric" if world > 1 else "chunked")
        assert res["most_cached"] <= res["max_cached"]
        assert res["threads"][1] == res["threads"][0], res
        assert res["maps"][1] == res["maps"][0], res
        assert res["fds"][1] <= res["fds"][0], res
        assert res["shm"] == []


def _profiled():
    import contextlib

    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from overlap.tp import all_gather_matmul, close_default_comms, matmul_reduce_scatter

    g, world, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    # chunks=world: the pieces this test names (the default "auto" might run them whole).
    all_gather_matmul(x, w, group=g, backend="symmetric", chunks=world)  # the copier exists
    # Rank 0 only: starting the profiler costs seconds of CPU. All threads, for the copier's.
    prof = profile(activities=[ProfilerActivity.CPU],
                   experimental_config=_ExperimentalConfig(profile_all_threads=True))
    with prof if r == 0 else contextlib.nullcontext():
        all_gather_matmul(x, w, group=g, backend="chunked", chunks=2 * world)
        matmul_reduce_scatter(torch.randn(8 * world, 16), w, group=g, backend="symmetric",
                              chunks=world)
        all_gather_matmul(x, w, group=g, backend="symmetric", chunks=world)
    close_default_comms()
    if r:
        return []
    return sorted({e.name for e in prof.events() if "matmul" in e.name and "." in e.name})


def test_every_chunk_has_comm_and_gemm_ranges():
    names = run_ranks(_profiled, 2)[0]
    for t in range(4):  # chunks = 4: pieces 0..3, pieces 2..3 arrive over the ring
        assert f"all_gather_matmul.chunked.gemm[{t}]" in names
    assert "all_gather_matmul.chunked.comm[2]" in names
    assert "all_gather_matmul.chunked.comm[3].wait" in names
    for r in range(2):
        assert f"matmul_reduce_scatter.symmetric.gemm[{r}]" in names or \
            f"matmul_reduce_scatter.symmetric.gemm[{r}.0]" in names
    assert "matmul_reduce_scatter.symmetric.comm[1].reduce" in names or \
        "matmul_reduce_scatter.symmetric.comm[0].reduce" in names
    assert "all_gather_matmul.symmetric.comm[publish]" in names
    # ranges inside the copy thread
    assert "all_gather_matmul.symmetric.comm[1.0]" in names
    assert "matmul_reduce_scatter.symmetric.comm[1.0]" in names
