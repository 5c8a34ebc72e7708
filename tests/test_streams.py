"""The stream twin (overlap.dist.streams): work runs later than the host call and in order,
events order streams, errors surface at the next sync, injected delays shake out orders that
hold only by luck; the quantized collectives' async path stays exact under those delays; work
on caller tensors, and on buffers the caller's stream allocated, is refused unless ordered
after the caller (since the allocation: the caching allocator's rule); memory a stream's work
allocated and the caller freed is reused there only once ordered after the free, and a caller
buffer that work used without being given it must outlive the work (stream_memory)."""

import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from overlap.dist import stream_memory
from overlap.dist.streams import Stream, device_empty
from overlap.profile.syncs import count_host_syncs


def test_host_returns_at_once_and_work_runs_in_order():
    s = Stream(name="t1")
    seen = []
    t0 = time.monotonic()
    s.enqueue(lambda: (time.sleep(0.2), seen.append(1)))
    s.enqueue(lambda: seen.append(2))
    issued = time.monotonic() - t0
    ev = s.record_event()
    assert issued < 0.1 and not ev.query() and seen == []  # nothing has run yet
    with count_host_syncs() as c:
        ev.synchronize()
    assert seen == [1, 2] and ev.query() and c.count == 1  # the wait is a counted host sync
    s.close()


def test_wait_event_orders_two_streams():
    a, b = Stream(name="a"), Stream(name="b")
    box = torch.zeros(1)
    a.enqueue(lambda: (time.sleep(0.1), box.fill_(7.0)))
    done_a = a.record_event()
    b.wait_event(done_a)
    out = []
    b.enqueue(lambda: out.append(float(box)))
    b.synchronize()
    assert out == [7.0]
    a.close(), b.close()


def _two_ops_sharing_scratch(order_on_device: bool) -> list[float]:
    """Two 'reductions' on fresh streams that share one scratch buffer. Op A stages its value in
    scratch, its kernel runs a while, then reads scratch back; op B stages its own value. The
    host issues B after A, as the quantized collectives used to. Two host events pin the worst
    interleaving that host-only ordering allows (B writes after A has written and before A
    reads; each hold is bounded); with device ordering B cannot start until A is done."""
    scratch = torch.zeros(1)
    out = torch.zeros(2)
    a_wrote, b_wrote = threading.Event(), threading.Event()
    a, b = Stream(name="opA"), Stream(name="opB")
    a.enqueue(lambda: (scratch.fill_(1.0), a_wrote.set()))
    a.enqueue(lambda: b_wrote.wait(0.2 if order_on_device else 5.0))  # A's kernels running
    a.enqueue(lambda: out[0].copy_(scratch[0]))
    if order_on_device:
        b.wait_event(a.record_event())  # the fix: B's stream waits for A's, on the device
    b.enqueue(lambda: a_wrote.wait(5.0))
    b.enqueue(lambda: (scratch.fill_(2.0), b_wrote.set()))
    b.enqueue(lambda: out[1].copy_(scratch[0]))
    a.synchronize(), b.synchronize()
    a.close(), b.close()
    return out.tolist()


def test_scratch_reuse_needs_device_order():
    # Ordered only by the host having issued A first, B overwrites A's scratch mid-flight.
    assert _two_ops_sharing_scratch(order_on_device=False) == [2.0, 2.0]
    assert _two_ops_sharing_scratch(order_on_device=True) == [1.0, 2.0]


def test_an_error_surfaces_at_the_next_sync_and_voids_later_work():
    s = Stream(name="err")
    ran = []
    s.enqueue(lambda: 1 / 0)
    s.enqueue(lambda: ran.append(1))
    with pytest.raises(ZeroDivisionError):
        s.synchronize()
    assert ran == []
    s.close()


def test_closed_stream_refuses_work_and_its_thread_ends():
    s = Stream(name="closing")
    s.enqueue(lambda: None)
    s.close()
    assert not any(t.name == "overlap-stream-closing" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        s.enqueue(lambda: None)


def _async_quant_under_delays(n_ops):
    from overlap.comm import quant

    g, r = dist.group.WORLD, dist.get_rank()
    xs = [torch.randn(2048, generator=torch.Generator().manual_seed(10 * i + r))
          for i in range(n_ops)]
    sync = [quant.all_reduce(x.clone(), group=g, comm_dtype="int8") for x in xs]
    bufs = [x.clone() for x in xs]
    works = [quant.all_reduce(b, group=g, comm_dtype="int8", async_op=True) for b in bufs]
    for w in works:  # waited only at the end: all ops queued back to back on one group
        w.wait()
    return [int((a != b).sum()) for a, b in zip(sync, bufs)]


@pytest.mark.parametrize("world", [2, 4])
def test_async_quantized_ops_are_exact_under_stream_delays(world):
    env = {"OVERLAP_STREAM_DELAY_MS": "8", "OVERLAP_STREAM_SEED": "3"}
    for mismatches in run_ranks(_async_quant_under_delays, world, 6, env=env, timeout=120):
        assert mismatches == [0] * 6


def test_work_on_caller_tensors_must_be_ordered_after_the_caller():
    # On CPU the caller's writes are done before it enqueues, so a missing wait_current()
    # would never show as wrong numbers here; on a GPU the side stream could read the tensor
    # before the compute stream wrote it. The twin refuses it instead.
    s = Stream(name="order-check")
    t = torch.ones(4)
    with pytest.raises(RuntimeError, match="not ordered after the caller"):
        s.enqueue(lambda: t.mul_(2), (t,))
    s.wait_current()
    s.enqueue(lambda: t.mul_(2), (t,))
    with pytest.raises(RuntimeError, match="not ordered after the caller"):
        s.enqueue(lambda: t.mul_(2), (t,))  # one wait orders one enqueue of caller tensors
    s.enqueue(lambda: None)  # work that touches no caller tensor needs no wait
    s.synchronize()
    assert t.tolist() == [2.0] * 4
    s.close()


def test_an_event_orders_after_the_caller_only_if_its_stream_was():
    # wait_event on an event of a stream that never waited for the caller orders nothing
    # after the caller (the GPU rule); the twin used to count any event.
    a, b = Stream(name="never-after-caller"), Stream(name="after-a")
    t = torch.ones(4)
    b.wait_event(a.record_event())
    with pytest.raises(RuntimeError, match="stream 'after-a' touches caller tensors but the "
                                           "stream was not ordered after the caller"):
        b.enqueue(lambda: t.mul_(2), (t,))
    a.wait_current()
    b.wait_event(a.record_event())  # now the chain reaches the caller
    b.enqueue(lambda: t.mul_(3), (t,))
    b.synchronize()
    assert t.tolist() == [3.0] * 4
    a.close(), b.close()


def test_a_caller_allocation_is_touched_only_once_ordered_after_it():
    """The CUDA caching allocator: device_empty on the caller's stream may return memory the
    caller freed while kernels it queued before still read it; they are ordered only on the
    caller's stream. Another stream must therefore be ordered after the caller since the
    allocation before it writes the buffer. An event recorded before the allocation (the
    offloader's old reload order) is not enough; one recorded after it is, through any chain."""
    side, other = Stream(name="alloc-side"), Stream(name="alloc-other")
    side.wait_current()
    before = side.record_event()  # carries the caller point before the allocation
    buf = device_empty((4,), dtype=torch.float32, device=torch.device("cpu"))
    allocator = (r"stream '{}' touches a buffer allocated on the caller's stream \(device_empty, "
                 r"at caller point \d+\) but the stream is ordered after the caller only up to "
                 r"point \d+: the caching allocator reuses memory freed on the caller's stream "
                 r"at once")
    with pytest.raises(RuntimeError, match=allocator.format("alloc-side")):
        side.enqueue(lambda: buf.fill_(1.0), (buf,))
    other.wait_event(before)
    with pytest.raises(RuntimeError, match=allocator.format("alloc-other")):
        other.enqueue(lambda: buf[1:].fill_(1.0), (buf[1:],))  # a view is the same memory
    other.wait_current()  # after the allocation: the caller's earlier kernels come first
    other.enqueue(lambda: buf.fill_(3.0), (buf,))
    side.wait_event(other.record_event())  # the chain carries that order
    side.enqueue(lambda: buf.mul_(2.0), (buf,))
    side.synchronize()
    assert buf.tolist() == [6.0] * 4
    side.close(), other.close()


def test_the_copier_orders_each_copy_after_the_caller(monkeypatch):
    from overlap.tp.copier import Copier

    c = Copier(torch.device("cpu"), "copier-order", timeout=5.0)
    t = torch.zeros(3)
    c.wait(c.submit(lambda: t.fill_(1.0), t), "ok")
    monkeypatch.setattr(Stream, "wait_current", lambda self: None)  # the bug: no ordering
    with pytest.raises(RuntimeError, match="not ordered after the caller"):
        c.submit(lambda: t.fill_(2.0), t)
    c.close()
    assert t.tolist() == [1.0] * 3


FREED = (r"stream '{}' allocates, but memory that the stream's earlier work allocated \(64 bytes, "
         r"seen as float32\[16\]\) was freed by the caller at caller point \d+ and the stream is "
         r"ordered after the caller only up to point \d+: the caching allocator hands that "
         r"memory out again at once on this stream")


def _freed_by_the_caller(name: str, order_after_free: bool) -> float:
    """Work on a stream allocates a result; the caller reads it and frees it (on CUDA the block
    goes back to the stream's pool at once, while the caller's read may still be queued); then
    the stream allocates again."""
    s = Stream(name=name)
    box = {}
    s.enqueue(lambda: box.__setitem__("out", torch.full((16,), 2.0)))
    s.synchronize()
    out = box.pop("out")
    total = float(out.sum())  # the caller's use
    del out  # the caller's free
    if order_after_free:
        s.wait_current()  # the stream's later work waits for the caller's use
    s.enqueue(lambda: box.__setitem__("next", torch.ones(16) * 3))
    try:
        s.synchronize()
    finally:
        s.close()
    return total + float(box["next"].sum())


def test_memory_the_caller_freed_is_reused_only_once_ordered_after_the_free(monkeypatch):
    with pytest.raises(RuntimeError, match=FREED.format("freed-unordered")):
        _freed_by_the_caller("freed-unordered", order_after_free=False)
    assert _freed_by_the_caller("freed-ordered", order_after_free=True) == 32.0 + 48.0
    monkeypatch.setattr(stream_memory, "STRICT", False)  # the rule, not luck, caught it
    assert _freed_by_the_caller("freed-unchecked", order_after_free=False) == 32.0 + 48.0


def test_memory_the_stream_frees_itself_or_frees_after_later_work_is_issued_is_fine():
    s = Stream(name="freed-fine")
    box = {}
    s.enqueue(lambda: box.__setitem__("a", torch.full((16,), 2.0)))
    s.enqueue(lambda: box.pop("a"))  # freed by the stream's own work: its own order
    s.enqueue(lambda: box.__setitem__("b", torch.full((16,), 3.0)))
    s.synchronize()
    b = box.pop("b")
    gate = threading.Event()
    s.enqueue(lambda: gate.wait(10.0))
    s.enqueue(lambda: box.__setitem__("c", torch.full((16,), 4.0)))
    del b  # after the allocation above was issued: on CUDA it came first
    gate.set()
    s.synchronize()
    assert box.pop("c").tolist() == [4.0] * 16
    s.close()


def _use_without_giving(s: Stream, t: torch.Tensor, out: torch.Tensor) -> None:
    s.wait_current()
    s.enqueue(lambda: out.copy_(t * 2), (out,))  # t is read but not given


UNGIVEN = (r"stream '{}' used a buffer of the caller's \(16 bytes, seen as float32\[4\]\) that "
           r"it was not given \(enqueue\(..., tensors=\)\), and the caller dropped it before "
           r"that work was done")


def _dropped_before_the_work(name: str, keep_view: bool) -> list[float]:
    s = Stream(name=name)
    gate = threading.Event()
    s.enqueue(lambda: gate.wait(10.0))  # the stream is busy: the work below runs later
    out = torch.zeros(4)
    t = torch.ones(4)
    view = t[1:] if keep_view else None  # the caller still holds the memory
    _use_without_giving(s, t, out)
    del t  # on CUDA the allocator could hand t's memory out again now
    gate.set()
    try:
        s.synchronize()
    finally:
        s.close()
    del view
    return out.tolist()


def test_a_caller_buffer_the_work_was_not_given_must_outlive_it(monkeypatch):
    with pytest.raises(RuntimeError, match=UNGIVEN.format("ungiven")):
        _dropped_before_the_work("ungiven", keep_view=False)
    assert _dropped_before_the_work("ungiven-kept", keep_view=True) == [2.0] * 4
    s = Stream(name="ungiven-then")  # the violation is also raised by the next enqueue
    s.enqueue(lambda: None)
    s._memory.violation = RuntimeError("streams: recorded")
    with pytest.raises(RuntimeError, match="recorded"):
        s.enqueue(lambda: None)
    s.close()
    monkeypatch.setattr(stream_memory, "STRICT", False)
    assert _dropped_before_the_work("ungiven-unchecked", keep_view=False) == [2.0] * 4


def test_memory_that_is_not_the_allocators_is_exempt():
    import mmap

    s = Stream(name="shm")
    out = torch.zeros(4)
    t = torch.frombuffer(mmap.mmap(-1, 16), dtype=torch.float32)  # like a shared workspace
    t.fill_(1.0)
    gate = threading.Event()
    s.enqueue(lambda: gate.wait(10.0))
    _use_without_giving(s, t, out)
    del t
    gate.set()
    s.synchronize()
    assert out.tolist() == [2.0] * 4
    s.close()
