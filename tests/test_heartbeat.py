"""overlap.dist.heartbeat: a rank whose heartbeat stops (a frozen or dead node) is found within
the timeout by the ranks that watch it, every other rank learns it through ``abort`` within one
interval, a rank that finished is not taken for a lost one, and a store that stops answering
counts as a lost host. Ranks are threads sharing one real TCPStore; ``on_lost`` records instead
of exiting. Times are bounded by the timeout plus a few intervals (a loaded CI machine delays
threads, so the bounds are generous; the test would still fail on a watcher that never fires)."""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from overlap.dist.heartbeat import Heartbeat, watched_ranks

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")

INTERVAL, TIMEOUT = 0.1, 0.6


def _store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


class _Ranks:
    def __init__(self, store, world, rpn, **kw):
        self.lost: dict[int, tuple[float, str]] = {}
        self.lock = threading.Lock()
        self.beats = [Heartbeat(store, r, world, rpn, timeout=TIMEOUT, interval=INTERVAL,
                                label="test", on_lost=self._record(r), **kw)
                      for r in range(world)]

    def _record(self, rank):
        def on_lost(reason):
            with self.lock:
                self.lost[rank] = (time.monotonic(), reason)
        return on_lost

    def wait_lost(self, ranks, limit):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            with self.lock:
                if set(ranks) <= set(self.lost):
                    return
            time.sleep(INTERVAL / 2)


def test_watched_ranks_are_the_next_rank_and_the_next_node():
    assert watched_ranks(0, 8, 2) == [1, 2]
    assert watched_ranks(7, 8, 2) == [0, 1]
    assert watched_ranks(1, 2, 2) == [0]
    assert watched_ranks(0, 4, 4) == [1]


@pytest.mark.parametrize("world, rpn", [(2, 1), (4, 2)])
def test_a_frozen_rank_is_found_and_every_rank_stops(tmp_path, world, rpn):
    store = _store()
    fault = tmp_path / "fault_time"
    ranks = _Ranks(store, world, rpn, fault_file=str(fault))
    for b in ranks.beats:
        b.__enter__()
    time.sleep(3 * INTERVAL)
    frozen = world - 1
    t0, wall0 = time.monotonic(), time.time()
    ranks.beats[frozen].close(finished=False)  # its thread stops, no "bye": a frozen node
    others = [r for r in range(world) if r != frozen]
    ranks.wait_lost(others, limit=TIMEOUT + 30 * INTERVAL + 10)
    for b in ranks.beats:
        b.close(finished=False)
    assert sorted(ranks.lost) == others, ranks.lost
    for r in others:
        at, reason = ranks.lost[r]
        assert f"test: rank {frozen} stopped its heartbeat" in reason, reason
        assert TIMEOUT <= at - t0 + INTERVAL  # not before the timeout
    # the last sign of life: at most an interval before it froze, never after
    assert wall0 - 2 * INTERVAL - 0.5 <= float(fault.read_text()) <= wall0 + INTERVAL


def test_a_finished_rank_is_not_lost_and_a_failed_one_is():
    store = _Ranks(_store(), 2, 1)
    store.beats[0].__enter__()
    with pytest.raises(RuntimeError):
        with store.beats[1]:  # __exit__ on an exception: no "bye"
            raise RuntimeError("rank 1 failed")
    store.wait_lost([0], limit=TIMEOUT + 30 * INTERVAL + 10)
    assert list(store.lost) == [0] and "rank 1 stopped" in store.lost[0][1]
    store.beats[0].close()

    clean = _Ranks(_store(), 2, 1)
    for b in clean.beats:
        b.__enter__()
    clean.beats[1].close()  # finished: says bye
    time.sleep(TIMEOUT + 10 * INTERVAL)
    clean.beats[0].close()
    assert clean.lost == {}


def test_a_store_that_stops_answering_is_a_lost_host():
    master = _store()
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False,
                           timeout=timedelta(seconds=2))
    ranks = _Ranks(client, 2, 1)
    ranks.beats[0].__enter__()
    t0 = time.monotonic()
    del master  # the host of the store is gone
    ranks.wait_lost([0], limit=30)
    ranks.beats[0].close(finished=False)
    assert "the job's store stopped answering" in ranks.lost[0][1], ranks.lost
    # not at the first failed call: the rank hosting the store may just have finished first
    assert ranks.lost[0][0] - t0 >= TIMEOUT


def test_timeout_must_exceed_the_interval():
    with pytest.raises(ValueError, match="timeout 1 s must exceed the interval 1.0 s"):
        Heartbeat(_store(), 0, 2, 1, timeout=1)
