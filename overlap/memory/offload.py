"""Activation offloading: tensors saved for the backward go to host memory on a side stream and
come back on another one ahead of their use.

``ActivationOffloader(device).wrap(layers, keep_last=N)``: every call of a wrapped layer is a
group; what autograd saves inside it is copied to a reused (pinned on CUDA) host buffer on the
``d2h`` stream right after it is saved, and the device tensor is released once that copy ran
(``enqueue_copy`` keeps it: ``record_stream``). When a group's backward starts (the gradient of
its output arrives), the reload of the previous layer's group starts on the ``h2d`` stream,
ordered after the compute stream's work so far (its buffer is allocated there, and the caching
allocator may reuse memory that work still reads); a saved tensor is used only after its
reload's event (a device-side wait, never the host). The last ``keep_last`` layers keep their
tensors on the device. Works per thread and per call, so several micro-batches in flight,
recomputation (checkpoint inputs are offloaded, the recomputed tensors are not) and split
backward passes hold. Rules and twin: docs/memory.md.
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterable

import torch
import torch.nn as nn

from torch.multiprocessing.reductions import StorageWeakRef

from overlap.defaults import TIMEOUT_S, positive_seconds
from overlap.dist.streams import Event, Stream, device_empty
from overlap.profile.timers import comm_wait

__all__ = ["ActivationOffloader", "OffloadStats"]

MIN_BYTES = 1024  # smaller saved tensors stay on the device: a copy costs more than it frees


class OffloadStats:
    """Counters of one offloader (host-side bookkeeping, no device sync): offloaded and
    reloaded bytes and storages, saved tensors kept on the device, and the bytes of reloads
    held on the device now and at their peak."""

    def __init__(self) -> None:
        self.offloaded_bytes = self.reloaded_bytes = 0
        self.offloaded = self.reloaded = self.kept = 0
        self.resident_bytes = self.peak_resident_bytes = 0

    def hold(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def drop(self, nbytes: int) -> None:
        self.resident_bytes -= nbytes

    def as_dict(self) -> dict:
        return dict(vars(self))


class _HostPool:
    """Host buffers by size; a buffer is handed out again only once the event of its last
    use (the reload's copy, or the offload's if never reloaded) has run."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: dict[int, list[tuple[torch.Tensor, Event]]] = {}
        self.allocated_bytes = 0
        self.lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            entries = self.free.get(nbytes, [])
            for i, (buf, after) in enumerate(entries):
                if after.query():
                    del entries[i]
                    return buf
            self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def put(self, buf: torch.Tensor, after: Event) -> None:
        with self.lock:
            self.free.setdefault(buf.numel(), []).append((buf, after))


class _Copy:
    """One offloaded device storage: its host copy, the events of both copies and, once
    reloaded, the device storage (kept for a second unpack: the zero-bubble weight pass).
    Whole storages move, so every saved view of one comes back with its own strides, offset
    and aliasing: the backward computes on the same memory layout (bit for bit)."""

    __slots__ = ("owner", "device", "nbytes", "host", "offloaded", "reload", "loaded",
                 "released")

    def __init__(self, owner: "ActivationOffloader", device: torch.device, nbytes: int,
                 host: torch.Tensor, offloaded: Event):
        self.owner, self.device, self.nbytes = owner, device, nbytes
        self.host, self.offloaded = host, offloaded
        self.reload: Event | None = None
        self.loaded: torch.Tensor | None = None  # uint8, the storage's bytes
        self.released = False

    def start_reload(self) -> None:
        if self.reload is not None or self.released:
            return
        o = self.owner
        self.loaded = device_empty((self.nbytes,), dtype=torch.uint8, device=self.device)
        o.h2d.wait_event(self.offloaded)  # never before its copy to host has run
        if o._order_reload:
            # The allocator may have given `loaded` memory the compute stream freed while its
            # queued kernels (the backward so far) still read it: write it only after them.
            o.h2d.wait_current()
        o.h2d.enqueue_copy(self.loaded, self.host[:self.nbytes], name="offload.h2d.comm")
        self.reload = o.h2d.record_event()
        o.stats.reloaded += 1
        o.stats.reloaded_bytes += self.nbytes
        o.stats.hold(self.nbytes)

    def release(self) -> None:
        """The host buffer goes back to the pool after its last copy; the reloaded device
        storage is dropped."""
        self.released = True
        o = self.owner
        o.pool.put(self.host, self.reload or self.offloaded)
        if self.loaded is not None:
            o.stats.drop(self.nbytes)
            self.loaded = None


class _CopyRef:
    """Shared by the handles of one storage's saved views; its death releases the copy."""

    __slots__ = ("copy", "__weakref__")

    def __init__(self, copy: _Copy):
        self.copy = copy
        weakref.finalize(self, _Copy.release, copy)


class _Saved:
    """What autograd holds for one offloaded saved tensor: its storage's copy, its view, and
    its version as saved with a storage-less alias that shares its version counter (autograd's
    own check runs on the tensor it keeps, here a handle, so this one stands in for it)."""

    __slots__ = ("ref", "dtype", "shape", "stride", "offset", "version", "counter", "producer")

    def __init__(self, ref: _CopyRef, t: torch.Tensor):
        self.ref = ref
        self.dtype, self.shape, self.stride = t.dtype, t.shape, t.stride()
        self.offset = t.storage_offset()
        self.version = t._version
        # detach() shares t's version counter; replacing its data keeps the counter and lets
        # the storage go (0 bytes), so every later in-place write to t or an alias shows here.
        self.counter = t.detach()
        self.counter.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.producer = type(t.grad_fn).__name__ if t.grad_fn is not None else None

    def check_version(self) -> None:
        now = self.counter._version
        if now != self.version:
            made = f", which is output of {self.producer}," if self.producer else ""
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.dtype} {list(self.shape)}]{made} is at version "
                f"{now}; expected version {self.version} instead (seen by "
                "overlap.memory.ActivationOffloader when it reloaded the offloaded copy: the "
                "backward would have used the values from before the change)")

    def view(self) -> torch.Tensor:
        loaded = self.ref.copy.loaded
        return torch.empty(0, dtype=self.dtype, device=loaded.device).set_(
            loaded.untyped_storage(), self.offset, self.shape, self.stride)


class _Group:
    """The tensors one call of one wrapped layer saved, and the previous layer's group of the
    same forward (the one to reload when this one's backward starts)."""

    __slots__ = ("index", "copies", "prev", "offload")

    def __init__(self, index: int, offload: bool, prev: "_Group | None"):
        self.index, self.offload, self.prev = index, offload, prev
        # device storage address -> (its weak reference, a weak reference to its copy)
        self.copies: dict[int, tuple[object, weakref.ref]] = {}

    def copy_of(self, storage) -> "_CopyRef | None":
        """The copy this group made of ``storage`` (alive: an address reused by another
        storage does not match)."""
        entry = self.copies.get(storage.data_ptr())
        if entry is None or entry[0].expired():
            return None
        return entry[1]()

    def prefetch(self) -> None:
        for _weak, ref in list(self.copies.values()):
            handle = ref()
            if handle is not None:
                handle.copy.start_reload()


class ActivationOffloader:
    """Offloads what wrapped layers save (module docstring). ``device``: where activations
    live (tensors elsewhere are left alone); ``min_bytes``: smaller saved tensors stay;
    ``timeout``: bound of every wait for a copy. ``close()`` stops the streams."""

    def __init__(self, device: torch.device | str, *, min_bytes: int = MIN_BYTES,
                 timeout: float = TIMEOUT_S, census: bool = False):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.min_bytes = int(min_bytes)
        self.timeout = positive_seconds(timeout, "ActivationOffloader: timeout")
        self.d2h = Stream(self.device, name="offload-d2h")
        self.h2d = Stream(self.device, name="offload-h2d")
        self.pool = _HostPool(pin=self.device.type == "cuda")
        self.stats = OffloadStats()
        self._local = threading.local()
        self._wrapped: list[nn.Module] = []
        self._weights: set[int] = set()
        # census=True: every device storage a wrapped layer saved, by a weak reference, so
        # resident_saved_bytes() measures what is still allocated (tests and the benchmark)
        self._census: dict[int, tuple[object, int]] | None = {} if census else None
        self._census_limit = 4096
        # The three rules; only tests switch them off, to show the twins catch the breach.
        self._keep_source = True   # the device tensor outlives its copy to host
        self._wait_reload = True   # a reloaded tensor is used after its copy's event
        self._order_reload = True  # a reload is written after the compute stream's earlier work

    # -- wrapping
    def wrap(self, layers: Iterable[nn.Module], *, keep_last: int = 0) -> int:
        """Wrap ``layers`` (in forward order, e.g. a pipeline chunk's blocks): all but the last
        ``keep_last`` offload. Returns how many offload."""
        layers = list(layers)
        if not layers:
            raise ValueError("ActivationOffloader.wrap: no layers given")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
            raise ValueError(f"ActivationOffloader.wrap: keep_last must be an int >= 0, got "
                             f"{keep_last!r}")
        for m in layers:
            if not isinstance(m, nn.Module):
                raise TypeError(f"ActivationOffloader.wrap: expected nn.Modules, got "
                                f"{type(m).__name__}")
            if "_overlap_offload" in m.__dict__:
                raise ValueError(f"ActivationOffloader.wrap: {type(m).__name__} is wrapped "
                                 "already")
        # weights (and views of them, e.g. the transposed matrix a linear saves) stay
        self._weights |= {p.untyped_storage().data_ptr() for m in layers
                          for p in m.parameters()}
        chain = object()  # links groups of these layers only
        n_off = max(0, len(layers) - keep_last)
        for i, m in enumerate(layers):
            self._wrap_one(m, chain, i, offload=i < n_off)
            self._wrapped.append(m)
        return n_off

    def _wrap_one(self, module: nn.Module, chain: object, index: int, offload: bool) -> None:
        inner = module.forward
        me = self

        def forward(*args, **kwargs):
            last = getattr(me._local, "last", None)  # (chain, group) of this thread's last call
            prev = last[1] if last and last[0] is chain and last[1].index == index - 1 else None
            group = _Group(index, offload, prev)
            outer = getattr(me._local, "group", None)
            me._local.group = group
            try:
                with torch.autograd.graph.saved_tensors_hooks(me._pack, me._unpack):
                    out = inner(*args, **kwargs)
            finally:
                me._local.group = outer
            me._local.last = (chain, group)
            first = out if isinstance(out, torch.Tensor) else next(
                (o for o in (out if isinstance(out, (tuple, list)) else ())
                 if isinstance(o, torch.Tensor)), None)
            if first is not None and first.requires_grad:
                # this layer's backward is next: its own tensors, and the layer before it
                first.register_hook(_Prefetch(group))
            return out

        module.__dict__["_overlap_offload"] = (self, inner)
        module.forward = forward

    def unwrap(self) -> None:
        for m in self._wrapped:
            _owner, inner = m.__dict__.pop("_overlap_offload")
            m.forward = inner
            if m.__dict__.get("forward") is inner:
                del m.__dict__["forward"]  # the class's own forward again
        self._wrapped.clear()

    def resident_saved_bytes(self) -> int:
        """With ``census=True``: bytes of the distinct device storages that wrapped layers saved
        for the backward and that are still allocated (kept, not yet released after their
        copy, or held elsewhere too). Reloads are counted apart (``stats``)."""
        if self._census is None:
            raise RuntimeError("ActivationOffloader.resident_saved_bytes needs census=True")
        self._prune_census()
        return sum(n for _ref, n in self._census.values())

    def _prune_census(self) -> None:
        """Forget freed storages (the census would otherwise grow by every step's saves)."""
        self._census = {k: v for k, v in self._census.items() if not v[0].expired()}
        self._census_limit = max(4096, 2 * len(self._census))

    # -- the hooks
    def _pack(self, t: torch.Tensor):
        group = getattr(self._local, "group", None)
        nbytes = t.numel() * t.element_size()
        if group is None or t.device != self.device or _is_weight(t, self._weights):
            return t
        if self._census is not None:
            st = t.untyped_storage()
            self._census[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            if len(self._census) > self._census_limit:
                self._prune_census()
        if nbytes < self.min_bytes or t.layout != torch.strided:
            return t
        if not group.offload:
            self.stats.kept += 1
            return t
        st = t.untyped_storage()
        ref = group.copy_of(st)
        if ref is None:  # the first saved view of this storage in the group: copy it all
            nbytes = st.nbytes()
            host = self.pool.get(nbytes)
            self.d2h.wait_current()  # after the work that produced t
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
            self.d2h.enqueue_copy(host[:nbytes], src, keep_src=self._keep_source,
                                  name="offload.d2h.comm")
            del src
            ref = _CopyRef(_Copy(self, t.device, nbytes, host, self.d2h.record_event()))
            group.copies[st.data_ptr()] = (StorageWeakRef(st), weakref.ref(ref))
            self.stats.offloaded += 1
            self.stats.offloaded_bytes += nbytes
        return _Saved(ref, t)

    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        packed.check_version()
        copy = packed.ref.copy
        copy.start_reload()  # no-op when prefetched
        if self._wait_reload and not copy.reload.query():
            with comm_wait("offload.reload"):  # exposed: the reload did not hide
                copy.reload.wait(self.timeout, what="activation reload")
        return packed.view()

    def close(self) -> None:
        self.unwrap()
        for s in (self.d2h, self.h2d):
            s.close(self.timeout)


def _is_weight(t: torch.Tensor, weights: set[int]) -> bool:
    """A parameter, a view of one, or memory of the wrapped layers' parameters."""
    if isinstance(t, nn.Parameter):
        return True
    base = t._base if t._is_view() else t
    if base.requires_grad and base.grad_fn is None:
        return True
    return t.untyped_storage().data_ptr() in weights


class _Prefetch:
    """A gradient hook on a group's output: this layer's backward starts now."""

    __slots__ = ("group",)

    def __init__(self, group: _Group):
        self.group = group

    def __call__(self, grad):
        g = self.group
        g.prefetch()
        if g.prev is not None:
            g.prev.prefetch()
        return None
