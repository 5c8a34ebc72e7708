"""overlap.dist.stamp: layouts, messages, and both comparison paths (the host one CPU ranks
use, and the device one a GPU uses, run here on CPU tensors: record, host mirror, poison)."""

import pytest
import torch

from overlap.dist.stamp import (MAGIC, STAMP_WORDS, Agreement, Disagreement, Schema,
                                shape_words)

pytestmark = [
    pytest.mark.no_delay_pass("no stream or twin op"),
    # the device path's messages ride on float sums: exact while every partial sum is an
    # integer the float type holds, in any summation order (the portable-kernel pass)
    pytest.mark.numerics("stamps ride on float sums, exact in any summation order"),
]

SCHEMA = Schema("t", ("op_a", "op_b"), (("x shape", 3, "shape"), ("dtype", 1, "dtype"),
                                        ("mode", 1, ("off", "on"))))


def _values(rows, dtype=1, mode=0):
    return {"x shape": shape_words((rows, 16), 3), "dtype": dtype, "mode": mode}


def test_words_layout_and_description():
    w = SCHEMA.words("op_b", 7, _values(4, dtype=2, mode=1))
    assert len(w) == STAMP_WORDS and w[:3] == [MAGIC, 7, 1]
    assert w[3:8] == [4, 16, -1, 2, 1] and w[8:] == [0] * (STAMP_WORDS - 8)
    assert SCHEMA.describe(w) == "op_b call 7: x shape=(4, 16), dtype=bfloat16, mode=on"
    assert "no stamp" in SCHEMA.describe([0] * STAMP_WORDS)


def test_shape_words_folds_extra_dims_into_the_last():
    assert shape_words((2, 3, 4, 5), 3) == [2, 3, 20]
    assert shape_words((7,), 3) == [7, -1, -1]


@pytest.mark.parametrize("field,mine,theirs,shown", [
    ("x shape", _values(4), _values(6), "rank 0=(4, 16), rank 1=(6, 16)"),
    ("dtype", _values(4, dtype=2), _values(4, dtype=3), "rank 0=bfloat16, rank 1=float16"),
    ("mode", _values(4), _values(4, mode=1), "rank 0=off, rank 1=on"),
])
def test_first_differing_field_is_named(field, mine, theirs, shown):
    with pytest.raises(Disagreement) as info:
        SCHEMA.check("t.op_a", SCHEMA.words("op_a", 3, mine),
                     {1: SCHEMA.words("op_a", 3, theirs)}, rank=0, where=" (here)")
    msg = str(info.value)
    assert msg.startswith(f"t.op_a: call 3: ranks disagree on {field}: {shown} (here)")
    assert info.value.call == 3 and info.value.ranks == (0, 1)


def test_op_and_call_number_differences_are_named():
    a = SCHEMA.words("op_a", 3, _values(4))
    with pytest.raises(Disagreement, match="disagree on op: rank 0=op_a, rank 2=op_b"):
        SCHEMA.check("t", a, {2: SCHEMA.words("op_b", 3, _values(4))}, rank=0, where="")
    with pytest.raises(Disagreement, match="disagree on call number: rank 0=3, rank 1=4"):
        SCHEMA.check("t", a, {1: SCHEMA.words("op_a", 4, _values(4))}, rank=0, where="")
    SCHEMA.check("t", a, {1: list(a), 2: list(a)}, rank=0, where="")  # agreement passes


def test_host_path_compares_received_rows():
    ag = Agreement(SCHEMA, rank=1, world=3, device=torch.device("cpu"), where="")
    mine = ag.next("op_a", _values(4))
    assert ag.calls == 1 and ag.send.tolist() == mine
    ag.recv[0] = torch.tensor(mine)
    ag.recv[2] = torch.tensor(SCHEMA.words("op_a", 1, _values(6)))
    with pytest.raises(Disagreement, match="rank 1=\\(4, 16\\), rank 2=\\(6, 16\\)"):
        ag.verify("t", [0, 2])
    ag.verify("t", [0])  # rank 0 agrees
    ag.clear_received()
    ag.verify("t", [0, 2], arrived_only=True)  # nothing arrived: left to the transport error


def _device_path(world, rank):
    """An Agreement whose device path runs on CPU tensors (what a GPU runs, minus pinning)."""
    ag = Agreement(SCHEMA, rank=rank, world=world, device=torch.device("cpu"), where="")
    ag._gpu = True
    ag._init_device_record()
    return ag


def test_device_path_records_poisons_and_raises_from_the_host_mirror():
    ag = _device_path(3, 0)
    ag.calls = 4
    mine = SCHEMA.words("op_a", 5, _values(4))
    ag.mine = mine
    ag.send.copy_(torch.tensor(mine))
    ag.recv[1] = torch.tensor(mine)
    ag.recv[2] = torch.tensor(SCHEMA.words("op_a", 5, _values(4, dtype=3)))
    ag._verify_on_device([1, 2], None)
    y = torch.ones(3, 2)
    ag.poison(y)
    assert torch.isnan(y).all()  # no output from mismatched data passes as valid
    with pytest.raises(Disagreement, match="rank 0=float32, rank 2=float16"):
        ag.raise_recorded("t")
    # The record is sticky: a later agreeing call still reports the first mismatch.
    ag.recv[2] = torch.tensor(mine)
    ag._verify_on_device([1, 2], None)
    with pytest.raises(Disagreement, match="rank 2=float16"):
        ag.raise_recorded("t")


def test_device_path_leaves_agreeing_outputs_alone():
    ag = _device_path(2, 1)
    mine = SCHEMA.words("op_b", 1, _values(8))
    ag.send.copy_(torch.tensor(mine))
    ag.recv[0] = torch.tensor(mine)
    ag._verify_on_device([0], None)
    y = torch.ones(2, 2)
    ag.poison(y)
    assert torch.equal(y, torch.ones(2, 2))
    ag.raise_recorded("t")
