"""SymmetricWorkspace (shm backend) across 1, 2 and 4 processes, and a Triton kernel that waits on
a signal and reads a peer's buffer through raw addresses under the interpreter."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from harness import WORLD_SIZES, gpu_world, requires_gpu, run_ranks, run_ranks_outcomes
from overlap.dist.device import gpu_for_rank
from overlap.symm.workspace import PeerDied, SignalTimeout, create_workspace


def _ring_exchange(num_phases, numel, device="cpu"):
    g = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    if device == "cuda":
        device = gpu_for_rank()
    with create_workspace(g, 4 * numel * 2, num_signals=4, timeout=20, device=device) as ws:
        # Names are unlinked as soon as every rank has mapped them.
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"overlap_{os.getpid()}_")]
        errors = []
        for phase in range(1, num_phases + 1):
            buf = phase % 2  # double buffer: the writer of phase p+1 may run ahead of our read of p
            payload = torch.arange(numel, dtype=torch.float32, device=device) * phase + 1000 * rank
            ws.view(right, torch.float32, (numel,), offset=buf * 4 * numel).copy_(payload)
            ws.signal(right, slot=buf, value=phase)
            ws.wait(slot=buf, value=phase)
            got = ws.view(rank, torch.float32, (numel,), offset=buf * 4 * numel).clone()
            want = torch.arange(numel, dtype=torch.float32, device=device) * phase + 1000 * left
            errors.append(float((got - want).abs().max()))
            # Tell the left neighbour we consumed its buffer, so it may overwrite it at phase+2.
            ws.signal(left, slot=2 + buf, value=phase)
            ws.wait(slot=2 + buf, value=phase)
        return max(errors)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_peer_writes_visible_after_signal(world):
    assert run_ranks(_ring_exchange, world, 20, 1000) == [0.0] * world


def _pull_after_barrier(numel):
    rank, world = dist.get_rank(), dist.get_world_size()
    with create_workspace(dist.group.WORLD, 8 * numel, timeout=20) as ws:
        out = []
        for step in range(5):
            ws.view(rank, torch.float64, (numel,)).fill_(rank * 10 + step)
            ws.barrier()
            out.append([float(ws.view(r, torch.float64, (numel,)).sum()) for r in range(world)])
            ws.barrier()  # nobody overwrites before everyone has read
        return out


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_barrier_then_read_every_peer(world):
    numel = 37
    want = [[numel * (r * 10 + step) for r in range(world)] for step in range(5)]
    assert run_ranks(_pull_after_barrier, world, numel) == [want] * world


def _wait_times_out():
    with create_workspace(dist.group.WORLD, 64, num_signals=8) as ws:
        t0 = time.monotonic()
        with pytest.raises(SignalTimeout) as info:
            ws.wait(slot=5, value=3, timeout=0.3)
        took = time.monotonic() - t0
        err = info.value
        dist.barrier()  # a peer that exits while we still wait would (rightly) be PeerDied
        return str(err), err.slot, err.expected, err.seen, took


@pytest.mark.parametrize("world", [1, 2])
def test_wait_without_signal_times_out(world):
    for rank, (msg, slot, expected, seen, took) in enumerate(run_ranks(_wait_times_out, world)):
        assert (slot, expected, seen) == (5, 3, 0)
        assert f"slot 5 of rank {rank}" in msg and "did not reach 3 within 0.3s" in msg
        assert "group [" in msg
        assert 0.3 <= took < 5


def _one_rank_dies():
    rank, world = dist.get_rank(), dist.get_world_size()
    ws = create_workspace(dist.group.WORLD, 64, timeout=30)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        ws.wait(slot=0, value=1)
    except PeerDied as exc:
        return ("PeerDied", exc.peer, time.monotonic() - t0, str(exc))
    finally:
        ws.close()
    return ("no error", None, time.monotonic() - t0, "")


@pytest.mark.parametrize("world", [2, 4])
def test_killed_peer_fails_the_others_fast(world):
    outcomes = run_ranks_outcomes(_one_rank_dies, world, timeout=40, grace=20)
    assert outcomes[-1].status == "died" and outcomes[-1].exitcode == -signal.SIGKILL
    for o in outcomes[:-1]:
        assert o.status == "ok", o
        kind, peer, took, msg = o.value
        assert kind == "PeerDied" and peer == world - 1
        assert f"peer rank {world - 1}" in msg and "has exited" in msg
        assert took < 10  # far below the 30 s wait timeout


def _abort_wakes_waiters():
    rank = dist.get_rank()
    with create_workspace(dist.group.WORLD, 64, timeout=30) as ws:
        if rank == 0:
            ws.barrier()
            time.sleep(0.2)
            ws.abort("test")
            return "aborted"
        ws.barrier()
        with pytest.raises(PeerDied, match="rank 0 aborted"):
            ws.wait(slot=0, value=1)
        return "woken"


def test_abort_wakes_waiting_peers():
    assert run_ranks(_abort_wakes_waiters, 4) == ["aborted", "woken", "woken", "woken"]


def _disagreeing_sizes():
    rank = dist.get_rank()
    with pytest.raises(ValueError) as info:
        create_workspace(dist.group.WORLD, 1024 * (1 + rank))
    return str(info.value)


def test_ranks_disagreeing_on_size_all_raise():
    for rank, msg in enumerate(run_ranks(_disagreeing_sizes, 2)):
        assert "ranks disagree on nbytes: rank 0=1024, rank 1=2048" in msg
        assert f"(rank {rank})" in msg


def _too_small():
    with create_workspace(dist.group.WORLD, 100) as ws:
        with pytest.raises(ValueError, match=r"needs 160 bytes but the workspace .* has 100"):
            ws.view(0, torch.float32, (40,))
        with pytest.raises(ValueError, match="offset 2 must be a non-negative multiple of 4"):
            ws.view(0, torch.float32, (1,), offset=2)
        with pytest.raises(ValueError, match="slot 64 is outside 0..63"):
            ws.signal(0, 64, 1)
        with pytest.raises(ValueError, match="rank 2 is outside group"):
            ws.buffer(2)
        ok = ws.view(1, torch.float32, (25,))
        ok.fill_(2.5)
        return float(ok.sum())


def test_bad_views_and_slots_are_rejected():
    assert run_ranks(_too_small, 2) == [62.5, 62.5]


def test_bad_arguments_before_any_collective():
    with pytest.raises(TypeError, match="group must be a ProcessGroup"):
        create_workspace(None, 64)  # type: ignore[arg-type]


def _triton_pull(numel):
    from overlap.kernels.triton.signal import pull_from_peer, signal_from_kernel

    rank = dist.get_rank()
    with create_workspace(dist.group.WORLD, 4 * numel, num_signals=4, timeout=20) as ws:
        if rank == 0:
            ws.view(0, torch.float32, (numel,)).copy_(torch.linspace(-3, 7, numel))
            ws.signal(1, slot=0, value=1)   # host-side release store
            ws.wait(slot=1, value=1)        # set by rank 1's Triton kernel
            return "ack"
        # Rank 1's Triton kernel waits on its own flag, then reads rank 0's buffer through the
        # address of rank 0's segment in this process.
        got = pull_from_peer(ws.data_ptr(0), ws.signal_ptr(1), phase=1, numel=numel, block=64)
        signal_from_kernel(ws.signal_ptr(0) + 8 * 1, 1)
        with pytest.raises(TimeoutError, match="did not reach 2 within 50 spins"):
            pull_from_peer(ws.data_ptr(0), ws.signal_ptr(1), phase=2, numel=numel, max_spins=50)
        return float((got - torch.linspace(-3, 7, numel)).abs().max())


def test_triton_kernel_waits_and_reads_peer_across_processes():
    assert run_ranks(_triton_pull, 2, 150) == ["ack", 0.0]


@requires_gpu
def test_cuda_workspace_ring_exchange_gpu():
    """The GPU path of test_peer_writes_visible_after_signal (its CPU twin): the cuda backend
    with stream-ordered signal kernels, on every visible GPU under NCCL."""
    world = gpu_world(most=8)
    assert run_ranks(_ring_exchange, world, 20, 1000, "cuda", backend="nccl") == [0.0] * world


def _abort_with_reason():
    rank = dist.get_rank()
    ws = create_workspace(dist.group.WORLD, 64, timeout=30)
    try:
        if rank == 2:
            time.sleep(0.2)  # the others are waiting by now
            ws.abort("rank 2 saw a bad batch: step 17")
            return "aborted"
        try:
            ws.wait(slot=0, value=1)
        except PeerDied as exc:
            return (exc.peer, str(exc))
        return "no error"
    finally:
        dist.barrier()
        ws.close()


def test_abort_reason_reaches_every_peer():
    for rank, res in enumerate(run_ranks(_abort_with_reason, 4)):
        if rank == 2:
            assert res == "aborted"
        else:
            peer, msg = res
            assert peer == 2 and "rank 2 aborted: rank 2 saw a bad batch: step 17" in msg, msg


def _early_close():
    rank = dist.get_rank()
    ws = create_workspace(dist.group.WORLD, 4096, timeout=10)
    if rank == 1:
        ws.view(1, torch.uint8, (4096,)).fill_(7)
        ws.signal(0, slot=0, value=1)
        ws.close()  # early: rank 0 is still reading this rank's buffer
        return "closed"
    ws.wait(slot=0, value=1)
    changed = []
    for _ in range(20):
        time.sleep(0.01)
        changed.append(int((ws.view(1, torch.uint8, (4096,)) != 7).sum()))
    ws.close()
    return changed


def test_an_early_close_never_changes_bytes_under_a_reader():
    changed = run_ranks(_early_close, 2)[0]
    assert changed == [0] * 20, changed


def _fail_while_peer_reads():
    from overlap.tp.context import TPContext

    rank = dist.get_rank()
    context = TPContext(op="all_gather_matmul", backend="symmetric", group=dist.group.WORLD,
                    nbytes=4096, num_signals=4, device=torch.device("cpu"), timeout=10)
    ws = context.ws
    if rank == 0:
        ws.view(0, torch.uint8, (4096,)).fill_(7)
        ws.signal(1, slot=0, value=1)  # rank 1 now reads this buffer (an earlier, good call)
        context.fail(RuntimeError("a later call failed on rank 0"))
        time.sleep(1.0)  # alive: the deferred free must wait for rank 1, not for a death
        return "failed"
    ws.wait(slot=0, value=1)
    changed = []
    for _ in range(20):
        time.sleep(0.01)
        changed.append(int((ws.view(0, torch.uint8, (4096,)) != 7).sum()))
    context.close()
    return changed


def test_a_failing_context_frees_only_after_its_peers_let_go():
    changed = run_ranks(_fail_while_peer_reads, 2)[1]
    assert changed == [0] * 20, changed


def _close_with_stuck_copier():
    import threading
    import warnings

    from overlap.tp import context as tp_context

    context = tp_context.TPContext(op="all_gather_matmul", backend="symmetric",
                               group=dist.group.WORLD, nbytes=4096, num_signals=4,
                               device=torch.device("cpu"), timeout=10)
    ws, rank = context.ws, dist.get_rank()
    own = ws.view(rank, torch.uint8, (4096,))
    own.fill_(7)
    release, seen = threading.Event(), []

    def copy():  # a copy still running when the owner closes (as if stuck in a signal wait)
        release.wait(10)
        seen.append(int((own != 7).sum()))

    context.copier.submit(copy)
    context.copier.timeout = 0.2 - 5.0  # close() joins the worker for timeout + 5 s: 0.2 s here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        context.close()
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    kept = any(k is ws for k, _ in getattr(tp_context, "_KEPT", []))
    release.set()
    context.copier.stream.close(10)  # the worker ends once released
    ws.close()
    getattr(tp_context, "_KEPT", []).clear()
    return context.closed, kept, messages, seen


def test_a_context_whose_copier_is_still_running_is_not_freed():
    # The twin's close() joins the copy worker with a bound; a worker still inside a copy
    # after it must keep the workspace (a GPU free would wait for the stream): no byte may
    # change under the copy, and the owner is told.
    for closed, kept, messages, seen in run_ranks(_close_with_stuck_copier, 2):
        assert closed and kept and seen == [0], (closed, kept, seen)
        assert len(messages) == 1 and "is not freed" in messages[0] \
            and "still inside a work item" in messages[0], messages


def test_closing_a_stream_whose_worker_is_busy_raises():
    import threading

    from overlap.dist.streams import Stream, StreamStillRunning

    s, release = Stream(name="busy"), threading.Event()
    s.enqueue(lambda: release.wait(10))
    with pytest.raises(StreamStillRunning, match="'busy'.*still inside a work item 0.1 s"):
        s.close(0.1)
    release.set()
    s.close(10)
    assert not any(t.name == "overlap-stream-busy" for t in threading.enumerate())


def _p2p_close_with_busy_worker():
    import threading
    import warnings

    from overlap.pp.p2p import P2P

    p2p = P2P(dist.group.WORLD, timeout=0.2, device=torch.device("cpu"), channels=[(0, 1)],
              token="busy-close")
    release = threading.Event()
    p2p._stream.enqueue(lambda: release.wait(10))  # a transfer still running at close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p2p.close()
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    kept = list(p2p.channels)
    release.set()
    p2p._stream.close(10)
    for c in p2p.channels.values():
        c.close()
    return kept, messages


def test_p2p_close_keeps_its_channels_while_a_transfer_runs():
    # The same rule for the pipeline's P2P stream: its communicators outlive a worker that is
    # still inside a transfer when close()'s bounded join ends.
    for kept, messages in run_ranks(_p2p_close_with_busy_worker, 2):
        assert kept == [(0, 1)]
        assert len(messages) == 1 and "the channels are not released" in messages[0] \
            and "still inside a work item 0.2 s" in messages[0], messages
