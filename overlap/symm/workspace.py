"""SymmetricWorkspace: the userbuffer transport every fused op uses.

For a group of ``world`` ranks, every rank owns a buffer of the same size plus an array of int64
signal flags, and reads and writes every peer's buffer directly as a tensor::

    segment of rank r = | header | flags[S] | data[nbytes] |        S = num_signals
    every rank maps every segment: ws.buffer(r), ws.view(r, dtype, shape, off)

Flags are monotonic phase counters, never reset: ``signal(peer, slot, phase)`` (release) after
the payload, ``wait(slot, phase)`` (acquire) until its own flag is >= phase. ``wait`` raises
:class:`SignalTimeout` after ``timeout`` seconds and :class:`PeerDied` once a peer has exited
or called ``abort()``. Kinds (``kind=``): ``shm`` (CPU, one host; overlap.symm.shm) and ``cuda``
(overlap.symm.cuda); ``create_workspace`` picks one.

The narrative: docs/design/dist.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.symm.base import PeerDied, SignalTimeout, SymmetricWorkspace, group_name
from overlap.defaults import TIMEOUT_S, positive_int, positive_seconds

__all__ = ["SymmetricWorkspace", "SignalTimeout", "PeerDied", "create_workspace", "group_name"]


def create_workspace(group: dist.ProcessGroup, nbytes: int, *, num_signals: int = 64,
                     device: torch.device | str | None = None, timeout: float = TIMEOUT_S,
                     kind: str = "auto") -> SymmetricWorkspace:
    """Create a workspace of ``nbytes`` per rank over ``group`` (collective over the group).

    ``kind``: "shm" (CPU shared memory), "cuda" (GPU userbuffers) or "auto" (cuda when
    ``device`` is a CUDA device, else shm). Every rank must pass the same nbytes and num_signals;
    a mismatch raises ValueError on every rank naming the ranks that differ.
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"create_workspace: group must be a ProcessGroup, got {type(group).__name__}")
    where = f" (rank {dist.get_rank(group)})"
    positive_int(nbytes, "create_workspace: nbytes", where=where)
    positive_int(num_signals, "create_workspace: num_signals", where=where)
    positive_seconds(timeout, "create_workspace: timeout", where=where)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if kind == "auto":
        kind = "cuda" if dev.type == "cuda" else "shm"
    if kind == "shm":
        if dev.type != "cpu":
            raise ValueError(f"create_workspace: kind 'shm' holds CPU memory, got device {dev}")
        from overlap.symm.shm import ShmWorkspace

        return ShmWorkspace(group, nbytes, num_signals=num_signals, timeout=timeout)
    if kind == "cuda":
        from overlap.symm.cuda import CudaWorkspace

        return CudaWorkspace(group, nbytes, num_signals=num_signals, timeout=timeout, device=dev)
    raise ValueError(f"create_workspace: kind must be 'auto', 'shm' or 'cuda', got {kind!r}")
