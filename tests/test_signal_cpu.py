"""The C++ signal atomics (csrc/signal.cpp) that the shm workspace builds on."""

import threading
import time

import pytest
import torch

from overlap import _C

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")


def test_store_load_add_semantics():
    flags = torch.zeros(4, dtype=torch.int64)
    addr = flags.data_ptr()
    _C.signal_store(addr + 8, 41)
    assert _C.signal_load(addr + 8) == 41
    assert _C.signal_add(addr + 8, 2) == 41
    assert flags.tolist() == [0, 43, 0, 0]
    assert _C.signal_wait(addr + 8, 43, 0.01) == (True, 43)  # >= phase counts as reached
    assert _C.signal_wait(addr + 8, 40, 0.01) == (True, 43)


def test_wait_times_out_with_last_value():
    flags = torch.full((1,), 7, dtype=torch.int64)
    t0 = time.monotonic()
    assert _C.signal_wait(flags.data_ptr(), 8, 0.2) == (False, 7)
    assert 0.2 <= time.monotonic() - t0 < 2


def test_misaligned_or_null_address_is_rejected():
    flags = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="8-byte aligned"):
        _C.signal_load(flags.data_ptr() + 4)
    with pytest.raises(ValueError, match="non-null"):
        _C.signal_store(0, 1)


def test_release_acquire_publishes_payload_across_threads():
    # The consumer waits with the GIL released while the producer (a Python thread) writes the
    # payload, then signals: every phase's payload must be complete when the wait returns.
    n, phases = 4096, 200
    payload = torch.zeros(n, dtype=torch.int64)
    flag = torch.zeros(1, dtype=torch.int64)
    ack = torch.zeros(1, dtype=torch.int64)
    bad = []

    def consumer():
        for p in range(1, phases + 1):
            ok, _ = _C.signal_wait(flag.data_ptr(), p, 10.0)
            if not ok or int(payload.min()) != p or int(payload.max()) != p:
                bad.append(p)
            _C.signal_store(ack.data_ptr(), p)

    t = threading.Thread(target=consumer)
    t.start()
    for p in range(1, phases + 1):
        payload.fill_(p)
        _C.signal_store(flag.data_ptr(), p)
        assert _C.signal_wait(ack.data_ptr(), p, 10.0)[0]
    t.join(timeout=20)
    assert not t.is_alive() and bad == []
