"""GradReducer: bucketed, asynchronous data-parallel gradient reduction under the backward pass.

Every ``.grad`` is a view into one flat buffer per dtype, cut into buckets (overlap.dp.buckets);
a bucket's collective launches (async, strictly in bucket order on every rank) from the
post-accumulate-grad hook that completes it, and autograd's final callback waits for all, so
the gradients are reduced when ``loss.backward()`` returns. Options: ``op`` avg/sum,
``comm_dtype`` fp32/bf16/int8 (overlap.comm.quant), main grads (``grad_dtype``), ``shard=True``
(reduce-scatter, for ShardedOptimizer), ``bucket_cap_mb="auto"`` (overlap.dp.autobucket).
Every bucket carries an agreement stamp (overlap.dp.stamps); a failed bucket fails the reducer.
The design (bucket order, hooks, averaging, main grads): docs/design/dp.md.

Shape legend: ``n_b`` padded elements of bucket b, ``dp`` DP size, ``r`` DP rank::

    all-reduce:      g_b (n_b,)         = sum_ranks g_b^rank / dp      (op="avg")
    reduce-scatter:  g_shard_b (n_b/dp) = sum_ranks g_b^rank[r*n_b/dp : (r+1)*n_b/dp] / dp
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, Iterator, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.comm.quant import ErrorFeedback, QuantCommError
from overlap.dp import autobucket
from overlap.dp import buckets as dp_comm
from overlap.dp.buckets import (MiB, Bucket, Layout, ReducerConfig, broadcast_params,
                                 build_layout, check_same_params)
from overlap.dp.stamps import BucketStamps, bucket_tag, tail_elements
from overlap.dist.communicator import CommFailed, Communicator
from overlap.dist.stamp import Disagreement
from overlap.profile import names, nvtx
from overlap.profile.timers import comm_wait

__all__ = ["GradReducer", "ReducerConfig", "IterationStats", "ReducerFailed"]  # ReducerConfig: re-exported


class ReducerFailed(CommFailed):
    """A call on a GradReducer (or its ShardedOptimizer) that failed earlier or was closed; a
    ``CommFailed``, so an ``OverlapError`` and a ``RuntimeError``."""

def _reraise(what: str, exc: BaseException) -> NoReturn:
    """Raise ``exc`` again with ``what`` (the reducer, rank and bucket) in front of its message,
    as the same type. Disagreements and quantized-collective failures are rebuilt (a launch
    raises the latter when an earlier bucket's exchange found the ranks disagreeing); other
    errors (timeouts that already name their op and ranks, interrupts) pass through as they are."""
    if isinstance(exc, Disagreement):
        raise Disagreement(f"{what}: {exc}", op=exc.op, call=exc.call, ranks=exc.ranks) from exc
    if isinstance(exc, QuantCommError):
        raise type(exc)(f"{what}: {exc}", op=exc.op, group=exc.group, rank=exc.rank,
                        peer=exc.peer, kind=exc.kind) from exc
    raise exc


@dataclasses.dataclass(slots=True)
class IterationStats:
    """Timestamps (``time.perf_counter``) of the last synchronising iteration.

    ``launch_times[b]``: when bucket b's collective was issued; ``launched_in_backward[b]``:
    from a gradient hook (True) or from ``finish()`` (False); ``ready_times``: each gradient's
    hook, in ready order; ``backward_end``: when ``finish()`` started; ``wait_s``: seconds
    ``finish()`` spent waiting for collectives (communication not hidden by the backward)."""

    launch_times: list[float] = dataclasses.field(default_factory=list)
    launched_in_backward: list[bool] = dataclasses.field(default_factory=list)
    ready_times: list[float] = dataclasses.field(default_factory=list)
    backward_end: float | None = None
    wait_s: float = 0.0


class GradReducer(Communicator):
    """Data-parallel gradient reduction of ``module`` over ``dp_group``, overlapped with the
    backward pass. ``config`` (a ``ReducerConfig``) holds the options; its fields given as
    keywords override it. Its failure rule is the Communicator's (a failed bucket fails the
    reducer; ``rank`` is the DP rank, ``global_rank`` this process's).

    Construction is collective over ``dp_group``: it checks that every rank has the same
    parameters (count, shapes, dtypes) and, by default, broadcasts DP rank 0's values.
    """

    failed_type = ReducerFailed
    refused_failed = "GradReducer: {place}: the reducer failed earlier and stays failed: {failure}"
    refused_closed = "GradReducer: {place}: {op}: the reducer was closed"

    def __init__(self, module: nn.Module, config: ReducerConfig | None = None, *,
                 dp_group: dist.ProcessGroup, params: list[nn.Parameter] | None = None,
                 divisor: int | None = None, **overrides) -> None:
        """``params``: reduce only these parameters of ``module`` (default: every parameter
        that requires grad), e.g. the expert parameters over the expert-data-parallel group
        and the rest over DP (``overlap.moe.split_expert_parameters``). ``divisor``: what
        ``op="avg"`` divides by (default: the group's size); expert gradients, which already
        sum the tokens of the whole EP group, divide by the DP size instead."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"GradReducer: module must be an nn.Module, got "
                            f"{type(module).__name__}")
        if dp_group is None:
            rank = dist.get_rank() if dist.is_initialized() else "?"
            raise ValueError(f"GradReducer: rank {rank}: dp_group is required (pass "
                             "ParallelDims.dp_group or dist.group.WORLD explicitly)")
        try:
            if config is None:
                self.config = ReducerConfig(**overrides)
            elif not isinstance(config, ReducerConfig):
                raise TypeError(f"GradReducer: config must be a ReducerConfig, got "
                                f"{type(config).__name__}")
            else:
                self.config = dataclasses.replace(config, **overrides)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{exc} (rank {dist.get_rank()})") from None
        super().__init__(dp_group, timeout=self.config.timeout)
        self.module = module
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = self.world, self.rank
        self._src = dist.get_global_rank(dp_group, 0)
        if params is None:
            self.params: list[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        else:
            mine = {id(p) for p in module.parameters()}
            self.params = list(params)
            seen: set[int] = set()
            bad = []
            for i, p in enumerate(self.params):  # foreign, frozen or repeated
                if id(p) not in mine or not p.requires_grad or id(p) in seen:
                    bad.append(i)
                seen.add(id(p))
            if bad:
                raise ValueError(f"GradReducer: {self.place}: params must be distinct "
                                 f"parameters of the module that require grad (entries {bad} "
                                 "are not)")
        if not self.params:
            raise ValueError(f"GradReducer: {self.place}: module has no parameter that "
                             "requires grad" if params is None else
                             f"GradReducer: {self.place}: params is empty")
        if divisor is not None and (isinstance(divisor, bool) or not isinstance(divisor, int)
                                    or divisor < 1):
            raise ValueError(f"GradReducer: {self.place}: divisor must be a positive int "
                             f"or None, got {divisor!r}")
        self.divisor = self.dp_size if divisor is None else divisor
        if any(p.layout != torch.strided for p in self.params):
            raise TypeError(f"GradReducer: {self.place}: only dense (strided) parameters "
                            "are supported")
        check_same_params(self.params, group=self.dp_group, where=f"GradReducer: {self.place}",
                          timeout=self.config.timeout)
        if self.config.broadcast_params and self.dp_size > 1:
            broadcast_params(self.params, src=self._src, group=self.dp_group)

        self._checked = False
        self._feedbacks: dict[tuple[int, int], ErrorFeedback] = {}
        self.flat_device = self.params[0].device
        self._sync = True
        self._sync_if: Callable[[], bool] | None = None
        self._passes = 0  # backward passes accumulated since the last synchronising one
        self._frozen = False
        self._final = not self.config.rebuild_buckets
        self._layout_listeners: list[Callable[[Layout, Layout], None]] = []
        self.flat: dict[torch.dtype, torch.Tensor] = {}
        self._grad_shard: dict[torch.dtype, torch.Tensor] = {}
        self._views: list[torch.Tensor] = []
        gd = self.config.grad_dtype
        # Main-grad parameters: their gradient buffer has another dtype than the parameter, so
        # it cannot be p.grad; it is p.main_grad. _dead[i]: the main grad's contents are stale
        # (logically zero): the next gradient overwrites instead of adding.
        self._main = [gd is not None and p.dtype != gd for p in self.params]
        # op="avg": gradients are divided by the DP size as they are folded into the buffer.
        self._scale = (1.0 / self.divisor if self.config.op == "avg" and self.divisor > 1
                       else None)
        self._dead = [True] * len(self.params)
        # Per-call agreement of the plain collectives (overlap.dp.stamps): a stamp in a tail of
        # each bucket's buffer (all-reduce) or of each shard (reduce-scatter). The quantized
        # collectives carry their own stamp.
        self._stamps = (BucketStamps(rank=self.dp_rank, world=self.dp_size,
                                     device=self.flat_device,
                                     where=f" (GradReducer on DP group "
                                           f"{dist.get_process_group_ranks(dp_group)})")
                        if self.dp_size > 1 and self.config.comm_dtype == "fp32" else None)
        self._install(self._make_layout(list(reversed(range(len(self.params))))), copy=False)
        self.stats = IterationStats()
        self.link: tuple[float, float] | None = None  # (alpha s, beta s/B) measured by "auto"
        # bucket_cap_mb="auto": the candidate layouts being timed, and what the timing found.
        self._tuner: autobucket.BucketTuner | None = None
        self._candidates: list[tuple[str, Layout]] = []
        self.auto_report: dict | None = None
        self._reset_iteration()
        self._hooks = [p.register_post_accumulate_grad_hook(
                           functools.partial(self._on_grad_ready, i))
                       for i, p in enumerate(self.params)]
        self._hooks.append(module.register_forward_pre_hook(self._forward_pre_hook))

    # ---------------------------------------------------------------- public

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def buckets(self) -> list[Bucket]:
        return self._layout.buckets

    @property
    def tuning(self) -> bool:
        """``bucket_cap_mb="auto"``: True while candidate layouts are still being timed (the
        layout changes between synchronising iterations until then)."""
        return self._tuner is not None

    def grad_shard(self, bucket: Bucket) -> torch.Tensor:
        """Sharded mode: this rank's reduced slice of ``bucket``, shape (padded / dp,)."""
        if not self.config.shard:
            raise RuntimeError("GradReducer.grad_shard: the reducer was built with shard=False")
        return self._grad_shard[bucket.dtype].narrow(0, self._shard_offset[bucket.index],
                                                      bucket.padded // self.dp_size)

    def finish(self) -> None:
        """Launch every bucket not launched yet (in index order) and wait for all of them.

        Runs automatically at the end of every synchronising backward; a no-op when nothing
        happened since the last call, or inside ``no_sync()``."""
        self.check_usable("finish")
        if not self._sync or not (self._active or self._forward_seen):
            return
        if not self._active:  # an explicit finish() after a forward without backward hooks
            self.stats = IterationStats()
        if self.stats.backward_end is None:
            self.stats.backward_end = time.perf_counter()
        self._active = False
        self._forward_seen = False
        while self._next < len(self.buckets):
            if self._missing[self._next]:  # holds parameters the backward did not reach
                self._settle(i for i in self.buckets[self._next].params if not self._fired[i])
            self._launch(self._next, in_backward=False)
            self._next += 1
        t0 = time.perf_counter()
        self._wait_all()
        self.stats.wait_s = time.perf_counter() - t0
        self._checked = True
        # Main grads now hold this step's reduced gradient; the next backward starts anew.
        self._dead = list(self._main)
        if self._tuner is not None:  # "auto": the next candidate layout, or the choice
            self._try_candidate(self._tuner.stop())
        elif not self._final and not self._frozen:
            self._rebuild()
        if self.config.shard and not self._final_at_launch:
            self._fill_shards_from_full()
        self._reset_iteration()

    def reduce_now(self) -> float:
        """Reduce the current gradient buffer right now (every bucket, then wait); returns the
        seconds it took. Not for use during a backward. The bench uses it to time the
        collectives alone."""
        if self._active:
            raise RuntimeError("GradReducer.reduce_now: called during a backward pass")
        t0 = time.perf_counter()
        self._reset_iteration()
        self.stats = IterationStats()
        self._settle(range(len(self.params)))
        for b in range(len(self.buckets)):
            self._launch(b, in_backward=False)
        self._wait_all()
        self._reset_iteration()
        return time.perf_counter() - t0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes run inside accumulate into the gradient buffer without any
        communication; the first synchronising backward after it reduces the accumulated sum."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def sync_if(self, predicate: Callable[[], bool] | None) -> None:
        """``predicate()`` is asked at the first gradient hook of every backward; False makes
        that backward accumulate locally, as inside ``no_sync()``. A pipeline schedule passes
        ``lambda: stage.last_backward`` so only a stage's last micro-batch backward reduces."""
        self._sync_if = predicate

    def zero_grad(self) -> None:
        """Zero the flat gradient buffers (one memset per dtype) and re-attach the views (the
        main grads of ``grad_dtype`` parameters restart from zero too)."""
        for buf in self.flat.values():
            buf.zero_()
        for i, (p, view) in enumerate(zip(self.params, self._views)):
            if self._main[i]:
                self._dead[i] = False
            else:
                p.grad = view

    def freeze_layout(self) -> None:
        """Never rebuild the buckets from now on (a ShardedOptimizer calls it at its first
        step, when its state starts to depend on the layout)."""
        self._frozen = True
        self._final = True
        if self._tuner is not None:  # keep the candidate installed now
            self._tuner, self._candidates = None, []
            self.auto_report = dict(candidates=[], chosen=None, frozen=True)

    def add_layout_listener(self, fn: Callable[[Layout, Layout], None]) -> None:
        """``fn(old_layout, new_layout)`` runs after the buckets are rebuilt."""
        self._layout_listeners.append(fn)

    def _release(self, wait_for_peers: bool) -> None:
        """Remove every hook this reducer installed."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---------------------------------------------------------------- hooks

    def _forward_pre_hook(self, module: nn.Module, args) -> None:
        # No per-parameter work here: a gradient that is None (optimizer.zero_grad(
        # set_to_none=True)) or a tensor the user assigned is folded into the buffer by the
        # gradient hook, or by _settle() for a parameter the backward did not reach.
        if self._sync and torch.is_grad_enabled():
            self._forward_seen = True

    def _on_grad_ready(self, i: int, p: torch.Tensor) -> None:
        now = time.perf_counter()
        if not (self._active or self._local):
            self._start_backward()
        view = self._views[i]
        g = p.grad
        scale = self._scale
        if self._main[i]:  # fold the low-precision gradient into the fp32 main grad, scaled
            _fold(view, g, scale, overwrite=self._dead[i])
            self._dead[i] = False
            p.grad = None
            if self._local:
                return
        elif self._local:
            if g is not view and g.data_ptr() != view.data_ptr():
                # AccumulateGrad made a new tensor (the grad was None: DDP's "steal") or added
                # into one the user assigned: it holds the whole local gradient.
                view.copy_(g)
                p.grad = view
            return
        else:
            # A synchronising backward folds the gradient into the bucket already divided by
            # the DP size (op="avg"), so no pass over the bucket is left before its collective,
            # and detaches it until the bucket is launched, so a second gradient for the same
            # parameter (reentrant checkpointing) arrives as a fresh tensor and is folded too.
            if g is view or g.data_ptr() == view.data_ptr():
                if scale is not None:  # accumulated in place (no_sync micro-batches before)
                    view.mul_(scale)
            else:
                _fold(view, g, scale, overwrite=not self._fired[i])
            p.grad = None
        if self._fired[i]:
            b = self._layout.param_bucket[i]
            if b < self._next:
                raise RuntimeError(
                    f"GradReducer: {self.place}: gradient of parameter {i} was accumulated "
                    f"again after its bucket {b} was launched (a second backward through the "
                    "same parameter before finish(); reentrant checkpointing is not supported)")
            return
        self._fired[i] = True
        self._observed.append(i)
        self.stats.ready_times.append(now)
        b = self._layout.param_bucket[i]
        self._missing[b] -= 1
        if self._missing[b] == 0 and self.config.overlap:
            # Strict index order: a later bucket that is ready waits for the earlier ones.
            while self._next < len(self.buckets) and self._missing[self._next] == 0:
                self._launch(self._next, in_backward=True)
                self._next += 1

    def _settle(self, indices) -> None:
        """Fold the logical gradient of parameters whose gradient hook did not run this
        backward into the buffer, as the hook would: a None grad (or a stale main grad) is
        zero, a locally accumulated view is scaled, a tensor the user assigned is copied."""
        scale = self._scale
        for i in indices:
            p, view = self.params[i], self._views[i]
            if self._main[i]:
                if self._dead[i]:
                    view.zero_()
                    self._dead[i] = False
                continue
            g = p.grad
            if g is None:
                view.zero_()
            elif g is view or g.data_ptr() == view.data_ptr():
                if scale is not None:
                    view.mul_(scale)
            else:
                _fold(view, g, scale, overwrite=True)
            p.grad = view

    def _start_backward(self) -> None:
        self.check_usable("backward")  # not a stale "accumulated again" from the failed iteration
        engine = torch.autograd.Variable._execution_engine
        self._passes += 1
        if self._sync and (self._sync_if is None or self._sync_if()):
            if self._stamps is not None:
                self._stamps.passes = self._passes
            self._passes = 0
            self._active = True
            self.stats = IterationStats()
            if self._tuner is not None:
                self._tuner.start()
            engine.queue_callback(self._backward_done)
        else:
            self._local = True
            engine.queue_callback(self._local_done)

    def _backward_done(self) -> None:
        self.stats.backward_end = time.perf_counter()
        self.finish()

    def _local_done(self) -> None:
        self._local = False
        self._forward_seen = False

    # ---------------------------------------------------------------- comm

    def _tag(self, bucket: Bucket) -> int:
        tag = self._tags.get(bucket.index)
        if tag is None:
            tag = self._tags[bucket.index] = bucket_tag(bucket, self.params)
        return tag

    def _tail(self, bucket: Bucket) -> torch.Tensor:
        return self.flat[bucket.dtype].narrow(0, bucket.offset + bucket.padded, bucket.tail)

    def _place(self) -> str:
        return f"rank {self.global_rank}"

    def _launch(self, b: int, *, in_backward: bool) -> None:
        self.check_usable("launch")
        bucket = self.buckets[b]
        buf = self.flat[bucket.dtype].narrow(0, bucket.offset, bucket.span)
        cfg = self.config
        scatter = cfg.shard and self._final
        if self._stamps is not None:
            if scatter:  # the shards and their stamp tails, copied apart (docs/dp.md)
                self._release_finished_scatters()
                buf = self._held[b] = self._scatter_rows(bucket)
            else:
                self._stamps.write(bucket, self._tail(bucket), self.params, cfg.op)
        # The hooks folded every gradient in already divided by the DP size; from here on
        # .grad is the bucket's view again (reduced once the collective is waited for).
        for i in bucket.params:
            if not self._main[i]:
                self.params[i].grad = self._views[i]
        # Lossy comm: the first iteration also compares sizes and options across the ranks.
        extra = {} if cfg.comm_dtype == "fp32" else dict(
            error_feedback=self._feedback(b, buf.numel()), check_ranks=not self._checked,
            timeout=cfg.timeout, tag=self._tag(bucket))
        try:  # a launch raises when an earlier bucket's exchange found the ranks disagreeing
            with nvtx.range(names.dp_bucket("grads", b)):  # the launch only
                if scatter:
                    self._works[b] = dp_comm.reduce_scatter_async(
                        self._shard_span(bucket), buf.view(-1), group=self.dp_group,
                        comm_dtype=cfg.comm_dtype, **extra)
                else:
                    self._works[b] = dp_comm.all_reduce_async(buf, group=self.dp_group,
                                                              comm_dtype=cfg.comm_dtype, **extra)
        except BaseException as exc:
            self.fail(exc)
            _reraise(self._where(b), exc)
        self._final_at_launch = self._final
        self.stats.launch_times.append(time.perf_counter())
        self.stats.launched_in_backward.append(in_backward)

    def _feedback(self, b: int, numel: int) -> ErrorFeedback | None:
        if not self.config.error_feedback:
            return None
        fb = self._feedbacks.get((b, numel))
        if fb is None:  # (re)created when the layout changes or a bucket switches collective
            fb = self._feedbacks[(b, numel)] = ErrorFeedback(numel, device=self.flat_device)
        return fb

    def _wait_all(self) -> None:
        for b, work in enumerate(self._works):
            if work is not None:
                self._finish(b, work)

    def _finish(self, b: int, work) -> None:
        what = self._where(b)
        try:
            with comm_wait("dp.grads"), nvtx.range(names.dp_bucket("grads", b, wait=True)):
                work.wait(self.config.timeout, group=self.dp_group, what=what)
            if self._stamps is not None:
                self._verify(b)
        except BaseException as exc:
            self.fail(exc)
            _reraise(what, exc)
        self._works[b] = None

    def _release_finished_scatters(self) -> None:
        """Finish the reduce-scatters already complete (a poll, no host sync), so their staged
        send buffers go now rather than at the end of the backward: only the buckets really
        in flight hold one."""
        for b in list(self._held):
            work = self._works[b]
            if work is not None and work.is_completed():
                self._finish(b, work)

    def _scatter_rows(self, bucket: Bucket) -> torch.Tensor:
        """The reduce-scatter's send buffer [dp, m + tail]: row r = shard r of the bucket's
        gradients, then a stamp table with this rank's stamp (the shards stay where they are;
        a flat buffer cannot give every shard a tail without moving the parameters)."""
        n, m = self.dp_size, bucket.padded // self.dp_size
        rows = torch.empty(n, m + bucket.tail, dtype=bucket.dtype, device=self.flat_device)
        rows[:, :m].copy_(self.flat[bucket.dtype].narrow(0, bucket.offset, bucket.padded)
                          .view(n, m))
        self._stamps.write_scatter(bucket, rows[:, m:], self.params, self.config.op)
        return rows

    def _shard_span(self, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced shard of ``bucket`` and its stamp tail: (padded / dp + tail,)."""
        return self._grad_shard[bucket.dtype].narrow(0, self._shard_offset[bucket.index],
                                                      bucket.padded // self.dp_size + bucket.tail)

    def _verify(self, b: int) -> None:
        bucket = self.buckets[b]
        if self._held.pop(b, None) is not None:  # a reduce-scatter
            out, m = self._shard_span(bucket), bucket.padded // self.dp_size
            self._stamps.verify(bucket, out[m:], out[:m])
        else:
            self._stamps.verify(bucket, self._tail(bucket), self.flat[bucket.dtype]
                                .narrow(0, bucket.offset, bucket.padded))

    def _where(self, b: int) -> str:
        return f"GradReducer: {self.place}: bucket {b} of {len(self.buckets)}"

    def _abort_peers(self, exc: BaseException) -> None:
        """A failed bucket fails the reducer: later launches and finishes raise at once. The
        other buckets in flight are dropped (their collectives are abandoned, as a failed
        communicator's; the peers learn of it through those collectives' own failure)."""
        self._works = [None] * len(self._works)
        self._held.clear()
        self._active = False

    def _reset_iteration(self) -> None:
        n = len(self.buckets)
        self._active = False
        self._local = False
        self._forward_seen = False
        self._next = 0
        self._works: list = [None] * n
        self._held: dict[int, torch.Tensor] = {}  # reduce-scatter send buffers in flight
        self._missing = [len(bk.params) for bk in self.buckets]
        self._fired = [False] * len(self.params)
        self._observed: list[int] = []
        self._final_at_launch = self._final

    # ---------------------------------------------------------------- layout

    def _make_layout(self, order: list[int], *, sizes: list[int] | None = None,
                     cap_bytes: int | None = None) -> Layout:
        """The layout of ``order`` in buckets of ``sizes`` parameters, else capped at
        ``cap_bytes`` (default: the configured cap; "auto" starts from DDP's 25 MiB), the first
        bucket at most ``first_bucket_cap_mb`` (and, with ``cap_bytes``, at most that)."""
        cfg = self.config
        first = int(cfg.first_bucket_cap_mb * MiB)
        if cap_bytes is None:
            cap_bytes = int((25.0 if cfg.bucket_cap_mb == "auto" else cfg.bucket_cap_mb) * MiB)
        else:
            first = min(first, cap_bytes)
        dtypes = [cfg.grad_dtype if m else p.dtype for m, p in zip(self._main, self.params)]
        tails = (None if self._stamps is None else
                 {dt: tail_elements(dt, self.dp_size) for dt in set(dtypes)})
        return build_layout(order, self.params, cap_bytes=cap_bytes, bucket_sizes=sizes,
                            first_cap_bytes=first,
                            pad_to=self.dp_size if cfg.shard else 1,
                            dtypes=dtypes, tails=tails)

    def _install(self, layout: Layout, *, copy: bool) -> None:
        cfg = self.config
        device = self.params[0].device
        flat = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in layout.numel.items()}
        views = []
        for i, p in enumerate(self.params):
            dt, off = layout.param_offset[i]
            view = flat[dt].narrow(0, off, p.numel()).view(p.shape)
            if copy:
                view.copy_(self._views[i])
            if self._main[i]:
                p.main_grad = view
            else:
                p.grad = view
            views.append(view)
        self.flat, self._views, self._layout = flat, views, layout
        self._tags: dict[int, int] = {}
        if self._stamps is not None:
            self._stamps.new_layout()
        if cfg.shard:  # per bucket: this rank's shard, then the stamp tail it receives
            ends: dict[torch.dtype, int] = {}
            self._shard_offset = []
            for bk in layout.buckets:
                self._shard_offset.append(ends.get(bk.dtype, 0))
                ends[bk.dtype] = self._shard_offset[-1] + bk.padded // self.dp_size + bk.tail
            self._grad_shard = {dt: torch.zeros(n, dtype=dt, device=device)
                                for dt, n in ends.items()}

    def _rebuild(self) -> None:
        seen = set(self._observed)
        order = self._observed + [i for i in reversed(range(len(self.params))) if i not in seen]
        n = len(order)
        sizes = [0] * n
        auto = self.config.bucket_cap_mb == "auto" and self.dp_size > 1
        if auto:  # collective: every rank times the link; rank 0 plans
            total = sum(self._layout.numel[dt] * dt.itemsize for dt in self._layout.numel)
            alpha, beta = autobucket.measure_link(self.dp_group, self.flat_device,
                                                  min(total, 16 * MiB))
            if self.dp_rank == 0:
                planned = self._plan_buckets(order, alpha, beta)
                sizes = planned + [0] * (n - len(planned))
            self.link = (alpha, beta)
        t = torch.tensor(order + sizes, dtype=torch.int64, device=self.params[0].device)
        # Every rank must bucket identically: DP rank 0's observed order (and plan) wins.
        dist.broadcast(t, src=self._src, group=self.dp_group)
        vals = t.tolist()
        order, sizes = vals[:n], [k for k in vals[n:] if k > 0]
        if auto:
            self._candidates = self._auto_candidates(order, sizes)
            if len(self._candidates) > 1:  # time them; the layout is final after the choice
                self._tuner = autobucket.BucketTuner(len(self._candidates),
                                                     trials=self.config.auto_trials,
                                                     device=self.flat_device)
            else:
                self._final = True
                self.auto_report = self._auto_report([None], chosen=0)
            self._switch_layout(self._candidates[0][1])
        else:
            self._final = True
            if order != self._layout.order:
                self._switch_layout(self._make_layout(order))

    def _switch_layout(self, layout: Layout) -> None:
        """Install ``layout``, carrying every gradient over, and tell the listeners."""
        self._feedbacks.clear()
        old = self._layout
        self._install(layout, copy=True)
        for fn in self._layout_listeners:
            fn(old, self._layout)

    def _auto_candidates(self, order: list[int], planned: list[int]) -> list[tuple[str, Layout]]:
        """The link model's plan first, then fixed caps splitting the gradients into about 1,
        2, 4, 8 and 16 buckets and DDP's 25 MiB; layouts that bucket alike are dropped."""
        first = ("link model", self._make_layout(order, sizes=planned))
        if self.config.auto_trials == 0:
            return [first]
        total = sum(self._layout.numel[dt] * dt.itemsize for dt in self._layout.numel)
        caps = [max(1, -(-total // k)) for k in (1, 2, 4, 8, 16)] + [int(25 * MiB)]
        out, seen = [first], {_bucketing(first[1])}
        for cap in caps:
            source = f"cap {cap / MiB:.3g} MiB" + (" (DDP)" if cap == 25 * MiB else "")
            layout = self._make_layout(order, cap_bytes=cap)
            key = _bucketing(layout)
            if key not in seen:
                seen.add(key)
                out.append((source, layout))
        return out

    def _auto_report(self, seconds: list, *, chosen: int) -> dict:
        return dict(candidates=[dict(source=source, buckets=len(layout.buckets), seconds=t)
                                for (source, layout), t in zip(self._candidates, seconds)],
                    chosen=chosen, frozen=False)

    def _try_candidate(self, k: int) -> None:
        """Tuning: install candidate ``k``, or, after the last one, the fastest (collective)."""
        if k < len(self._candidates):
            self._switch_layout(self._candidates[k][1])
            return
        best = self._tuner.decide(self.dp_group)
        self.auto_report = self._auto_report(self._tuner.seconds, chosen=best)
        if best != len(self._candidates) - 1:
            self._switch_layout(self._candidates[best][1])
        self._tuner, self._candidates = None, []
        self._final = True

    def _plan_buckets(self, order: list[int], alpha: float, beta: float) -> list[int]:
        st = self.stats
        ready = dict(zip(self._observed, st.ready_times))
        t0 = st.ready_times[0] if st.ready_times else 0.0
        end = st.backward_end if st.backward_end is not None else t0
        dtypes = [self._layout.param_offset[i][0] for i in order]
        return autobucket.plan_bucket_sizes(
            [ready.get(i, end) - t0 for i in order],
            [self.params[i].numel() * dt.itemsize for i, dt in zip(order, dtypes)],
            dtypes, alpha, beta)

    def _fill_shards_from_full(self) -> None:
        for bucket in self.buckets:
            off, n = bucket.shard(self.dp_size, self.dp_rank)
            self.grad_shard(bucket).copy_(self.flat[bucket.dtype].narrow(0, off, n))


def _bucketing(layout: Layout) -> tuple:
    return tuple((b.dtype, tuple(b.params)) for b in layout.buckets)


def _fold(view: torch.Tensor, g: torch.Tensor, scale: float | None, *, overwrite: bool) -> None:
    """``view = g * scale`` (overwrite) or ``view += g * scale``; one pass, no temporary."""
    if overwrite:
        if scale is None:
            view.copy_(g)
        else:
            torch.mul(g, scale, out=view)
    elif scale is None:
        view.add_(g)
    else:
        view.add_(g, alpha=scale)
