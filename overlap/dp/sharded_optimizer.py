"""ShardedOptimizer: ZeRO-1/2 style optimizer over a sharded GradReducer.

Each DP rank owns slice ``r`` of every gradient bucket (``GradReducer(shard=True)`` pads every
bucket to a multiple of ``dp`` and reduce-scatters it under the backward). For its slices only,
the rank keeps fp32 master weights and the wrapped torch optimizer's state: the inner optimizer
(any ``torch.optim.Optimizer`` class, built with the given keyword arguments) runs over one flat
fp32 ``nn.Parameter`` per bucket shard. After the step, the updated shards are all-gathered,
bucket by bucket, into a flat parameter buffer of which every ``p.data`` is a view.

Shape legend: ``n_b`` padded elements of bucket b (a multiple of ``dp``), ``r`` DP rank::

    backward:  g_shard_b (n_b/dp)      = reduce_scatter(g_b (n_b)) / dp      (GradReducer)
    step:      w_master_shard_b (n_b/dp, fp32) = inner_step(w_master_shard_b, g_shard_b)
    gather:    w_b (n_b, param dtype)  = all_gather(cast(w_master_shard_b))  (async)

**Overlap with the next forward.** ``step()`` issues every bucket's all-gather right away
(asynchronously, in forward order: buckets sorted by their first parameter's registration
index) and returns. A forward pre-hook on each submodule that owns parameters waits only for
the buckets holding *its* parameters, so the gathers of later layers run under the forward of
earlier ones. All gathers are issued at once rather than from the hooks: which modules run can
differ between ranks (data-dependent branches), and collectives must be issued in the same
order on every rank. ``wait_params()`` waits for all of them (before reading parameters outside
a forward, e.g. for a checkpoint); the next ``step()`` does too.

**Memory.** Optimizer state and fp32 master weights are 1/dp of the unsharded ones (plus bucket
padding); ``state_bytes()`` measures it. The full-size gradient buffer stays (ZeRO-1 memory with
ZeRO-2 communication): ``p.grad`` holds this rank's local gradient, the reduced slice is in
``reducer.grad_shard``. Every parameter of a bucket shares the inner optimizer's single param
group (one set of hyper-parameters for the whole model). Gradient clipping by global norm and
a (sharded) ``state_dict`` are not provided.

**Backends.** The reduce-scatter and all-gather are the backend's own flat-tensor collectives
(``reduce_scatter_single`` / ``all_gather_single``, native on NCCL and, in torch 2.13, on
gloo); with ``comm_dtype`` "bf16"/"int8" the reduce-scatter goes through
``overlap.comm.quant.reduce_scatter`` on both. Parameters are always gathered exactly.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.nn as nn

from overlap.dp.buckets import Layout, all_gather_async
from overlap.profile.syncs import not_a_device_sync
from overlap.dp.grad_reducer import GradReducer
from overlap.profile.timers import comm_wait

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer:
    """``optimizer_cls(**optimizer_kwargs)`` over this rank's shard of ``reducer``'s buckets.

    ``reducer`` must be built with ``shard=True``. Use it in place of a torch optimizer::

        reducer = GradReducer(model, dp_group=dims.dp_group, shard=True)
        opt = ShardedOptimizer(reducer, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
        loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, reducer: GradReducer, optimizer_cls: type[torch.optim.Optimizer],
                 **optimizer_kwargs: Any) -> None:
        if not isinstance(reducer, GradReducer):
            raise TypeError(f"ShardedOptimizer: reducer must be a GradReducer, got "
                            f"{type(reducer).__name__}")
        if not reducer.config.shard:
            raise ValueError(f"ShardedOptimizer: rank {reducer.rank}: the reducer must be built "
                             "with shard=True (it reduce-scatters instead of all-reducing)")
        if not (isinstance(optimizer_cls, type)
                and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"ShardedOptimizer: optimizer_cls must be a torch.optim.Optimizer "
                            f"subclass, got {optimizer_cls!r}")
        self.reducer = reducer
        self.dp_size, self.dp_rank = reducer.dp_size, reducer.dp_rank
        self._timeout = reducer.config.timeout
        self._gathers: list = []
        # seconds the forward pre-hooks waited for parameter gathers since the last step():
        # the part of the all-gather the forward did not hide
        self.forward_wait_s = 0.0
        self.inner: torch.optim.Optimizer | None = None
        self._build(reducer.layout)
        self.inner = optimizer_cls(self.masters, **optimizer_kwargs)
        reducer.add_layout_listener(self._on_layout_change)
        index = {id(p): i for i, p in enumerate(reducer.params)}
        self._hooks = []
        for module in reducer.module.modules():
            ids = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if ids:
                self._hooks.append(module.register_forward_pre_hook(self._make_wait_hook(ids)))

    # ---------------------------------------------------------------- public

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param groups (e.g. for a learning-rate schedule)."""
        return self.inner.param_groups

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the gradient reduction, step on this rank's shard, launch the all-gathers."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reducer.finish()
        self.wait_params()  # the send buffers and the parameters are rewritten below
        self.reducer.freeze_layout()
        for bucket, master in zip(self.reducer.buckets, self.masters):
            g = self.reducer.grad_shard(bucket)
            master.grad = g if g.dtype == torch.float32 else g.float()
        # torch's optimizers keep their step count in a host tensor even on a GPU, so the
        # .item() they make on it reads host memory, not the device.
        with not_a_device_sync("torch optimizer step counters live on the host"):
            self.inner.step()
        self.forward_wait_s = 0.0
        for b in self._gather_order:
            bucket = self.reducer.buckets[b]
            n = bucket.padded // self.dp_size
            send = self._send[bucket.dtype].narrow(0, bucket.offset // self.dp_size, n)
            send.copy_(self.masters[b])
            out = self.flat_params[bucket.dtype].narrow(0, bucket.offset, bucket.padded)
            self._gathers[b] = all_gather_async(out, send, group=self.reducer.dp_group)
        return loss

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the parameters' current values into this rank's fp32 masters: call it after
        loading weights into the model (the next step would otherwise start from the old
        masters)."""
        self.wait_params()
        for bucket, master in zip(self.reducer.buckets, self.masters):
            off, n = bucket.shard(self.dp_size, self.dp_rank)
            master.copy_(self.flat_params[bucket.dtype].narrow(0, off, n))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the reducer's gradient buffer (the ``.grad`` views stay attached)."""
        self.reducer.zero_grad()
        for m in self.masters:
            m.grad = None

    def wait_params(self) -> None:
        """Wait for every parameter all-gather still in flight."""
        self._wait(range(len(self._gathers)))

    def state_bytes(self) -> int:
        """Bytes of the inner optimizer's state tensors on this rank (e.g. AdamW's exp_avg and
        exp_avg_sq of this rank's shard)."""
        return sum(t.numel() * t.element_size() for st in self.inner.state.values()
                   for t in st.values() if torch.is_tensor(t))

    def master_bytes(self) -> int:
        """Bytes of this rank's fp32 master weights."""
        return sum(m.numel() * m.element_size() for m in self.masters)

    def close(self) -> None:
        """Wait for the gathers and remove the forward pre-hooks."""
        self.wait_params()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---------------------------------------------------------------- internals

    def _make_wait_hook(self, param_ids: list[int]) -> Callable:
        def hook(module: nn.Module, args) -> None:
            layout = self.reducer.layout
            t0 = time.perf_counter()
            self._wait({layout.param_bucket[i] for i in param_ids})
            self.forward_wait_s += time.perf_counter() - t0
        return hook

    def _wait(self, buckets) -> None:
        for b in buckets:
            work = self._gathers[b]
            if work is None:
                continue
            with comm_wait("dp.params"):
                work.wait(self._timeout, group=self.reducer.dp_group,
                          what=f"ShardedOptimizer: rank {self.reducer.rank}: parameter "
                               f"all-gather of bucket {b}")
            self._gathers[b] = None

    @torch.no_grad()
    def _build(self, layout: Layout) -> None:
        params = self.reducer.params
        device = params[0].device
        flat = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in layout.numel.items()}
        for i, p in enumerate(params):
            dt, off = layout.param_offset[i]
            view = flat[dt].narrow(0, off, p.numel()).view(p.shape)
            view.copy_(p.detach())
            p.data = view
        self.flat_params = flat
        self._send = {dt: torch.zeros(n // self.dp_size, dtype=dt, device=device)
                      for dt, n in layout.numel.items()}
        self.masters = []
        for bucket in layout.buckets:
            off, n = bucket.shard(self.dp_size, self.dp_rank)
            shard = flat[bucket.dtype].narrow(0, off, n)
            self.masters.append(nn.Parameter(shard.to(torch.float32, copy=True)))
        self._gathers = [None] * len(layout.buckets)
        first = {b.index: min(b.params) for b in layout.buckets}
        self._gather_order = sorted(first, key=first.get)

    def _on_layout_change(self, old: Layout, new: Layout) -> None:
        # The reducer re-buckets once, after its first iteration; before any step there is no
        # optimizer state to move, only the masters to rebuild from the parameters.
        if self.inner.state:
            raise RuntimeError("ShardedOptimizer: the bucket layout changed after a step")
        self.wait_params()
        self._build(new)
        self.inner.param_groups[0]["params"] = list(self.masters)
