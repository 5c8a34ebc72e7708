"""The one Communicator base (overlap.dist.communicator) under TPComm, CPComm, EPComm, the
quantized collectives' GroupState, the TP workspace context and GradReducer: one failure rule
(the first error kept, every later op raising it, close working after it), one options object."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

pytestmark = pytest.mark.no_delay_pass("no stream or twin op: failure state and options only")

_ONE_IMPLEMENTATION = ("fail", "check_usable", "guard", "close", "__enter__", "__exit__",
                       "where", "place", "failed")
_HOOKS = ("_place", "_failure_text", "_refused", "_abort_peers", "_release")


def _classes():
    from overlap.comm.quant.state import GroupState
    from overlap.cp.comm import CPComm
    from overlap.dp.grad_reducer import GradReducer
    from overlap.moe.comm import EPComm
    from overlap.tp.comm import TPComm
    from overlap.tp.context import TPContext

    return [TPComm, CPComm, EPComm, GroupState, TPContext, GradReducer]


def test_every_communicator_is_one_and_overrides_only_the_hooks():
    from overlap.comm.quant.state import QuantCommFailed
    from overlap.cp.comm import CPCommFailed
    from overlap.dist.communicator import CommFailed, Communicator
    from overlap.errors import OverlapError
    from overlap.tp.comm import TPCommFailed

    for cls in _classes():
        assert issubclass(cls, Communicator), cls
        for klass in cls.__mro__[:cls.__mro__.index(Communicator)]:
            own = set(vars(klass))
            assert not own & set(_ONE_IMPLEMENTATION), (klass, own & set(_ONE_IMPLEMENTATION))
        hooks = [h for h in _HOOKS if getattr(cls, h) is not getattr(Communicator, h)]
        assert "_place" in hooks or cls is Communicator, (cls, hooks)
    for exc in (TPCommFailed, CPCommFailed, QuantCommFailed):
        assert issubclass(exc, CommFailed) and issubclass(exc, OverlapError)
        assert issubclass(exc, RuntimeError)
    # One timeout default: the aliases are gone.
    import overlap.comm.quant as quant
    import overlap.tp.comm as tp_comm
    import overlap.tp.context as tp_context
    from overlap.defaults import TIMEOUT_S

    for module in (tp_comm, tp_context, quant):
        assert not hasattr(module, "DEFAULT_TIMEOUT"), module
    for cls in _classes():
        default = inspect.signature(cls.__init__).parameters.get("timeout")
        assert default is None or default.default in (None, TIMEOUT_S), (cls, default)


def _fail_once(kind: str):
    """Fail the communicator with a first and a second error; return what later calls see."""
    from overlap.dist.communicator import CommOptions

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    first, second = ValueError(f"first error on rank {rank}"), RuntimeError("second error")
    if kind == "tp":
        from overlap.tp import TPComm, all_gather_matmul

        comm = TPComm(group, CommOptions(timeout=7.0), backend="chunked")
        settings = (comm.timeout, comm.backend)
        op = lambda: all_gather_matmul(torch.ones(2, 4), torch.ones(4, 3), comm=comm)  # noqa: E731
    elif kind == "cp":
        from overlap.cp import CPComm, ring_attention

        comm = CPComm(group, CommOptions(timeout=9.0))
        settings = (comm.timeout, None)
        q = torch.ones(1, 2, 4, 8)
        op = lambda: ring_attention(q, q, q, comm=comm, causal=True)  # noqa: E731
    elif kind == "ep":
        from overlap.moe import EPComm

        comm = EPComm(group, CommOptions(timeout=5.0, backend="chunked"), timeout=6.0)
        settings = (comm.timeout, comm.backend)
        op = lambda: comm.post(torch.ones(world, 3), None, None, op="moe dispatch")  # noqa: E731
    elif kind == "dp":
        from overlap.dp import GradReducer, ReducerConfig

        comm = GradReducer(torch.nn.Linear(4, 2), ReducerConfig(timeout=8.0, op="avg"),
                           dp_group=group, op="sum")
        settings = (comm.timeout, comm.config.op)
        op = comm.finish
    else:
        from overlap.comm.quant import all_reduce
        from overlap.comm.quant.state import state_for

        comm = state_for(group)
        settings = (comm.timeout, None)
        op = lambda: all_reduce(torch.ones(16), group=group, comm_dtype="int8")  # noqa: E731
    with comm:
        comm.fail(first)
        comm.fail(second)
        try:
            with comm.guard("a later op"):
                raise KeyError("inside the guard")
        except KeyError:
            pass
        seen = []
        for call in (lambda: comm.check_usable("check"), op, op):
            try:
                call()
                seen.append(None)
            except Exception as exc:  # noqa: BLE001 - the type and text are the result
                seen.append((type(exc).__name__, str(exc)))
        failure = comm.failed
    comm.close()  # a second close is a no-op
    return settings, failure, seen, comm.closed


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["tp", "cp", "ep", "quant", "dp"])
def test_a_failure_stays_the_first_one(kind, world):
    from overlap.defaults import TIMEOUT_S

    expected = {"tp": ((7.0, "chunked"), "TPCommFailed"), "cp": ((9.0, None), "CPCommFailed"),
                "ep": ((6.0, "chunked"), "RuntimeError"),
                "quant": ((TIMEOUT_S, None), "QuantCommFailed"),
                "dp": ((8.0, "sum"), "ReducerFailed")}[kind]
    for rank, (settings, failure, seen, closed) in enumerate(run_ranks(_fail_once, world,
                                                                       kind)):
        assert settings == expected[0], (rank, settings)
        assert f"first error on rank {rank}" in failure and "second" not in failure, failure
        assert closed, rank
        for got in seen:  # the check and two real ops: each raises the first error
            assert got is not None and got[0] == expected[1], (rank, got)
            assert "failed earlier" in got[1] and f"first error on rank {rank}" in got[1], got
            assert "second" not in got[1] and "inside the guard" not in got[1], got


def _options_of_dims():
    from overlap.dist.communicator import CommOptions
    from overlap.dist.dims import ParallelDims

    dims = ParallelDims.build(tp=2, dp=-1)
    tp = dims.comm_options("tp", timeout=4.0)
    ep = dims.comm_options("ep")
    with dims.tp_comm(tp, backend="unfused") as comm:
        made = (comm.timeout, comm.backend, comm.check_inputs)
    ep_comm = dims.ep_comm(timeout=3.0)
    try:
        bad = CommOptions(timeout=0)
    except ValueError as exc:
        bad = str(exc)
    result = (tp, ep, made, (ep_comm.timeout, ep_comm.backend), bad)
    ep_comm.close()
    return result


def test_parallel_dims_makes_the_options_of_each_axis():
    from overlap.dist.communicator import CommOptions

    for tp, ep, made, ep_made, bad in run_ranks(_options_of_dims, 2):
        assert tp == CommOptions(timeout=4.0, backend="auto")
        assert ep == CommOptions(backend="chunked")
        assert made == (4.0, "unfused", True) and ep_made == (3.0, "chunked")
        assert "timeout must be a positive number of seconds, got 0" in bad, bad
