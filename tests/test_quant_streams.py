"""The async quantized collectives keep the CUDA caching allocator's rules on their
communication stream (overlap.dist.stream_memory), each shown to be what the twin catches
(switched off, the same code passes):

- the input is given to the stream's work (``record_stream`` on CUDA): a caller that passes a
  temporary, whose only reference is then the op's, gets its numbers and no violation;
- the comm stream is ordered after the caller before each op: a result the stream allocated,
  read and freed by the caller, is not handed to the next op's allocations while the caller's
  read may still be queued.
"""

import threading

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks


def _dropped_input(strict: bool, comm_dtype: str) -> bool:
    from overlap.comm import quant
    from overlap.comm.quant.state import state_for
    from overlap.dist import stream_memory

    stream_memory.STRICT = strict
    g, r, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    x = torch.randn(n * 300, 3, generator=torch.Generator().manual_seed(r))
    want = quant.reduce_scatter(x.clone(), group=g, comm_dtype=comm_dtype)
    stream = state_for(g).stream(x.device)
    gate = threading.Event()
    stream.enqueue(lambda: gate.wait(30.0))  # the comm stream is busy: the op runs later
    work = quant.reduce_scatter(x.clone(), group=g, comm_dtype=comm_dtype, async_op=True)
    gate.set()  # the input's only reference is the op's now
    got = work.wait()
    stream.synchronize()  # the twin has dropped the op's work: a violation surfaces here
    return bool(torch.equal(got, want))


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_an_input_only_the_op_holds_is_given_to_the_comm_stream(world, strict):
    assert run_ranks(_dropped_input, world, strict, "int8", timeout=120) == [True] * world


def _freed_results(strict: bool, comm_dtype: str) -> list[bool]:
    from overlap.comm import quant
    from overlap.dist import stream_memory

    stream_memory.STRICT = strict
    g, r, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    xs = [torch.randn(n * 257, generator=torch.Generator().manual_seed(10 * i + r))
          for i in range(3)]
    want = [quant.reduce_scatter(x.clone(), group=g, comm_dtype=comm_dtype) for x in xs]
    acc = torch.zeros(257)
    same = []
    for x, w in zip(xs, want):
        out = quant.reduce_scatter(x, group=g, comm_dtype=comm_dtype, async_op=True).wait()
        acc += out  # the caller reads the result the comm stream allocated
        same.append(bool(torch.equal(out, w)))
        del out  # and frees it: on CUDA it goes back to the comm stream's pool at once
    same.append(bool(torch.equal(acc, want[0] + want[1] + want[2])))
    return same


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_results_the_caller_frees_are_reused_only_after_its_reads(world, strict):
    assert run_ranks(_freed_results, world, strict, "int8", timeout=120) == [[True] * 4] * world
