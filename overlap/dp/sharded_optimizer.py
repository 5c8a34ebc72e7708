"""ShardedOptimizer: ZeRO-1/2 style optimizer over a sharded GradReducer.

DP rank ``r`` owns slice ``r`` of every (padded) gradient bucket: it keeps fp32 masters and the
inner optimizer's state (any ``torch.optim.Optimizer`` class) for those slices only, steps
them, and all-gathers the updated shards asynchronously into flat parameter buffers, each with
a stamp (overlap.dp.stamps.GatherStamps); each module's forward pre-hook waits only for its
own buckets. Param groups, mixed precision, checkpoints by shard pieces: docs/design/dp.md.

Shape legend: ``n_b`` padded elements of bucket b (a multiple of ``dp``), ``r`` DP rank::

    backward:  g_shard_b (n_b/dp)      = reduce_scatter(g_b (n_b)) / dp      (GradReducer)
    clip:      g_shard_b *= min(1, max_norm / ||g||)  (||g|| over every rank, see grad_norm_sq)
    step:      w_master_shard_b (n_b/dp, fp32) = inner_step(w_master_shard_b, g_shard_b)
    gather:    w_b (n_b, param dtype)  = all_gather(cast(w_master_shard_b))  (async)
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.dp.buckets import Layout, all_gather_async
from overlap.dp.stamps import GATHER_BYTES, GatherStamps
from overlap.profile.syncs import not_a_device_sync
from overlap.dp.grad_reducer import GradReducer, _reraise
from overlap.profile.timers import comm_wait

__all__ = ["ShardedOptimizer", "ShardPiece"]


@dataclasses.dataclass(slots=True, frozen=True)
class _Segment:
    bucket: int   # bucket index
    start: int    # offset inside this rank's shard of the bucket
    numel: int
    group: int    # param group index


@dataclasses.dataclass(slots=True, frozen=True)
class ShardPiece:
    """Elements ``[lo, hi)`` of ``reducer.params[param]`` (flattened) live in
    ``masters[segment][offset : offset + hi - lo]`` on this rank."""

    param: int
    lo: int
    hi: int
    segment: int
    offset: int


class ShardedOptimizer:
    """``optimizer_cls(**optimizer_kwargs)`` over this rank's shard of ``reducer``'s buckets.

    ``reducer`` must be built with ``shard=True``. Use it in place of a torch optimizer::

        reducer = GradReducer(model, dp_group=dims.dp_group, shard=True)
        opt = ShardedOptimizer(reducer, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
        loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, reducer: GradReducer, optimizer_cls: type[torch.optim.Optimizer], *,
                 param_groups: Sequence[dict] | None = None,
                 **optimizer_kwargs: Any) -> None:
        if not isinstance(reducer, GradReducer):
            raise TypeError(f"ShardedOptimizer: reducer must be a GradReducer, got "
                            f"{type(reducer).__name__}")
        if not reducer.config.shard:
            raise ValueError(f"ShardedOptimizer: {reducer.place}: the reducer must be built "
                             "with shard=True (it reduce-scatters instead of all-reducing)")
        if not (isinstance(optimizer_cls, type)
                and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"ShardedOptimizer: optimizer_cls must be a torch.optim.Optimizer "
                            f"subclass, got {optimizer_cls!r}")
        self.reducer = reducer
        self.dp_size, self.dp_rank = reducer.dp_size, reducer.dp_rank
        self._timeout = reducer.config.timeout
        self._group_of, self._group_options = self._parse_groups(param_groups)
        self._gathers: list = []
        self._steps = 0  # step() calls: part of every gather's stamp
        self._stamps = (GatherStamps(rank=self.dp_rank, world=self.dp_size,
                                     device=reducer.flat_device,
                                     where=f" (ShardedOptimizer on DP group "
                                           f"{dist.get_process_group_ranks(reducer.dp_group)})")
                        if self.dp_size > 1 else None)
        # seconds the forward pre-hooks waited for parameter gathers since the last step():
        # the part of the all-gather the forward did not hide
        self.forward_wait_s = 0.0
        self.inner: torch.optim.Optimizer | None = None
        self._build(reducer.layout)
        self.inner = optimizer_cls(self._inner_groups(), **optimizer_kwargs)
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
        self._raise_if_failed()
        self.reducer.finish()
        self.wait_params()  # the send buffers and the parameters are rewritten below
        self.reducer.freeze_layout()
        for seg, master in zip(self._segments, self.masters):
            g = self.reducer.grad_shard(self.reducer.buckets[seg.bucket]).narrow(
                0, seg.start, seg.numel)
            master.grad = g if g.dtype == torch.float32 else g.float()
        # torch's optimizers keep their step count in a host tensor even on a GPU, so the
        # .item() they make on it reads host memory, not the device.
        with not_a_device_sync("torch optimizer step counters live on the host"):
            self.inner.step()
        self.forward_wait_s = 0.0
        self._steps += 1
        self._launch_gathers()
        return loss

    @torch.no_grad()
    def grad_norm_sq(self, weights: Sequence[float] | None = None) -> torch.Tensor:
        """Sum of squares of this rank's reduced gradient shard (fp32 scalar tensor, no host
        sync). ``weights[i]`` multiplies parameter i's contribution: pass 0 for a parameter
        another rank also counts (e.g. one replicated over TP, on all TP ranks but one).
        Summing the result over the DP group (and TP, PP) gives the squared global norm with
        every element counted once; bucket padding is zero. Finishes the reduction first."""
        self.reducer.finish()
        total = torch.zeros((), dtype=torch.float32, device=self.masters[0].device)
        for piece in self._pieces:
            w = 1.0 if weights is None else float(weights[piece.param])
            if w == 0.0:
                continue
            g = self._piece_grad(piece).float()
            total += w * torch.dot(g, g)
        return total

    @torch.no_grad()
    def scale_grads_(self, coef: torch.Tensor | float) -> None:
        """Multiply this rank's reduced gradient shards by ``coef`` (clipping)."""
        self.reducer.finish()
        for bucket in self.reducer.buckets:
            self.reducer.grad_shard(bucket).mul_(coef)

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the parameters' current values into this rank's fp32 masters: call it after
        loading weights into the model (the next step would otherwise start from the old
        masters)."""
        self.wait_params()
        for seg, master in zip(self._segments, self.masters):
            out, _ = self._gather_views(seg.bucket)
            n = out.numel() // self.dp_size
            master.copy_(out.narrow(0, self.dp_rank * n + seg.start, seg.numel))

    @torch.no_grad()
    def publish_masters(self) -> None:
        """The converse of ``refresh_masters``: write the masters into the parameters of every
        rank (collective over the DP group), e.g. after loading masters from a checkpoint."""
        self.wait_params()
        self._raise_if_failed()
        self._launch_gathers()
        self.wait_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the reducer's gradient buffer (the ``.grad`` views stay attached)."""
        self.reducer.zero_grad()
        for m in self.masters:
            m.grad = None

    def wait_params(self) -> None:
        """Wait for every parameter all-gather still in flight."""
        self._wait(range(len(self._gathers)))

    def shard_pieces(self) -> list[ShardPiece]:
        """Which element range of which parameter each part of this rank's shard holds."""
        return list(self._pieces)

    def piece_state(self, piece: ShardPiece) -> dict[str, torch.Tensor]:
        """Views of ``piece``'s fp32 master and inner-optimizer state tensors (those shaped
        like the master; scalars such as AdamW's ``step`` are in ``scalar_state()``)."""
        master = self.masters[piece.segment]
        out = {"master": master.detach().narrow(0, piece.offset, piece.hi - piece.lo)}
        for k, t in self.inner.state.get(master, {}).items():
            if torch.is_tensor(t) and t.shape == master.shape:
                out[k] = t.narrow(0, piece.offset, piece.hi - piece.lo)
        return out

    def init_state(self) -> None:
        """Create the inner optimizer's state without changing any value (a zero-gradient step
        at lr 0 with a zero step count), so ``piece_state`` has tensors to load into."""
        if all(self.inner.state.get(m) for m in self.masters):
            return
        saved = [dict(g) for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"] = 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        before = [m.detach().clone() for m in self.masters]
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        with not_a_device_sync("torch optimizer step counters live on the host"):
            self.inner.step()
        for m, b in zip(self.masters, before):
            m.detach().copy_(b)
            m.grad = None
            for k, t in self.inner.state[m].items():
                if torch.is_tensor(t):
                    t.zero_()
        for g, s in zip(self.inner.param_groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})

    def scalar_state(self) -> dict[str, torch.Tensor]:
        """Inner-optimizer state that is one scalar per segment and equal on all of them
        (AdamW's ``step``), taken from the first segment."""
        st = self.inner.state.get(self.masters[0], {})
        return {k: t for k, t in st.items() if torch.is_tensor(t) and t.dim() == 0}

    def set_scalar_state(self, values: dict[str, torch.Tensor]) -> None:
        for m in self.masters:
            st = self.inner.state.setdefault(m, {})
            for k, v in values.items():
                if k in st:
                    st[k].copy_(v)
                else:
                    st[k] = v.clone()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: masters, inner optimizer state and param groups. Loadable by
        ``load_state_dict`` on the same layout (dp, buckets, groups)."""
        self.wait_params()
        return {"masters": [m.detach().clone() for m in self.masters],
                # torch returns references to its live state tensors: copy them
                "inner": copy.deepcopy(self.inner.state_dict()),
                "segments": [dataclasses.astuple(s) for s in self._segments],
                "order": list(self.reducer.layout.order),
                "dp": (self.dp_size, self.dp_rank)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()`` output of the same layout (dp, bucket order, segments) and
        publish the masters into the parameters (collective over the DP group). Build the
        reducer with ``rebuild_buckets=False`` (or load after its first step), since a rebuild
        would move the state out from under the optimizer."""
        got = (tuple(state.get("dp", ())), [tuple(s) for s in state.get("segments", [])],
               list(state.get("order", [])))
        want = ((self.dp_size, self.dp_rank), [dataclasses.astuple(s) for s in self._segments],
                list(self.reducer.layout.order))
        if got != want:
            raise ValueError(f"ShardedOptimizer.load_state_dict: {self.reducer.place}: the "
                             f"state is of another layout (dp, rank, buckets) {got[0]}, "
                             f"{len(got[1])} segments; this optimizer has {want[0]}, "
                             f"{len(want[1])} segments")
        for m, t in zip(self.masters, state["masters"]):
            m.copy_(t)
        self.inner.load_state_dict(state["inner"])
        self.publish_masters()

    def state_bytes(self) -> int:
        """Bytes of the inner optimizer's state tensors on this rank (e.g. AdamW's exp_avg and
        exp_avg_sq of this rank's shard)."""
        return sum(t.numel() * t.element_size() for st in self.inner.state.values()
                   for t in st.values() if torch.is_tensor(t))

    def master_bytes(self) -> int:
        """Bytes of this rank's fp32 master weights."""
        return sum(m.numel() * m.element_size() for m in self.masters)

    def close(self) -> None:
        """Wait for the gathers (unless the reducer failed) and remove the forward pre-hooks."""
        if self.reducer.failed is None and not self.reducer.closed:
            self.wait_params()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---------------------------------------------------------------- internals

    def _parse_groups(self, groups) -> tuple[list[int], list[dict]]:
        params = self.reducer.params
        index = {id(p): i for i, p in enumerate(params)}
        where = f"ShardedOptimizer: {self.reducer.place}: param_groups"
        group_of = [0] * len(params)
        options: list[dict] = [{}]
        seen: set[int] = set()
        for g in groups or ():
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"{where}: each group must be a dict with 'params', got {g!r}")
            options.append({k: v for k, v in g.items() if k != "params"})
            for p in g["params"]:
                i = index.get(id(p))
                if i is None:
                    raise ValueError(f"{where}: a parameter of shape {tuple(p.shape)} is not a "
                                     "parameter of the reducer's module")
                if i in seen:
                    raise ValueError(f"{where}: parameter {i} (shape {tuple(p.shape)}) is in "
                                     "two groups")
                seen.add(i)
                group_of[i] = len(options) - 1
        if groups and len(seen) == len(params):
            # every parameter is listed: no default group
            group_of = [g - 1 for g in group_of]
            options = options[1:]
        return group_of, options

    def _inner_groups(self) -> list[dict]:
        groups = [{"params": [], **opts} for opts in self._group_options]
        for seg, master in zip(self._segments, self.masters):
            groups[seg.group]["params"].append(master)
        return groups

    def _piece_grad(self, piece: ShardPiece) -> torch.Tensor:
        seg = self._segments[piece.segment]
        return self.reducer.grad_shard(self.reducer.buckets[seg.bucket]).narrow(
            0, seg.start + piece.offset, piece.hi - piece.lo)

    def _make_wait_hook(self, param_ids: list[int]) -> Callable:
        def hook(module: nn.Module, args) -> None:
            layout = self.reducer.layout
            t0 = time.perf_counter()
            self._wait({layout.param_bucket[i] for i in param_ids})
            self.forward_wait_s += time.perf_counter() - t0
        return hook

    def _raise_if_failed(self) -> None:
        # The optimizer's gathers run on the reducer's DP group: one failure state, the
        # reducer's (a failed gather fails it; a failed reduction refuses the step).
        self.reducer.check_usable("ShardedOptimizer")

    def _wait(self, buckets) -> None:
        self._raise_if_failed()
        for b in buckets:
            work = self._gathers[b]
            if work is None:
                continue
            what = f"ShardedOptimizer: {self.reducer.place}: parameter all-gather of bucket {b}"
            try:
                with comm_wait("dp.params"):
                    work.wait(self._timeout, group=self.reducer.dp_group, what=what)
                got = self._received.pop(b, None)
                if got is not None:
                    self._unpack(b, got)
            except BaseException as exc:
                # A failed gather fails the reducer, and so the optimizer: the other gathers
                # are abandoned.
                self.reducer.fail(exc, what)
                self._gathers = [None] * len(self._gathers)
                self._received.clear()
                _reraise(what, exc)
            self._gathers[b] = None

    def _unpack(self, b: int, got: torch.Tensor) -> None:
        """Bucket b's gathered rows [dp, row bytes]: compare the stamps, then write the
        payloads into the parameters (NaN on a GPU if the stamps disagreed)."""
        out, _ = self._gather_views(b)
        n = self.dp_size
        m, dt = out.numel() // n, self._param_dtype[b]
        size, off = m * dt.itemsize, self._stamp_at[b]
        self._stamps.verify(self.reducer.layout.buckets[b], got[:, off:off + GATHER_BYTES], out)
        out.view(n, m).copy_(got[:, :size].view(dt))
        self._stamps.poison(out)

    def _cut(self, layout: Layout) -> tuple[list[_Segment], list[ShardPiece]]:
        """This rank's shard of each bucket cut into segments (runs of one param group) and
        pieces (one parameter's elements inside one segment)."""
        params = self.reducer.params
        segments: list[_Segment] = []
        pieces: list[ShardPiece] = []
        for bucket in layout.buckets:
            n = bucket.padded // self.dp_size
            lo_b = bucket.offset + self.dp_rank * n  # flat offset of this rank's shard
            spans = []  # (start in shard, end in shard, param, param element lo)
            for i in bucket.params:
                _, off = layout.param_offset[i]
                a, b = max(off, lo_b), min(off + params[i].numel(), lo_b + n)
                if a < b:
                    spans.append((a - lo_b, b - lo_b, i, a - off))
            spans.sort()
            cuts = [0]
            groups = [self._group_of[spans[0][2]] if spans else 0]
            for start, _, i, _ in spans[1:]:
                if self._group_of[i] != groups[-1]:
                    cuts.append(start)
                    groups.append(self._group_of[i])
            cuts.append(n)
            first = len(segments)
            for k, g in enumerate(groups):
                segments.append(_Segment(bucket=bucket.index, start=cuts[k],
                                         numel=cuts[k + 1] - cuts[k], group=g))
            for start, end, i, plo in spans:
                k = max(j for j in range(len(groups)) if cuts[j] <= start)
                pieces.append(ShardPiece(param=i, lo=plo, hi=plo + end - start,
                                         segment=first + k, offset=start - cuts[k]))
        return segments, pieces

    @torch.no_grad()
    def _build(self, layout: Layout) -> None:
        params = self.reducer.params
        device = params[0].device
        # The parameters get their own flat buffers, one per *parameter* dtype, bucket by
        # bucket in the gradient layout's element offsets: with main grads (the reducer's
        # grad_dtype) the gradient buckets are fp32 while the parameters stay bf16, and the
        # all-gather must move parameter bytes.
        self._param_dtype: list[torch.dtype] = []
        self._param_offset: list[int] = []
        numel: dict[torch.dtype, int] = {}
        for bucket in layout.buckets:
            dts = sorted({str(params[i].dtype) for i in bucket.params})
            if len(dts) != 1:
                raise ValueError(
                    f"ShardedOptimizer: {self.reducer.place}: gradient bucket "
                    f"{bucket.index} ({bucket.dtype} gradients) holds parameters of dtypes "
                    f"{', '.join(dts)}, but a bucket's parameters are all-gathered as one "
                    "tensor: give the parameters that share a gradient buffer dtype one "
                    "dtype (e.g. model.to(torch.bfloat16) with grad_dtype=torch.float32)")
            dt = params[bucket.params[0]].dtype
            self._param_dtype.append(dt)
            self._param_offset.append(numel.get(dt, 0))
            numel[dt] = numel.get(dt, 0) + bucket.padded
        flat = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in numel.items()}
        for i, p in enumerate(params):
            b = layout.param_bucket[i]
            bucket = layout.buckets[b]
            _, off = layout.param_offset[i]
            view = flat[self._param_dtype[b]].narrow(
                0, self._param_offset[b] + off - bucket.offset, p.numel()).view(p.shape)
            view.copy_(p.detach())
            p.data = view
        self.flat_params = flat
        # Per bucket, this rank's send row: its shard of the parameters (parameter dtype) and,
        # with stamps, GATHER_BYTES at the next 8-byte boundary.
        self._send, self._stamp_at = [], []
        for b, bucket in enumerate(layout.buckets):
            size = bucket.padded // self.dp_size * self._param_dtype[b].itemsize
            at = -(-size // 8) * 8
            self._stamp_at.append(at)
            self._send.append(torch.zeros(size if self._stamps is None else at + GATHER_BYTES,
                                          dtype=torch.uint8, device=device))
        self._received: dict[int, torch.Tensor] = {}  # gathered rows in flight, by bucket
        if self._stamps is not None:
            self._stamps.new_layout()
        self._segments, self._pieces = self._cut(layout)
        self._gathers = [None] * len(layout.buckets)
        self.masters = []
        for seg in self._segments:
            out, _ = self._gather_views(seg.bucket, layout)
            n = out.numel() // self.dp_size
            shard = out.narrow(0, self.dp_rank * n + seg.start, seg.numel)
            self.masters.append(nn.Parameter(shard.to(torch.float32, copy=True)))
        first = {b.index: min(b.params) for b in layout.buckets}
        self._gather_order = sorted(first, key=first.get)

    def _gather_views(self, b: int, layout: Layout | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket b's parameters (padded, parameter dtype) and this rank's send buffer."""
        bucket = (layout or self.reducer.layout).buckets[b]
        dt, off = self._param_dtype[b], self._param_offset[b]
        m = bucket.padded // self.dp_size
        return (self.flat_params[dt].narrow(0, off, bucket.padded),
                self._send[b].narrow(0, 0, m * dt.itemsize).view(dt))

    def _launch_gathers(self) -> None:
        """Cast the fp32 masters into the send buffers (parameter dtype) and issue every
        bucket's all-gather, in forward order."""
        for seg, master in zip(self._segments, self.masters):
            _, send = self._gather_views(seg.bucket)
            send.narrow(0, seg.start, seg.numel).copy_(master)
        group = self.reducer.dp_group
        for b in self._gather_order:
            out, send = self._gather_views(b)
            if self._stamps is None:
                self._gathers[b] = all_gather_async(out, send, group=group)
                continue
            row = self._send[b]
            at = self._stamp_at[b]
            self._stamps.write(self.reducer.layout.buckets[b], self._param_dtype[b],
                               self.reducer.params, self._steps, row[at:])
            # Rows of every rank, unpacked into the parameters at the wait (docs/dp.md: costs)
            got = self._received[b] = torch.empty(self.dp_size, row.numel(), dtype=torch.uint8,
                                                  device=row.device)
            self._gathers[b] = all_gather_async(got.view(-1), row, group=group)

    def _on_layout_change(self, old: Layout, new: Layout) -> None:
        # The reducer re-buckets once, after its first iteration; before any step there is no
        # optimizer state to move, only the masters to rebuild from the parameters.
        if self.inner.state:
            raise RuntimeError("ShardedOptimizer: the bucket layout changed after a step")
        self.wait_params()
        self._build(new)
        for group, new_group in zip(self.inner.param_groups, self._inner_groups()):
            group["params"] = new_group["params"]
