"""Activation offloading (overlap.memory) on the stream twin: gradients equal training without
offload bit for bit (fp32: the same kernels on the same values, only where the saved tensors
wait differs), with several micro-batches in flight, recomputation, a split backward and
injected stream delays; 0 host syncs; the host pool reused; the device-resident bytes measured
against the kept fraction; and the three rules, each broken on purpose: a device tensor
released before its copy to host ran, and a reload used before its event, both give wrong
numbers on the twin (as on a GPU); a reload written into its buffer before the compute stream's
earlier work ran (the caching allocator may have given that work's memory to it) is refused by
the twin. The tests with the rules pass only because the rules hold.
"""

from __future__ import annotations

import pytest
import torch

from overlap.memory import ActivationOffloader
from overlap.models.gpt import GPT, GPTConfig, gpt_loss
from overlap.profile.syncs import count_host_syncs
from overlap.train.recompute import apply_recompute

pytestmark = pytest.mark.own_delays  # CI's delay pass skips it (it injects delays itself)

L = 4
CFG = dict(vocab_size=64, seq_len=16, d_model=32, n_layer=L, n_head=4)


def _model(recompute: str = "none") -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    if recompute != "none":
        apply_recompute(model, recompute)
    return model


def _batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, 2, 17), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _grads(model: GPT, order=(1, 0, 2)) -> list[torch.Tensor]:
    """Forward every micro-batch, then their backwards in ``order``: several micro-batches'
    saved tensors in flight at once, as in a pipeline."""
    losses = [gpt_loss(model(x), y) for x, y in _batches()]
    for i in order:
        losses[i].backward()
    return [p.grad.clone() for p in model.parameters()]


def _offloaded(recompute="none", keep_last=1, min_bytes=1024, **rules
               ) -> tuple[GPT, ActivationOffloader]:
    model = _model(recompute)
    off = ActivationOffloader("cpu", timeout=30, census=True, min_bytes=min_bytes)
    for name, on in rules.items():
        setattr(off, f"_{name}", on)
    off.wrap(list(model.blocks), keep_last=keep_last)
    return model, off


def _reference(recompute="none") -> list[torch.Tensor]:
    return _grads(_model(recompute))


def _same(got, ref) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("delay", ["0", "3"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("keep_last", [0, 1])
def test_offload_changes_no_number(monkeypatch, recompute, keep_last, delay):
    monkeypatch.setenv("OVERLAP_STREAM_DELAY_MS", delay)
    ref = _reference(recompute)
    model, off = _offloaded(recompute, keep_last)
    try:
        assert _same(_grads(model), ref)
        # everything offloaded came back (the full-recompute blocks save only their inputs)
        assert off.stats.offloaded > 0 and off.stats.reloaded == off.stats.offloaded
        assert off.stats.kept > 0 if keep_last else off.stats.kept == 0
    finally:
        off.close()


def test_split_backward_unpacks_twice(monkeypatch):
    """The zero-bubble schedule's split: input gradients first (retain_graph), weights later;
    the second pass reads the reloaded tensors again."""
    monkeypatch.setenv("OVERLAP_STREAM_DELAY_MS", "2")

    def run(model):
        x, y = _batches(1)[0]
        h = model.pipeline_pieces()[0](x).detach().requires_grad_()
        out = h
        for block in model.blocks:
            out = block(out)
        loss = gpt_loss(model.pipeline_pieces()[-1](out), y)
        (dh,) = torch.autograd.grad(loss, h, retain_graph=True)
        ws = [p for b in model.blocks for p in b.parameters()]
        return [dh, *torch.autograd.grad(loss, ws)]

    ref = run(_model())
    model, off = _offloaded(keep_last=0)
    try:
        assert _same(run(model), ref)
    finally:
        off.close()


def test_steady_state_has_no_host_sync_and_reuses_the_host_pool():
    model, off = _offloaded(keep_last=1)
    try:
        _grads(model)
        first = off.pool.allocated_bytes
        assert first > 0
        for _ in range(2):
            model.zero_grad()
            with count_host_syncs() as syncs:
                _grads(model)
            assert syncs.count == 0, syncs.what
        assert off.pool.allocated_bytes <= first  # every buffer came back to the pool
    finally:
        off.close()


@pytest.mark.parametrize("min_bytes", [0, 1024])
def test_device_resident_bytes_follow_the_kept_fraction(min_bytes):
    """After the forward (copies to host done), the device still holds what the kept layers
    saved: <= keep/L of the run that offloads nothing, plus nothing in flight, plus (by
    default) the tensors under min_bytes that every layer keeps (its LayerNorm statistics,
    the attention's log-sum-exp)."""
    resident = {}
    for keep in (L, 2, 1, 0):
        model, off = _offloaded(keep_last=keep, min_bytes=min_bytes)
        try:
            x, y = _batches(1)[0]
            loss = gpt_loss(model(x), y)
            off.d2h.synchronize()  # the test's host wait: every copy to host has run
            resident[keep] = off.resident_saved_bytes()
            loss.backward()
        finally:
            off.close()
    base, small = resident[L], resident[0]
    assert base > 0
    assert small == 0 if min_bytes == 0 else 0 < small <= 0.05 * base, resident
    for keep in (2, 1):
        assert resident[keep] <= base * keep / L + small * (L - keep) / L, resident


@pytest.mark.parametrize("rule, delay", [("keep_source", "0"), ("wait_reload", "50")])
def test_each_rule_broken_gives_wrong_numbers(monkeypatch, rule, delay):
    """keep_source off: the device tensor is dropped as soon as its copy is queued (no
    record_stream), and the twin's copy reads reused memory. wait_reload off: the reloaded
    tensor is used without waiting for its copy's event, and stream delays make the backward
    read the poisoned, not yet filled buffer. Either way the gradients are wrong."""
    monkeypatch.setenv("OVERLAP_STREAM_DELAY_MS", delay)
    ref = _reference()
    model, off = _offloaded(keep_last=0, **{rule: False})
    try:
        got = _grads(model)
    finally:
        off.close()
    assert not _same(got, ref)
    assert any(g.isnan().any() for g in got)


@pytest.mark.parametrize("order_reload", [True, False])
def test_a_reload_writes_its_buffer_only_after_the_compute_stream_let_it_go(monkeypatch,
                                                                            order_reload):
    """The reload buffer comes from the caching allocator on the compute stream, which may
    hand it memory freed there while the backward's kernels queued before still read it (on
    the H200: an illegal memory access). So the h2d stream must be ordered after the compute
    stream since that allocation, not only after the copy to host. On CPU the numbers would
    come out right without that order (the host is the compute stream); the stream twin
    checks the order and refuses the copy, naming the stream and the allocator's rule."""
    monkeypatch.setenv("OVERLAP_STREAM_DELAY_MS", "2")
    ref = _reference()
    model, off = _offloaded(keep_last=0, order_reload=order_reload)
    try:
        if order_reload:
            assert _same(_grads(model), ref)
            assert off.stats.reloaded == off.stats.offloaded > 0
        else:
            with pytest.raises(RuntimeError, match=r"stream 'offload-h2d' touches a buffer "
                               r"allocated on the caller's stream \(device_empty.*the caching "
                               r"allocator reuses memory freed on the caller's stream at once"):
                _grads(model)
    finally:
        off.close()


def test_bad_arguments_are_refused():
    model = _model()
    off = ActivationOffloader("cpu", timeout=5)
    try:
        with pytest.raises(ValueError, match="no layers given"):
            off.wrap([])
        with pytest.raises(ValueError, match="keep_last must be an int >= 0, got -1"):
            off.wrap(list(model.blocks), keep_last=-1)
        with pytest.raises(TypeError, match="expected nn.Modules, got int"):
            off.wrap([3])
        off.wrap(list(model.blocks))
        with pytest.raises(ValueError, match="Block is wrapped already"):
            off.wrap([model.blocks[0]])
        with pytest.raises(RuntimeError, match="needs census=True"):
            off.resident_saved_bytes()
    finally:
        off.close()
    # unwrapped: the class's forward again
    assert "forward" not in model.blocks[0].__dict__


class _Scale(torch.nn.Module):
    """A layer whose output its own backward needs (exp saves its result)."""

    def forward(self, x):
        return torch.exp(x)


@pytest.mark.parametrize("where", ["the tensor", "a view of it", "its base"])
def test_a_saved_tensor_modified_in_place_after_its_copy_raises_autograds_error(where):
    """Without offload autograd refuses a backward through a saved tensor written in place;
    with offload the backward would read the copy from before the write: it must refuse too."""
    outs = []
    for offload in (False, True):
        layer = _Scale()
        off = ActivationOffloader("cpu", timeout=5, min_bytes=0)
        if offload:
            off.wrap([layer, torch.nn.Identity()])
        try:
            x = torch.randn(64, 8, requires_grad=True)
            base = torch.zeros(64, 8)
            y = layer(x + base)  # y saved by exp's backward, offloaded
            {"the tensor": lambda: y.mul_(2), "a view of it": lambda: y[3:5].add_(1),
             "its base": lambda: y.view(-1).zero_()}[where]()
            with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
                y.sum().backward()
            outs.append(str(info.value))
            assert (x.grad is None)
        finally:
            off.close()
    assert "ActivationOffloader" in outs[1] and "expected version 0" in outs[1], outs[1]


def test_an_unmodified_saved_tensor_passes_the_version_check():
    layer = _Scale()
    off = ActivationOffloader("cpu", timeout=5, min_bytes=0)
    off.wrap([layer, torch.nn.Identity()])
    try:
        x = torch.randn(64, 8, requires_grad=True)
        y = layer(x)
        z = y * 3  # reads y, writes nothing in place
        z.sum().backward()
        assert torch.equal(x.grad, 3 * torch.exp(x.detach()))
        assert off.stats.offloaded >= 1
    finally:
        off.close()
