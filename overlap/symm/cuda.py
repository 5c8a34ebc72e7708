"""CUDA backend of SymmetricWorkspace: GPU userbuffers every rank of a node maps.

Memory: one device allocation per rank, ``[header | flags | data]``, from torch's symmetric
memory where the installed torch has it, else ``cudaMalloc`` shared by CUDA IPC handles (cupy);
``ws.memory`` says which, ``ws.memory_fallback`` why not symmetric memory (ranks sharing a GPU
always take CUDA IPC: torch's symmetric memory refuses two ranks on one device).
Signals are stream-ordered: one-thread kernels from csrc/signal.cu on the current stream. A wait
kernel that times out or sees a peer's ``abort()`` records the error and returns; every fused op
ends with ``poison_if_error`` on its outputs (NaN bytes), and the next op on the workspace calls
``raise_pending``, which raises SignalTimeout/PeerDied naming the op, the slot and the peer.
``check_errors()`` (``barrier()``, ``close()``) synchronises first; ``wait(..., blocking=True)``
synchronises and checks at once. GPU only: its CPU twin is overlap.symm.shm.

The narrative: docs/design/dist.md.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.distributed as dist

from overlap.defaults import align
from overlap.kernels.cuda import launch_kernel
from overlap.symm.base import PeerDied, SignalTimeout, SymmetricWorkspace

__all__ = ["CudaWorkspace", "enable_symm_mem", "SYMMETRIC_MEMORY", "CUDA_IPC", "shared_devices"]

# int64 header words: [0] abort (0 or 1 + aborting rank), [1] barrier counter, [2] closing (1
# once the rank has started to close and reads no peer buffer any more)
_HEADER_BYTES = 128
_W_ABORT, _W_BARRIER, _W_CLOSING, _W_ZERO = 0, 1, 2, 3  # _W_ZERO: never written
_SIGNAL_CU = "signal.cu"
_ERROR_WORDS = 5  # csrc/signal.cuh ErrorWord::kErrWords (overlap._C.ERROR_WORDS)
SYMMETRIC_MEMORY, CUDA_IPC = "symmetric memory", "CUDA IPC"


def enable_symm_mem(symm_mem, group_name: str) -> bool:
    """Register the group with torch symmetric memory where this torch wants it (2.6-2.7 need
    it before ``rendezvous``; newer torch deprecates the call as unneeded, and may remove it).
    Returns whether the call was made."""
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None:
        return False
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if is_enabled is not None and is_enabled(group_name):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "deprecated, no need to call"
        enable(group_name)
    return True


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    key = message.split(":", 1)[-1]  # once per process and reason, not per workspace
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def shared_devices(devices: list[str]) -> list[list[int]]:
    """The groups of ranks (by position) that name the same device, each of >= 2 ranks."""
    by: dict[str, list[int]] = {}
    for r, d in enumerate(devices):
        by.setdefault(d, []).append(r)
    return [ranks for ranks in by.values() if len(ranks) > 1]


class CudaWorkspace(SymmetricWorkspace):
    """SymmetricWorkspace over GPU memory mapped by every rank of the group (one node)."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, *, num_signals: int,
                 timeout: float, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CudaWorkspace: device must be a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        super().__init__(group, nbytes, num_signals=num_signals, timeout=timeout,
                         device=torch.device("cuda", index))
        self._flags_off = _HEADER_BYTES
        self._data_off = align(_HEADER_BYTES + 8 * num_signals)
        self._total = self._data_off + align(nbytes)
        self._closed = False
        self._handle = None          # torch symmetric memory handle
        self._ipc_ptrs: list[int] = []   # peers' pointers opened from IPC handles
        self._own_ptr = 0            # our cudaMalloc when using IPC
        self._barrier_phase = 0
        # {code, slot, last seen, aborting rank + 1, peer} (csrc/signal.cuh ErrorWord): written
        # by wait kernels, read by poison kernels and by the host. Pinned host memory, which
        # kernels address directly (unified addressing), so the host reads it without a sync.
        self._error = torch.zeros(_ERROR_WORDS, dtype=torch.int64).pin_memory()
        self._error_np = self._error.numpy()
        self._check_agreement()
        self._setup_memory()
        self._whole = [self._peer_tensor(r) for r in range(self.world)]
        self._data = [w[self._data_off:self._data_off + nbytes] for w in self._whole]
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)

    def _check_agreement(self) -> None:
        uuid = str(getattr(torch.cuda.get_device_properties(self.device), "uuid", self.device))
        mine = (self.nbytes, self.num_signals, uuid)
        every: list = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        self._sharing = shared_devices([e[2] for e in every])
        for i, key in enumerate(("nbytes", "num_signals")):
            vals = [e[i] for e in every]
            if len(set(vals)) > 1:
                raise ValueError(f"SymmetricWorkspace(cuda) on group {self.group_name} (rank "
                                 f"{self.rank}): ranks disagree on {key}: " +
                                 ", ".join(f"rank {r}={v}" for r, v in enumerate(vals)))

    def _setup_memory(self) -> None:
        """Torch symmetric memory if it works here, else CUDA IPC; ``memory`` says which."""
        self.memory_fallback = ""
        if self._sharing:
            # torch's symmetric memory takes one rank per device; CUDA IPC maps another
            # process's allocation on the same device.
            self.memory_fallback = (f"ranks {self._sharing} share a GPU (ranks per GPU > 1): "
                                    "torch symmetric memory takes one rank per device")
            _warn_once(f"{self!r}: CUDA IPC instead of torch symmetric memory: "
                       f"{self.memory_fallback}")
            self._setup_ipc()
            self.memory = CUDA_IPC
            return
        try:
            self._setup_torch_symm()
            self.memory = SYMMETRIC_MEMORY
        except (ImportError, AttributeError, RuntimeError, NotImplementedError) as exc:
            self._handle = None
            self.memory_fallback = f"{type(exc).__name__}: {exc}"
            self._setup_ipc()
            self.memory = CUDA_IPC

    def _setup_torch_symm(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        name = self.group.group_name
        enable_symm_mem(symm_mem, name)
        local = symm_mem.empty(self._total, dtype=torch.uint8, device=self.device)
        local.zero_()
        torch.cuda.synchronize(self.device)
        self._local = local
        self._handle = symm_mem.rendezvous(local, name)  # a name works on every torch >= 2.6
        self._bases = [int(p) for p in self._handle.buffer_ptrs]

    def __repr__(self) -> str:
        return (f"CudaWorkspace(group={self.group_name}, rank={self.rank}, nbytes={self.nbytes}, "
                f"num_signals={self.num_signals}, memory={getattr(self, 'memory', 'unset')}, "
                f"device={self.device})")

    def _setup_ipc(self) -> None:
        import cupy

        rt = cupy.cuda.runtime
        with cupy.cuda.Device(self.device.index):
            self._own_ptr = rt.malloc(self._total)
            rt.memset(self._own_ptr, 0, self._total)
            handle = rt.ipcGetMemHandle(self._own_ptr)
        handles: list = [None] * self.world
        dist.all_gather_object(handles, bytes(handle), group=self.group)
        bases = []
        with cupy.cuda.Device(self.device.index):
            for r, h in enumerate(handles):
                if r == self.rank:
                    bases.append(self._own_ptr)
                else:
                    ptr = rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
                    self._ipc_ptrs.append(ptr)
                    bases.append(ptr)
        self._bases = bases

    def _peer_tensor(self, r: int) -> torch.Tensor:
        if self._handle is not None:
            return self._handle.get_buffer(r, (self._total,), torch.uint8)
        import cupy

        mem = cupy.cuda.UnownedMemory(self._bases[r], self._total, owner=self)
        arr = cupy.ndarray((self._total,), dtype=cupy.uint8,
                           memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device=self.device)

    # -- memory ---------------------------------------------------------------------------
    def buffer(self, r: int) -> torch.Tensor:
        self._check_open("buffer")
        self._check_rank("buffer", r)
        return self._data[r]

    def data_ptr(self, r: int) -> int:
        self._check_rank("data_ptr", r)
        return self._bases[r] + self._data_off

    def signal_ptr(self, r: int) -> int:
        self._check_rank("signal_ptr", r)
        return self._bases[r] + self._flags_off

    # -- signals (stream-ordered) ---------------------------------------------------------
    def _launch(self, name: str, *args, grid=(1,), block=(1,)) -> None:
        launch_kernel(_SIGNAL_CU, name, grid, block, args, self.device)

    def signal(self, peer: int, slot: int, value: int) -> None:
        self._check_open("signal")
        self._check_slot("signal", slot)
        self._launch("overlap_signal_set", np.uint64(self.signal_ptr(peer) + 8 * slot),
                     np.int64(value))

    def signal_add(self, peer: int, slot: int, value: int = 1) -> None:
        self._check_open("signal_add")
        self._check_slot("signal_add", slot)
        self._launch("overlap_signal_add", np.uint64(self.signal_ptr(peer) + 8 * slot),
                     np.int64(value))

    def _wait_addr(self, addr: int, value: int, timeout: float | None, slot: int,
                   blocking: bool, *, stop_on_abort: bool = True, peer: int = -1) -> None:
        limit = self.timeout if timeout is None else timeout
        # The wait kernel gives up when the abort word becomes non-zero; a wait that must not
        # (the closing barrier) watches a word that is never written instead.
        stop_word = _W_ABORT if stop_on_abort else _W_ZERO
        self._launch("overlap_signal_wait", np.uint64(addr), np.int64(value),
                     np.uint64(int(limit * 1e9)), np.int64(slot),
                     np.uint64(self._bases[self.rank] + 8 * stop_word),
                     np.uint64(self._error.data_ptr()), np.int64(peer))
        if blocking:
            torch.cuda.current_stream(self.device).synchronize()
            self.check_errors()

    def wait(self, slot: int, value: int, timeout: float | None = None, *,
             blocking: bool = False, peer: int | None = None) -> None:
        """Make the current stream wait until flag ``slot`` >= ``value``. Non-blocking for the
        host unless ``blocking``; a timeout or abort poisons the outputs of the op that waited
        (``poison_if_error``) and surfaces at the next ``raise_pending``/``check_errors``."""
        self._check_open("wait")
        self._check_slot("wait", slot)
        self._wait_addr(self.signal_ptr(self.rank) + 8 * slot, value, timeout, slot, blocking,
                        peer=-1 if peer is None else peer)

    def check_errors(self) -> None:
        """Raise the first error a wait kernel recorded (synchronises with the device)."""
        torch.cuda.current_stream(self.device).synchronize()
        self.raise_pending("SymmetricWorkspace.wait")

    def poison_if_error(self, out: torch.Tensor) -> None:
        nbytes = out.numel() * out.element_size()
        if nbytes == 0:
            return
        if not out.is_contiguous():
            raise ValueError("CudaWorkspace.poison_if_error: the output must be contiguous")
        blocks = max(1, min(1024, -(-nbytes // (256 * 16))))
        self._launch("overlap_poison_if_error", np.uint64(self._error.data_ptr()),
                     np.uint64(out.data_ptr()), np.uint64(nbytes), grid=(blocks,), block=(256,))

    def barrier(self, timeout: float | None = None) -> None:
        self._check_open("barrier")
        self._barrier_phase += 1
        for r in range(self.world):
            self._launch("overlap_signal_add", np.uint64(self._bases[r] + 8 * _W_BARRIER),
                         np.int64(1))
        self._wait_addr(self._bases[self.rank] + 8 * _W_BARRIER,
                        self._barrier_phase * self.world, timeout, -1, blocking=True)

    def abort(self, reason: str = "") -> None:
        if self._closed:
            return
        for r in range(self.world):
            self._launch("overlap_signal_set", np.uint64(self._bases[r] + 8 * _W_ABORT),
                         np.int64(self.rank + 1))
        torch.cuda.current_stream(self.device).synchronize()

    # -- teardown -------------------------------------------------------------------------
    def close(self, *, wait_for_peers: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            return
        if wait_for_peers and self.world > 1 and self._bases:
            # Free only once every peer has started to close (reads no buffer of ours any
            # more): mark ours, then wait on each peer's mark (bounded; a peer that never
            # comes, dead or stuck, ends the wait at the timeout).
            self._launch("overlap_signal_set", np.uint64(self._bases[self.rank] + 8 * _W_CLOSING),
                         np.int64(1))
            limit = self.timeout if timeout is None else timeout
            for r in range(self.world):
                if r == self.rank:
                    continue
                try:
                    self._wait_addr(self._bases[r] + 8 * _W_CLOSING, 1, limit, -1, blocking=True,
                                    stop_on_abort=False)
                except (PeerDied, SignalTimeout):
                    pass
        self._closed = True
        self._forget_views()
        torch.cuda.synchronize(self.device)
        self._whole, self._data = [], []
        self._handle = None
        if self._ipc_ptrs or self._own_ptr:
            import cupy

            rt = cupy.cuda.runtime
            with cupy.cuda.Device(self.device.index):
                for p in self._ipc_ptrs:
                    rt.ipcCloseMemHandle(p)
                if self._own_ptr:
                    rt.free(self._own_ptr)
            self._ipc_ptrs, self._own_ptr = [], 0
        self.check_errors()
