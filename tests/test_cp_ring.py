"""Ring attention (overlap.cp) at CP 1, 2 and 4 on the NCCL-ordering twin, with and without
stream delays, against torch's SDPA on the gathered sequence: outputs and dQ/dK/dV, causal and
full, with and without grouped-query heads, fp32 and bf16; zero host syncs in steady state;
bad input and a dead or stalled peer raised on every rank.

fp32: |ours - ref| <= 1e-5 elementwise. Both sides compute in fp32 and differ in summation order
only: dot products of depth d = 8, softmax sums and dV/dK sums over at most S = 24 keys, the
log-sum-exp merge of cp partials; a few ulps (2^-24 relative) times depths of at most 24 on
values below ~10: under 1e-5 with a wide margin (measured up to ~2e-6).
bf16: the reference is fp32 SDPA on the same bf16 values (and the same bf16 dO). The math
block computes in fp32 and rounds each result once, so |ours - ref| <= 2^-8 |ref| + 1e-5
(bf16's unit roundoff plus the fp32 bound). The flash block (torch's CPU flash kernel, the
GPU kernel's twin) rounds each block's output to bf16 before the merge: 4 * 2^-8 max|ref|.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_common import B, D, H, compare, inputs, error_bound, peer_fault, sharded
from harness import run_ranks

pytestmark = pytest.mark.own_delays  # CI's delay pass skips it (it injects delays itself)


def _ring_vs_sdpa(block):
    from overlap.cp import CPComm, ring_attention, zigzag_shard
    from overlap.profile.syncs import count_host_syncs

    world, rank = dist.get_world_size(), dist.get_rank()
    comm = CPComm(dist.group.WORLD, timeout=30)
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        bound = error_bound(dtype, block)
        for causal in (True, False):
            for hk in (H, 2, 1):
                full = inputs(world, hk, dtype)
                got = sharded(ring_attention, full, world=world, rank=rank, causal=causal,
                              comm=comm, block=block)
                report[(str(dtype), causal, hk)] = compare(got, full, world=world, rank=rank,
                                                           causal=causal, bound=bound)
    # Steady state: the same shapes again, forward and backward, under the sync counter.
    mine = [zigzag_shard(t, 2, cp=world, rank=rank) for t in full]
    ql, kl, vl = (t.clone().requires_grad_() for t in mine[:3])
    with count_host_syncs() as syncs:
        out = ring_attention(ql, kl, vl, comm=comm, causal=False, block=block)
        out.backward(mine[3])
    comm.close()
    return report, syncs.count, syncs.where


@pytest.mark.parametrize("world,delay,block", [
    (1, None, "math"), (2, None, "math"), (4, None, "math"), (2, "2", "math"), (4, "2", "math"),
    (2, None, "flash"), (4, "2", "flash")])
def test_ring_attention_matches_sdpa(world, delay, block):
    results = run_ranks(_ring_vs_sdpa, world, block, timeout=90,
                        env=delay and {"OVERLAP_STREAM_DELAY_MS": delay})
    for rank, (report, syncs, where) in enumerate(results):
        for key, (errs, excess) in report.items():
            assert max(excess) <= 0, (rank, key, errs)  # out, dq, dk, dv
        assert syncs == 0, (rank, where)
    worst = {}
    for report, _, _ in results:
        for (dtype, _, _), (errs, _) in report.items():
            worst[dtype] = max(worst.get(dtype, 0.0), *errs)
    print(f"cp {world} delay {delay} {block}: max |err| {worst}")


def _bad_input():
    from overlap.cp import CPComm, CPCommFailed, ring_attention, zigzag_shard
    from overlap.dist import nccl_twin
    from overlap.dist.stamp import Disagreement

    world, rank = dist.get_world_size(), dist.get_rank()
    errs = []

    def attempt(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            errs.append(f"{type(exc).__name__}: {exc}")
            return exc
        errs.append("returned")
        return None

    def call(comm, s, h=H, hk=2, causal=True):
        q = torch.randn(B, h, s, D, requires_grad=True)
        k, v = torch.randn(B, hk, s, D), torch.randn(B, hk, s, D)
        ring_attention(q, k, v, comm=comm, causal=causal).sum().backward()

    attempt(lambda: zigzag_shard(torch.zeros(1, 1, 10, 2), 2, cp=world, rank=rank))  # 0
    comm = CPComm(dist.group.WORLD, timeout=5)
    attempt(lambda: call(comm, 6, h=4, hk=3))  # 1: heads do not divide
    attempt(lambda: call(comm, 6))  # 2: the communicator failed at 1
    comm.close()
    comm = CPComm(dist.group.WORLD, timeout=5)
    attempt(lambda: call(comm, 5))  # 3: odd s_local under causal
    comm.close()
    comm = CPComm(dist.group.WORLD, timeout=5)
    attempt(lambda: call(comm, 6 + 2 * rank))  # 4: s_local differs on the first call
    comm.close()
    comm = CPComm(dist.group.WORLD, timeout=5)
    call(comm, 6)
    exc = attempt(lambda: call(comm, 6, causal=rank != world - 1))  # 5: differs later
    disagreement = [isinstance(exc, Disagreement)]
    exc = attempt(lambda: call(comm, 6))  # 6: failed stays failed
    failed = isinstance(exc, CPCommFailed)
    comm.close()
    # 7: s_local differs on a later call: the twin's size check or the stamps name it; on
    # plain gloo (which aborts the process when a block outgrows its receive: it did before
    # the ring compared the stamps first there) the stamps are compared before any block moves.
    dist.barrier()  # ranks that lost their ring at 5 finish it only at its timeout
    comm = CPComm(dist.group.WORLD, timeout=5)
    assert comm.stamps_first == (not nccl_twin.is_twin(dist.group.WORLD))
    call(comm, 6)
    exc = attempt(lambda: call(comm, 6 + 2 * (rank == world - 1)))
    disagreement.append(isinstance(exc, Disagreement))
    comm.close()
    return errs, disagreement, failed


@pytest.mark.parametrize("backend", [None, "gloo"])
@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_is_an_error_on_every_rank(world, backend):
    """Bad input on the CPU twin (the default) and on plain gloo."""
    for rank, (errs, disagreement, failed) in enumerate(run_ranks(_bad_input, world,
                                                                   timeout=60,
                                                                   backend=backend)):
        where = f"cp rank {rank} of group"
        assert "divisible by 2 * cp" in errs[0] and "got 10" in errs[0], errs[0]
        assert errs[1].startswith("ValueError") and "h=4" in errs[1] and "h_kv=3" in errs[1] \
            and where in errs[1], errs[1]
        assert errs[2].startswith("CPCommFailed") and "h_kv=3" in errs[2], errs[2]
        assert "s_local=5 must be a positive even length" in errs[3] and where in errs[3], \
            errs[3]
        assert errs[4].startswith("Disagreement") and "q shape" in errs[4], errs[4]
        later = [5, 7]
        for i, field in zip(later, ("causal", "q shape")):
            if rank in (0, world - 1):  # the ranks whose ring neighbour differs
                assert disagreement[later.index(i)], errs[i]
                assert f"disagree on {field}" in errs[i] and "call 3" in errs[i], errs[i]
            else:  # the others lose their ring to the ones that raised
                assert errs[i].startswith(("RuntimeError", "Disagreement")), errs[i]
        assert failed, errs[6]


@pytest.mark.parametrize("kind", ["dead", "stalled"])
def test_dead_or_stalled_peer_is_an_error_on_every_survivor(kind):
    from harness import run_ranks_outcomes

    timeout, world = 2.0, 4
    outcomes = run_ranks_outcomes(peer_fault, world, kind, timeout, "ring", timeout=60,
                                  grace=20)
    for out in outcomes[:-1]:
        assert out.status == "ok", (out.status, out.error)
        took, msg = out.value
        assert msg.startswith("RuntimeError") and "cp ring_attention" in msg, msg
        assert f"(rank {out.rank}, cp rank {out.rank}" in msg, msg
        assert took <= 2 * timeout + 1, (took, msg)


def _compiled_vs_eager():
    from overlap.cp import CPComm, ring_attention, zigzag_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    comm = CPComm(dist.group.WORLD, timeout=60)
    q, k, v, do = (zigzag_shard(t, 2, cp=world, rank=rank) for t in inputs(world, 2,
                                                                           torch.float32))

    def attend(q, k, v):
        return ring_attention(q, k, v, comm=comm, causal=True)

    results = []
    for fn in (attend, torch.compile(attend, fullgraph=True)):
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(ql, kl, vl)
        out.backward(do)
        results.append([out.detach(), ql.grad, kl.grad, vl.grad])
    comm.close()
    return [torch.equal(a, b) for a, b in zip(*results)]


def test_compiled_equals_eager():
    """torch.compile(fullgraph=True) reaches the same implementation through its custom ops
    (one opaque node each way): outputs and gradients are bit-identical to eager."""
    for rank, same in enumerate(run_ranks(_compiled_vs_eager, 2, timeout=120)):
        assert all(same), (rank, same)
