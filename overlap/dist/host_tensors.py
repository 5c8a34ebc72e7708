"""Host tensors on the CPU twin, so that ``nccl_twin`` refuses them as NCCL refuses CPU tensors
(``No backend type associated with device type cpu``); on the twin every tensor is a CPU tensor.

A ``HostTensor`` is what overlap's own code (the caller's module is ``overlap.*``) makes from
host data without an explicit device (``torch.tensor``, ``as_tensor`` of non-tensors,
``from_numpy``, ``frombuffer``), with ``device="cpu"`` or ``pin_memory=True``, or by ``.cpu()``.
User and test code, and other factories (``torch.zeros(n)`` follows the default device, as a
module's parameters do), make plain tensors: they stand for device memory. An op on host tensors
only gives a host tensor; with a device tensor, or ``.to(<device or tensor>)``, a plain one.
Pickled as a plain tensor. ``install()`` (called by ``nccl_twin.register``: twin ranks only)
patches the factories; ``STRICT = False`` switches the twin's refusal off (tests).
The narrative: docs/design/dist.md.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["HostTensor", "install", "is_host", "as_host", "made_at", "STRICT"]

# nccl_twin refuses host tensors while this is True (tests switch it off to show the rule is
# what catches them).
STRICT = True

_FROM_DATA = ("tensor", "as_tensor", "from_numpy", "frombuffer", "scalar_tensor")
_FACTORIES = ("zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "linspace", "eye", "zeros_like", "ones_like", "empty_like", "full_like")
_installed = False
_sites: dict[int, str] = {}  # id of a marked tensor object -> where it was made (bounded)
_MAX_SITES = 4096


class HostTensor(torch.Tensor):
    """A CPU tensor that stands for host memory on a GPU (module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _TO_DEVICE and _names_a_device(func, args, kwargs):
            return _plain(out)
        if func in _NO_WRAP or not _all_host(args, kwargs):
            return _plain(out)
        return _mark(out)

    def __reduce_ex__(self, protocol):
        return torch.Tensor.as_subclass(self, torch.Tensor).__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents=None) -> str:
        return "host:" + torch.Tensor.as_subclass(self, torch.Tensor).__repr__()


_TO_DEVICE = {torch.Tensor.to, torch.Tensor.cuda}
# What never yields a host tensor, whatever it reads.
_NO_WRAP = {torch.Tensor.__setitem__, torch.Tensor.copy_}


def _names_a_device(func, args, kwargs) -> bool:
    if func is torch.Tensor.cuda or kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])


def _all_host(args, kwargs) -> bool:
    """No argument is a plain (device) tensor; 0-dim host tensors are scalars to CUDA too."""
    seen = False
    for a in _flat(args, kwargs):
        if isinstance(a, HostTensor):
            seen = True
        elif isinstance(a, torch.Tensor):
            return False
    return seen


def _flat(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _plain(out):
    if isinstance(out, HostTensor):
        return torch.Tensor.as_subclass(out, torch.Tensor)
    if isinstance(out, (list, tuple)) and any(isinstance(o, HostTensor) for o in out):
        return type(out)(_plain(o) for o in out) if type(out) in (list, tuple) else out
    return out


def _mark(out):
    if isinstance(out, torch.Tensor) and not isinstance(out, HostTensor):
        if out.device.type != "cpu" or isinstance(out, torch.nn.Parameter):
            return out
        return out.as_subclass(HostTensor)
    if type(out) in (list, tuple):
        return type(out)(_mark(o) for o in out)
    return out


def is_host(t) -> bool:
    """Whether ``t`` stands for host memory (module docstring)."""
    return isinstance(t, HostTensor)


def as_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked as host memory (what overlap's code gets from ``torch.tensor(data)``)."""
    return t.as_subclass(HostTensor)


def made_at(t) -> str | None:
    """Where overlap's code made host tensor ``t`` ("file:line"), if it was made directly."""
    return _sites.get(id(t))


# The twin's own machinery: its gloo traffic is not a collective of the group it stands for.
_NOT_MARKED = (__name__, "overlap.dist.nccl_twin")


def _caller_is_overlap(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name.startswith("overlap.") and name not in _NOT_MARKED


def _remember(t: torch.Tensor, frame) -> torch.Tensor:
    if len(_sites) >= _MAX_SITES:
        _sites.clear()
    _sites[id(t)] = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    return t


def _host_device(kwargs) -> bool:
    """The call asks for host memory: ``device="cpu"`` (a literal; a ``torch.device`` may be
    the rank's device, which is the CPU here) or pinned memory."""
    device = kwargs.get("device")
    return (isinstance(device, str) and device.split(":")[0] == "cpu") or bool(
        kwargs.get("pin_memory"))


def _holds_tensor(args) -> bool:
    data = args[0] if args else None
    if isinstance(data, (list, tuple)) and data:
        data = data[0]
    return isinstance(data, torch.Tensor)


def _wrap_from_data(fn):
    def factory(*args, **kwargs):
        out = fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            return out
        frame = sys._getframe(1)
        if not _caller_is_overlap(frame) or isinstance(out, HostTensor) or _holds_tensor(args):
            return out  # torch.as_tensor(t) is t, on its device
        if kwargs.get("device") is not None and not _host_device(kwargs):
            return out
        return _remember(_mark(out), frame)

    factory.__wrapped__ = fn
    factory.__name__ = fn.__name__
    factory.__doc__ = fn.__doc__
    return factory


def _wrap_factory(fn):
    def factory(*args, **kwargs):
        out = fn(*args, **kwargs)
        if not _host_device(kwargs) or torch.compiler.is_compiling():
            return out
        frame = sys._getframe(1)
        return _remember(_mark(out), frame) if _caller_is_overlap(frame) else out

    factory.__wrapped__ = fn
    factory.__name__ = fn.__name__
    factory.__doc__ = fn.__doc__
    return factory


def _wrap_cpu(fn):
    def cpu(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            return out
        frame = sys._getframe(1)
        return _remember(_mark(out), frame) if _caller_is_overlap(frame) else out

    cpu.__wrapped__ = fn
    cpu.__name__ = "cpu"
    return cpu


def install() -> None:
    """Mark the host tensors overlap's code makes in this process (idempotent)."""
    global _installed
    if _installed:
        return
    for name in _FROM_DATA:
        if hasattr(torch, name):
            setattr(torch, name, _wrap_from_data(getattr(torch, name)))
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))
    torch.Tensor.cpu = _wrap_cpu(torch.Tensor.cpu)
    _installed = True
