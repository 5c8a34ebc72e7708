"""TPComm: lifetime (close frees everything), independence of two communicators on one group,
no stale state for a recreated group, and failures that stay failures: a one-sided error
followed by a retry raises on both ranks and never returns numbers; a dead peer is named within
about a second; a stalled peer is reported at the communicator's timeout. Every backend."""

import gc
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import fail_signals_then_call, run_ranks, run_ranks_outcomes

BACKENDS = ["chunked", "symmetric", "triton"]


def _data(world, rank, m=4, k=8, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(world, m, k, generator=g)
    w = torch.randn(k, n, generator=g)
    return xs[rank], w, torch.cat(list(xs)) @ w


def _mapped_segments() -> int:
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/overlap_" in line for line in f)


def _close_frees_everything(backend):
    from overlap.tp import TPComm, TPCommFailed, all_gather_matmul, matmul_reduce_scatter

    r, world = dist.get_rank(), dist.get_world_size()
    threads0, maps0 = threading.active_count(), _mapped_segments()
    # chunks=world: both calls run in pieces, with a workspace each ("auto" might run whole)
    comm = TPComm(dist.group.WORLD, backend=backend, timeout=30, chunks=world)
    x, w, ref = _data(world, r)
    err = float((all_gather_matmul(x, w, comm=comm) - ref).abs().max())
    # Every rank passes [x_r; x_r; ...]: its block of the sum over ranks is sum_q x_q @ w.
    y = matmul_reduce_scatter(torch.cat([x] * world), w, comm=comm)
    err = max(err, float((y - sum(ref.chunk(world))).abs().max()))
    during = (comm.num_contexts(), _mapped_segments() - maps0)
    comm.close()
    gc.collect()
    time.sleep(0.1)
    after = (comm.num_contexts(), _mapped_segments() - maps0, threading.active_count() - threads0)
    try:
        all_gather_matmul(x, w, comm=comm)
        again = "returned"
    except TPCommFailed as exc:
        again = str(exc)
    mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"overlap_{os.getpid()}_")]
    return err, during, after, again, mine


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_leaves_no_workspace_thread_or_segment(backend):
    for err, during, after, again, mine in run_ranks(_close_frees_everything, 2, backend):
        assert err < 1e-5
        if backend != "chunked":
            assert during[0] == 2 and during[1] > 0  # two workspaces, mapped
        assert after == (0, 0, 0), after
        assert "was closed" in again and mine == []


def _two_comms(backend):
    from overlap.tp import TPComm, TPCommFailed, all_gather_matmul

    r, world = dist.get_rank(), dist.get_world_size()
    a = TPComm(dist.group.WORLD, backend=backend, timeout=30)
    b = TPComm(dist.group.WORLD, backend=backend, timeout=30)
    errs = []
    for step in range(6):  # interleaved calls, different data per comm and step
        x, w, ref = _data(world, r, seed=step)
        comm = a if step % 2 else b
        errs.append(float((all_gather_matmul(x * (1 + step), w, comm=comm) - ref * (1 + step))
                          .abs().max()))
    shared = set(id(c.ws) for c in a._contexts.values()) & set(id(c.ws) for c in
                                                                b._contexts.values())
    # Failing one (both ranks refuse a bad input) leaves the other working.
    with pytest.raises(ValueError):
        all_gather_matmul(x, torch.randn(3, 3), comm=a)
    with pytest.raises(TPCommFailed, match="failed earlier"):
        all_gather_matmul(x, w, comm=a)
    errs.append(float((all_gather_matmul(x, w, comm=b) - ref).abs().max()))
    a.close()
    b.close()
    return max(errs), len(shared)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_communicators_on_one_group_are_independent(backend):
    for err, shared in run_ranks(_two_comms, 2, backend):
        assert err < 1e-5 and shared == 0


def _recreated_group():
    from overlap.tp import all_gather_matmul, close_default_comms
    from overlap.tp.comm import default_comm

    r, world = dist.get_rank(), dist.get_world_size()
    errs, comms = [], []
    for round_ in range(3):
        g = dist.new_group(list(range(world)))
        x, w, ref = _data(world, r, seed=round_)
        errs.append(float((all_gather_matmul(x, w, group=g, backend="symmetric") - ref)
                          .abs().max()))
        comm = default_comm(g, backend="symmetric")
        comms.append((id(comm), comm.group is g))
        comm.close()
        dist.destroy_process_group(g)
        del g, comm
        gc.collect()
    close_default_comms()
    return max(errs), comms


def test_recreated_group_gets_fresh_state():
    for err, comms in run_ranks(_recreated_group, 2):
        assert err < 1e-5
        assert all(is_own for _, is_own in comms)  # never a communicator of a dead group


def _one_sided_error(backend):
    from overlap.tp import TPComm, TPCommFailed, all_gather_matmul

    r, world = dist.get_rank(), dist.get_world_size()
    comm = TPComm(dist.group.WORLD, backend=backend, timeout=3)
    x, w, ref = _data(world, r)
    ok = float((all_gather_matmul(x, w, comm=comm) - ref).abs().max())
    results = []
    t0 = time.monotonic()
    if r == 1:  # refused locally, before any communication; the caller retries
        try:
            all_gather_matmul(x, torch.randn(5, 6), comm=comm)
        except ValueError:
            pass
    for _ in range(2):
        try:
            y = all_gather_matmul(x * 2, w, comm=comm)
            results.append(("returned", float((y - 2 * ref).abs().max())))
        except (TPCommFailed, RuntimeError, TimeoutError) as exc:
            results.append((type(exc).__name__, str(exc)[:300]))
    return ok, results, time.monotonic() - t0


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_sided_error_then_retry_raises_on_both_ranks(backend):
    for rank, (ok, results, took) in enumerate(run_ranks(_one_sided_error, 2, backend,
                                                         timeout=90)):
        assert ok < 1e-5
        assert all(kind != "returned" for kind, _ in results), (rank, results)
        # The second call on each rank: the communicator failed earlier.
        assert results[1][0] == "TPCommFailed" and "failed earlier" in results[1][1]
        assert took < 15


def _dead_peer(backend):
    from overlap.tp import TPComm, all_gather_matmul

    r, world = dist.get_rank(), dist.get_world_size()
    comm = TPComm(dist.group.WORLD, backend=backend, timeout=60)
    x, w, ref = _data(world, r)
    all_gather_matmul(x, w, comm=comm)
    dist.barrier()
    if r == world - 1:
        os._exit(3)
    time.sleep(0.2)  # the peer is gone before the op starts
    t0 = time.monotonic()
    try:
        all_gather_matmul(x, w, comm=comm)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - t0, "returned"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_peer_is_named_within_a_second(backend):
    outcomes = run_ranks_outcomes(_dead_peer, 2, backend, timeout=60, grace=20)
    assert outcomes[1].status == "died"
    took, msg = outcomes[0].value
    assert took < 1.5, (took, msg)
    assert "all_gather_matmul" in msg and "rank 1" in msg, msg
    assert any(word in msg for word in ("died", "exited", "closed")), msg


def _stalled_peer(backend, timeout):
    from overlap.tp import TPComm, all_gather_matmul

    r, world = dist.get_rank(), dist.get_world_size()
    comm = TPComm(dist.group.WORLD, backend=backend, timeout=timeout)
    x, w, ref = _data(world, r)
    all_gather_matmul(x, w, comm=comm)
    if r == 1:
        time.sleep(timeout * 3)  # alive but not taking part
        return None
    t0 = time.monotonic()
    try:
        all_gather_matmul(x, w, comm=comm)
    except Exception as exc:  # noqa: BLE001
        return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - t0, "returned"


@pytest.mark.parametrize("backend", BACKENDS)
def test_stalled_peer_is_reported_at_the_timeout(backend):
    timeout = 2.0
    took, msg = run_ranks(_stalled_peer, 2, backend, timeout, timeout=60)[0]
    assert timeout * 0.9 <= took <= timeout * 2 + 1, (took, msg)
    assert "all_gather_matmul" in msg and "timed out" in msg, msg


def _train_timeout_reaches_tp(backend):
    from overlap.dist import ParallelDims
    from overlap.nn import ColumnParallelLinear
    from overlap.train.config import TrainConfig
    from overlap.train.loop import tp_comm_for

    cfg = TrainConfig(tp=2, pp=1, dp=1, tp_backend=backend, timeout=2.5)
    dims = ParallelDims.build(tp=2, pp=1, dp=1)
    comm = tp_comm_for(cfg, dims, torch.device("cpu"))
    layer = ColumnParallelLinear(8, 8, comm=comm, sequence_parallel=True)
    x = torch.randn(2, 4, 8)  # (b, t/tp, K): this rank's sequence shard
    layer(x)
    if dist.get_rank() == 1:
        time.sleep(8)  # stalls: alive, but never joins the next forward
        return None
    t0 = time.monotonic()
    try:
        layer(x)
    except Exception as exc:  # noqa: BLE001
        return comm.timeout, time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    return comm.timeout, time.monotonic() - t0, "returned"


@pytest.mark.parametrize("backend", ["chunked", "symmetric"])
def test_train_config_timeout_reaches_a_tp_wait(backend):
    timeout, took, msg = run_ranks(_train_timeout_reaches_tp, 2, backend, timeout=60)[0]
    assert timeout == 2.5
    assert 2.5 * 0.9 <= took < 2.5 * 2 + 1, (took, msg)
    assert "all_gather_matmul" in msg and "timed out" in msg, msg


def _peer_fails_mid_op(op, mode, timeout):
    """Rank 1 enters the op and writes its data into the peers' userbuffers, then stalls or
    dies at its first signal: the survivors hold partial or stale chunks and must raise, never
    return numbers."""
    from overlap.symm.shm import ShmWorkspace
    from overlap.tp import TPComm, all_gather_matmul, matmul_reduce_scatter

    r, world = dist.get_rank(), dist.get_world_size()
    comm = TPComm(dist.group.WORLD, backend="symmetric", timeout=timeout, chunks=2 * world)
    x, w, ref = _data(world, r, m=4 * world)
    fn = {"ag": lambda: all_gather_matmul(x[:4], w, comm=comm),
          "rs": lambda: matmul_reduce_scatter(x, w, comm=comm)}[op]
    fn()  # one good call: the workspace exists and the phases are in step
    dist.barrier()
    if r == 1:
        real = ShmWorkspace.signal

        def failing_signal(self, peer, slot, value):
            if mode == "kill":
                os._exit(3)
            time.sleep(timeout * 2.5)  # alive, but its signal never comes in time
            raise RuntimeError("the stalled rank gives up")

        ShmWorkspace.signal = failing_signal
        try:
            fn()
        except Exception:  # noqa: BLE001 - the stalled rank's own failure is not under test
            pass
        finally:
            ShmWorkspace.signal = real
        return None
    t0 = time.monotonic()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - t0, f"returned {out.flatten()[:4].tolist()}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("mode", ["stall", "kill"])
def test_peer_failing_mid_op_gives_an_error_never_a_result(world, op, mode):
    timeout = 2.0
    outcomes = run_ranks_outcomes(_peer_fails_mid_op, world, op, mode, timeout, timeout=60,
                                  grace=20)
    name = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}[op]
    for rank, outcome in enumerate(outcomes):
        if rank == 1:
            assert outcome.status == ("died" if mode == "kill" else "ok"), outcome
            continue
        assert outcome.status == "ok", outcome
        took, msg = outcome.value
        assert not msg.startswith("returned"), (rank, msg)
        assert name in msg and "rank 1" in msg, (rank, msg)
        if mode == "stall":  # the wait names its slot and who should have signalled it
            assert "slot" in msg and "signalled by rank 1" in msg, (rank, msg)
            assert took <= timeout * 2 + 2, (rank, took, msg)
        else:
            assert took < timeout + 2, (rank, took, msg)


def _device_waits_poison(op, mode, timeout):
    """As _peer_fails_mid_op, with the shm twin's waits behaving like the CUDA wait kernel
    (record the error and return): the op runs to its end on stale chunks, so only poisoning
    stands between the caller and wrong numbers."""
    os.environ["OVERLAP_SHM_DEVICE_WAITS"] = "1"
    from overlap.tp import TPComm, all_gather_matmul, matmul_reduce_scatter

    r, world = dist.get_rank(), dist.get_world_size()
    comm = TPComm(dist.group.WORLD, backend="symmetric", timeout=timeout, chunks=2 * world)
    x, w, ref = _data(world, r, m=4 * world)
    fn = {"ag": lambda: all_gather_matmul(x[:4], w, comm=comm),
          "rs": lambda: matmul_reduce_scatter(x, w, comm=comm)}[op]
    good = fn()
    dist.barrier()
    if r == 1:
        fail_signals_then_call(mode, timeout * 2.5, fn)
        return None
    out = fn()  # returns: the device-side waits gave up without raising
    try:
        fn()
        second = "returned"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        second = f"{type(exc).__name__}: {exc}"
    return bool(out.isnan().all()), bool(torch.isfinite(good).all()), second


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("mode", ["stall", "kill"])
def test_device_side_wait_failure_poisons_the_output_and_the_next_op_raises(op, mode):
    timeout = 1.5
    outcomes = run_ranks_outcomes(_device_waits_poison, 2, op, mode, timeout, timeout=60,
                                  grace=20)
    name = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}[op]
    nan, finite_before, second = outcomes[0].value
    assert finite_before and nan, (finite_before, nan)  # NaN, never stale numbers
    assert second != "returned" and name in second and "slot" in second, second
    assert "signalled by rank 1" in second or "rank 1" in second, second
