"""The public face of overlap.comm.quant: its import paths, input validation (errors that name
op, argument and rank, and fail the group they were raised on) and the one comm_dtype
vocabulary ("fp32" | "bf16" | "int8", None a deprecated alias) across the library."""

import importlib

import pytest
import torch
import torch.distributed as dist

from overlap.comm import quant
from tests.harness import run_ranks


def test_package_import_paths():
    from overlap.comm.quant import (COMM_DTYPES, ErrorFeedback, QuantCommFailed, QuantWork,
                                    all_gather, all_reduce, drain, reduce_scatter)
    assert quant.all_reduce is all_reduce and quant.reduce_scatter is reduce_scatter
    assert quant.all_gather is all_gather and quant.drain is drain
    assert quant.ErrorFeedback is ErrorFeedback and quant.QuantWork is QuantWork
    assert COMM_DTYPES == ("fp32", "bf16", "int8") and issubclass(QuantCommFailed, RuntimeError)
    for sub in ("paths", "work", "kernels", "state", "checks", "feedback"):
        importlib.import_module(f"overlap.comm.quant.{sub}")
    for old in ("quant_paths", "quant_work", "quant_kernels"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"overlap.comm.{old}")


def _rank_bad_input():
    """Each bad call on a group of its own: it raises (naming op, argument and rank) before any
    collective, and fails that group, so a valid retry raises too and returns no numbers."""
    rank, n = dist.get_rank(), dist.get_world_size()
    calls = {
        "group None": lambda g: quant.all_reduce(torch.ones(4), group=None),
        "comm dtype": lambda g: quant.all_reduce(torch.ones(4), group=g, comm_dtype="fp8"),
        "int dtype": lambda g: quant.all_gather(torch.ones(4, dtype=torch.int64), group=g,
                                                comm_dtype="int8"),
        "divisible": lambda g: quant.reduce_scatter(torch.ones(3, 2), group=g,
                                                    comm_dtype="int8"),
        "block": lambda g: quant.all_reduce(torch.ones(4), group=g, comm_dtype="int8",
                                            block_size=96),
        "contiguous": lambda g: quant.all_reduce(torch.ones(4, 4).t(), group=g),
        "ef numel": lambda g: quant.all_reduce(torch.ones(4), group=g, comm_dtype="int8",
                                               error_feedback=quant.ErrorFeedback(5)),
        "timeout": lambda g: quant.all_gather(torch.ones(4), group=g, timeout=0),
        "numel across ranks": lambda g: quant.all_reduce(torch.ones(10 + rank), group=g,
                                                         comm_dtype="int8"),
        "dtype across ranks": lambda g: quant.all_gather(
            torch.ones(4, dtype=torch.bfloat16 if rank else torch.float32), group=g,
            comm_dtype="bf16", async_op=True).wait(),
    }
    seen, retried = {}, {}
    for name, call in calls.items():
        g = dist.new_group(list(range(n)))
        try:
            call(g)
            seen[name] = None
        except (TypeError, ValueError) as exc:
            seen[name] = (type(exc).__name__, str(exc))
        try:
            retried[name] = quant.all_reduce(torch.ones(6), group=g, comm_dtype="int8").tolist()
        except quant.QuantCommFailed as exc:
            retried[name] = str(exc)
    g = dist.new_group(list(range(n)))  # a new group is not failed
    ok = quant.all_reduce(torch.ones(6), group=g, comm_dtype="int8")
    avg = quant.all_reduce(torch.ones(6), group=g, comm_dtype="int8", op=dist.ReduceOp.AVG)
    return seen, retried, ok.tolist() + avg.tolist()


def test_bad_input_raises_naming_op_argument_and_rank_and_fails_the_group():
    per_rank = run_ranks(_rank_bad_input, 2)
    expect = {"group None": ("TypeError", "group"), "comm dtype": ("ValueError", "'comm_dtype'"),
              "int dtype": ("TypeError", "dtype"), "divisible": ("ValueError", "divisible"),
              "block": ("ValueError", "'block_size'"), "contiguous": ("ValueError", "contiguous"),
              "ef numel": ("ValueError", "ErrorFeedback(4)"),
              "timeout": ("ValueError", "'timeout'"),
              "numel across ranks": ("ValueError", "t.numel() differs"),
              "dtype across ranks": ("ValueError", "t.dtype differs")}
    for rank, (seen, retried, ok) in enumerate(per_rank):
        assert ok == [2.0] * 6 + [1.0] * 6
        for name, (etype, needle) in expect.items():
            assert seen[name] is not None, f"rank {rank}: {name} did not raise"
            got_type, msg = seen[name]
            assert got_type == etype and needle in msg, (name, got_type, msg)
            assert "quant." in msg and (name == "group None" or f"rank {rank}" in msg), msg
            if name == "group None":  # no group, nothing failed: the retry on g works
                assert retried[name] == [2.0] * 6, retried[name]
            else:
                assert isinstance(retried[name], str), (name, retried[name])
                assert "communicator failed earlier" in retried[name] and msg in retried[name]


def _rank_vocabulary():
    """"fp32" is the plain collective in t's own dtype; anything outside the vocabulary
    (None included: its deprecated alias is gone) is refused, naming the op and the rank."""
    rank, n, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2 * n, 3, generator=torch.Generator().manual_seed(rank)).to(dtype)
        plain = x.clone()
        dist.all_reduce(plain, group=group)
        fp32 = quant.all_reduce(x.clone(), group=group, comm_dtype="fp32")
        out[str(dtype)] = (torch.equal(fp32, plain), fp32.dtype == dtype)
    for bad in ("fp16", None):  # a refused call fails its group: each on a group of its own
        try:
            quant.reduce_scatter(torch.ones(2 * n), group=dist.new_group(list(range(n))),
                                 comm_dtype=bad)
            out[f"error {bad}"] = None
        except ValueError as exc:
            out[f"error {bad}"] = str(exc)
    return out


def test_comm_dtype_vocabulary_and_its_errors():
    for rank, out in enumerate(run_ranks(_rank_vocabulary, 2)):
        for dtype in ("torch.float32", "torch.bfloat16"):
            same_fp32, keeps_dtype = out[dtype]
            assert same_fp32 and keeps_dtype, (rank, dtype, out[dtype])
        for bad in ("'fp16'", "None"):
            msg = out[f"error {bad.strip(chr(39))}"]
            assert msg is not None and "quant.reduce_scatter" in msg and f"rank {rank}" in msg, msg
            assert "'comm_dtype'" in msg and "'fp32', 'bf16', 'int8'" in msg and bad in msg, msg


def test_one_comm_dtype_vocabulary_across_the_library():
    from overlap.dp.buckets import ReducerConfig
    from overlap.train.config import COMM_DTYPES as TRAIN_COMM_DTYPES, TrainConfig

    assert quant.COMM_DTYPES == ("fp32", "bf16", "int8") == TRAIN_COMM_DTYPES
    assert TrainConfig().comm_dtype == "fp32" and ReducerConfig().comm_dtype == "fp32"
    with pytest.raises(ValueError, match="GradReducer: argument 'comm_dtype' must be one of"):
        ReducerConfig(comm_dtype=None)
    with pytest.raises(ValueError, match="GradReducer: argument 'comm_dtype' must be one of"):
        ReducerConfig(comm_dtype="float32")
    with pytest.raises(ValueError, match="error_feedback"):
        ReducerConfig(comm_dtype="fp32", error_feedback=True)
    # fp32 carries each call's stamp: a SUM tail of 4 ranks x 11 words x 4 chunks (16-bit,
    # exact in fp32) for the all-reduce, 88 bytes (after the 8-byte-aligned row) per gather row.
    assert quant.wire_bytes("all_reduce", 1024, 4, "fp32", 4, 128) == \
        2 * 3 * (1024 + 4 * 11 * 4) * 4 // 4
    assert quant.wire_bytes("all_gather", 64, 4, "fp32", 2, 128) == 64 * 4 + 88
    with pytest.raises(ValueError, match="quant.wire_bytes: argument 'comm_dtype'"):
        quant.wire_bytes("all_gather", 64, 4, "fp8", 2, 128)
