"""What the fused TP GEMM kernels (all_gather_matmul.py, matmul_reduce_scatter.py) share:
bounded signal waits, the status word, "last program" arrival, bf16 rounding, per-workspace
phase bookkeeping, blocks.

Signals are int64 phase counters in a SymmetricWorkspace, each with exactly one writer (a
release store at system scope, ``store_release``); readers spin with acquire loads
(``load_acquire``) until the flag is >= the phase they need. A wait gives up after ``timeout``
seconds (GPU: %globaltimer; interpreter: a spin count, ``timeout * INTERP_SPINS_PER_S``) and
records (slot + 1, last seen, wanted) in the op's status word; later waits of the op give up at
once, and the host raises TimeoutError after the kernels.
The narrative: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Callable

import torch
import triton
import triton.language as tl

from overlap.defaults import ALIGN, align, positive_int
from overlap.kernels.triton import INTERPRET

__all__ = ["INTERPRET", "INTERP_SPINS_PER_S", "load_acquire", "load_relaxed", "store_release",
           "spin_wait", "publish", "arrive_last",
           "to_out_dtype", "align", "half_buffer", "GemmBlocks", "gemm_blocks", "gemm_arch",
           "gemm_tiles", "GEMM_TILES", "GEMM_SHARED_LIMIT", "begin_call",
           "OpState", "wait_budget", "raise_on_status", "new_status", "finish_call",
           "check_pending", "check_dtypes", "check_workspace", "Watchdog"]

INTERP_SPINS_PER_S = 3000


def check_operands(op: str, ws, x_name: str, x: torch.Tensor, w: torch.Tensor,
                   rows_label: str) -> tuple[int, int, int]:
    """Both GEMM operands 2-D, inner dims equal, nothing empty; returns (rows, K, N).
    ``rows_label`` names x's rows in messages ("m" for a shard, "M" for the full input)."""
    for name, t in ((x_name, x), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{op}: {name} must be a 2-D tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)} (rank {ws.rank})")
    rows, k = x.shape
    k_w, n = w.shape
    if k != k_w:
        raise ValueError(f"{op}: {x_name} is [{rows_label}={rows}, K={k}] but w is [{k_w}, {n}]; "
                         f"w must be [K={k}, N] (rank {ws.rank})")
    if min(rows, k, n) <= 0:
        raise ValueError(f"{op}: empty problem {rows_label}={rows}, K={k}, N={n} "
                         f"(rank {ws.rank})")
    return rows, k, n


def half_buffer(ws) -> int:
    """Byte offset of buffer 1. It depends only on the workspace, never on the call's shape:
    calls of different shapes on one workspace alternate buffers, and a shape-dependent offset
    would let buffer 1 of a small call overlap buffer 0 of a big one that a peer still reads."""
    return ws.nbytes // 2 // ALIGN * ALIGN


# -- device functions -----------------------------------------------------------------------
@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


# The ordering primitives. tl.atomic_load/atomic_store exist only from Triton 3.9; atomics with
# sem/scope exist in every supported Triton (3.4 on). Triton lowers an atomic add of 0 to a
# plain load of that ordering (ld.global.sys.acquire: tests/test_tp_triton.py reads the PTX);
# and as an add it would still never undo the flag writer's store. Under the interpreter both
# are std::atomic operations on the shared-memory word, atomic across processes too.
# docs/design/kernels.md.
@triton.jit
def load_acquire(ptr):
    """*ptr, acquire at system scope: later loads see what the writer released before it."""
    return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def load_relaxed(ptr):
    """*ptr, atomically, no ordering (status words: only their own value matters)."""
    return tl.atomic_add(ptr, 0, sem="relaxed", scope="sys")


@triton.jit
def store_release(ptr, value):
    """*ptr = value, release at system scope: the thread's earlier writes are visible first."""
    tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def spin_wait(flag_ptr, want, slot, status_ptr, max_spins, timeout_ns, USE_CLOCK: tl.constexpr):
    """Wait until *flag_ptr >= want; 1 if it got there, 0 if it gave up: on its own timeout, on
    an earlier failed wait of the call (status word 0), or on the host watchdog's verdict
    (status word 3, re-read on every spin: a dead peer or the wall-clock timeout). A wait whose
    flag is already there never fails, so a peer that exits after its part is no error."""
    want = tl.cast(want, tl.int64)
    failure = load_relaxed(status_ptr)
    verdict = load_relaxed(status_ptr + 3)
    seen = load_acquire(flag_ptr)
    live = (seen < want) & (failure == 0) & (verdict == 0)
    spins = 0
    if USE_CLOCK:
        t0 = _now_ns()
    while live:
        seen = load_acquire(flag_ptr)
        failure = load_relaxed(status_ptr)
        verdict = load_relaxed(status_ptr + 3)
        spins += 1
        if USE_CLOCK:
            live = (seen < want) & ((_now_ns() - t0) <= timeout_ns)
        else:
            live = (seen < want) & (spins < max_spins)
        live = live & (failure == 0) & (verdict == 0)
    if (seen < want) & (failure == 0):
        # The first failure to claim word 4 reports (code, seen, want); the others' details
        # are dropped. A claim by add, not a compare-and-swap of word 0: Triton 3.4 miscompiles
        # a 64-bit scalar atomic_cas (ptxas: "Arguments mismatch for instruction 'st'").
        # A wall-clock timeout is this slot's timeout; a dead peer keeps the watchdog's code.
        code = tl.where(verdict < -1, verdict, tl.cast(slot, tl.int64) + 1)
        if tl.atomic_add(status_ptr + 4, 1, sem="relaxed", scope="sys") == 0:
            tl.atomic_xchg(status_ptr, code, sem="relaxed", scope="sys")
            tl.store(status_ptr + 1, seen)
            tl.store(status_ptr + 2, want)
    # The whole program waits for the one thread that acquired (CUTLASS wait_eq + syncthreads).
    tl.debug_barrier()
    return (seen >= want) & (failure == 0)


@triton.jit
def publish(flag_ptr, value):
    """Release-store value into a (peer's) flag after this program's earlier memory operations."""
    tl.debug_barrier()
    store_release(flag_ptr, tl.cast(value, tl.int64))


@triton.jit
def arrive_last(counter_ptr, total):
    """Count this program in; True for the one program that arrives last of ``total``."""
    tl.debug_barrier()
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    return old == total - 1


@triton.jit
def to_out_dtype(x, OUT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 -> OUT with round-to-nearest-even. The interpreter's fp32 -> bf16 cast truncates,
    so under it (SOFT_BF16) bf16 is rounded by bit arithmetic: the same bits the GPU's cvt.rn
    produces for finite values and infinities; NaN stays a (quiet) NaN."""
    if SOFT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(OUT)


# -- host side ------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True, slots=True)
class GemmBlocks:
    """Tile sizes and launch options of one GEMM launch."""

    bm: int
    bn: int
    bk: int
    copy_block: int
    num_warps: int
    num_stages: int


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(1, n))))


def _tile(bm: int, bn: int, bk: int, num_warps: int, num_stages: int) -> GemmBlocks:
    return GemmBlocks(bm=bm, bn=bn, bk=bk, copy_block=4096, num_warps=num_warps,
                      num_stages=num_stages)


# Per compute capability: the SMs of its flagship part and, per operand width, tiles from large
# to small. 16-bit: Triton's matmul tutorials (03, 09-persistent) on Hopper, 128x256x64 / 8 warps
# / 3 stages; on Ampere 128x128x32 / 4 warps / 4 stages. fp32 (IEEE, FMA) needs half the K.
# Shared memory, (bm*bk + bk*bn) * bytes * stages, stays under the arch's per-block limit
# (GEMM_SHARED_LIMIT; compile_check checks what Triton allocates). The default serves every
# other GPU at the 99 KB of sm_86/sm_89.
GEMM_TILES = {
    90: (132, {2: (_tile(128, 256, 64, 8, 3), _tile(128, 128, 64, 8, 4), _tile(64, 128, 64, 4, 4)),
               4: (_tile(128, 128, 32, 8, 3), _tile(64, 64, 32, 4, 3))}),
    80: (108, {2: (_tile(128, 128, 32, 4, 4), _tile(64, 128, 32, 4, 4)),
               4: (_tile(128, 128, 32, 8, 3), _tile(64, 64, 32, 4, 3))}),
    None: (64, {2: (_tile(128, 128, 32, 4, 3), _tile(64, 64, 32, 4, 3)),
                4: (_tile(128, 64, 32, 4, 2), _tile(64, 64, 32, 4, 2))}),
}
GEMM_SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024, None: 99 * 1024}


def gemm_arch(device: torch.device) -> int | None:
    """The GEMM_TILES key of a CUDA device: its compute capability as 80 / 90, None for others."""
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor if major * 10 + minor in GEMM_TILES else None


def gemm_tiles(arch: int | None, dtype: torch.dtype) -> tuple[GemmBlocks, ...]:
    """Every tile gemm_blocks may pick (before shrinking to the problem) for ``arch``."""
    return GEMM_TILES[arch if arch in GEMM_TILES else None][1][dtype.itemsize]


def gemm_blocks(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                arch: int | None = None) -> GemmBlocks:
    """Small tiles under the interpreter (its cost is per op, but the tests must cross tile and
    mask edges). On a GPU (``arch``: its compute capability as 80 / 90, read from ``device``
    when not given): the largest GEMM_TILES row whose tiles still fill every SM once, shrunk to
    the problem's size."""
    if device.type != "cuda":
        return GemmBlocks(bm=16, bn=32, bk=32, copy_block=2048, num_warps=1, num_stages=1)
    if arch is None:
        arch = gemm_arch(device)
    sms = GEMM_TILES[arch if arch in GEMM_TILES else None][0]
    rows = gemm_tiles(arch, dtype)
    t = next((t for t in rows if triton.cdiv(m, t.bm) * triton.cdiv(n, t.bn) >= sms), rows[-1])
    return dataclasses.replace(t, bm=_pow2_clamp(m, 16, t.bm), bn=_pow2_clamp(n, 16, t.bn),
                               bk=_pow2_clamp(k, 16, t.bk))


def wait_budget(timeout: float) -> tuple[int, int]:
    """(max_spins for the interpreter, timeout_ns for the GPU clock) of one bounded wait.
    Under the interpreter the Watchdog bounds waits by wall time; the spin count is only a
    backstop, at 4x the timeout."""
    return max(1, math.ceil(4 * timeout * INTERP_SPINS_PER_S)), max(1, int(timeout * 1e9))


WATCHDOG_POLL_S = 0.02
_TIMED_OUT = -1  # status codes the watchdog writes; <= -2: -(2 + peer) for a dead peer


class Watchdog:
    """While one call's kernels run under the interpreter (synchronously, in this thread), a
    host thread checks every ``WATCHDOG_POLL_S`` the wall time against ``timeout`` and the
    peers' liveness and abort flags (``ws.peer_problem()``), and writes a verdict into the
    call's status word 3; ``spin_wait`` re-reads it on every spin, so a wait stuck on a dead or
    aborted peer stops within a poll period and a stall at the timeout in wall time.
    On a GPU the kernels bound their waits with %globaltimer instead (a dead peer is then seen
    at the timeout); no watchdog runs there."""

    def __init__(self, ws, status: torch.Tensor, timeout: float):
        self.ws, self.status, self.timeout = ws, status, timeout
        self.problem = None
        self.words: list[int] | None = None  # the status words after the call (CPU)
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> "Watchdog":
        if self.status.device.type == "cpu":
            self._deadline = time.monotonic() + self.timeout
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="overlap-triton-watchdog")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def _run(self) -> None:
        decided = False
        while not self._stop.wait(WATCHDOG_POLL_S):
            if decided or int(self.status[0]) != 0:
                decided = True  # a verdict is out, or a kernel-side wait already failed
                continue
            problem = self.ws.peer_problem()
            if problem is not None:
                self.problem = problem
                self.status[3] = -(2 + problem.peer)
                decided = True
            elif time.monotonic() > self._deadline:
                self.status[3] = _TIMED_OUT
                decided = True
        # The kernels have returned: read the words here, so the host thread never does.
        self.words = [int(v) for v in self.status.tolist()]


def new_status(device: torch.device) -> torch.Tensor:
    """The status words of one call: [failure (0 = ok; slot + 1 of a wait that timed out, or
    the watchdog's code), last seen, wanted, watchdog verdict (0 = none), failed waits that
    claimed the report (the first one writes words 0-2)]."""
    return torch.zeros(5, dtype=torch.int64, device=device)


def raise_on_status(status: torch.Tensor | list[int], *, op: str, ws, phase: int,
                    timeout: float, describe, problem=None) -> None:
    """Raise TimeoutError naming op, rank, slot and phase if a wait of this call failed, or
    PeerDied if the watchdog saw a peer die or abort. Reading the word synchronises the host
    with the device on a GPU: the kernels of one call overlap their communication with their
    compute, but the host does not run ahead of them."""
    words = status if isinstance(status, list) else status.tolist()
    code, seen, want = (int(v) for v in words[:3])
    if code == 0:
        return
    if code <= -2:
        from overlap.symm.base import PeerDied

        peer = -code - 2
        detail = f": {problem}" if problem is not None else ""
        raise PeerDied(f"{op}: rank {ws.rank} of group {ws.group_name} stopped at phase {phase}: "
                       f"peer rank {peer} exited or aborted{detail}", group=ws.group_name,
                       peer=peer)
    slot = code - 1
    raise TimeoutError(
        f"{op}: rank {ws.rank} of group {ws.group_name} timed out after ~{timeout:g}s at phase "
        f"{phase} waiting on signal slot {slot} ({describe(slot)}): wanted >= {want}, last saw "
        f"{seen}. A peer is slow, dead or out of step (every rank must call {op} with the same "
        "phases); the workspace is now out of step and must be closed")


def check_dtypes(op: str, ws, **tensors: torch.Tensor) -> torch.dtype:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    dtype = next(iter(dtypes.values()))
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: dtype must be float32, bfloat16 or float16, got {dtype} "
                        f"(rank {ws.rank})")
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"{op}: inputs must share one dtype, got " +
                        ", ".join(f"{n}={d}" for n, d in dtypes.items()) + f" (rank {ws.rank})")
    for name, t in tensors.items():
        if t.device != ws.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the workspace of group "
                             f"{ws.group_name} is on {ws.device} (rank {ws.rank})")
    return dtype


def check_workspace(op: str, ws, need_bytes: int, need_signals: int, what: str) -> None:
    if ws.nbytes < need_bytes:
        raise ValueError(f"{op}: the workspace of group {ws.group_name} has {ws.nbytes} bytes "
                         f"but {what} needs {need_bytes} (rank {ws.rank}); create it with "
                         f"{op}_workspace_bytes(...)")
    if ws.num_signals < need_signals:
        raise ValueError(f"{op}: the workspace of group {ws.group_name} has {ws.num_signals} "
                         f"signals but {op} needs {need_signals} (rank {ws.rank}); create it "
                         f"with num_signals={op}_num_signals(world)")


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class _Pending:
    """The status word of a call made with sync=False, checked later."""

    status: torch.Tensor
    event: object  # torch.cuda.Event after the call's kernels, or None (CPU: they have run)
    phase: int
    timeout: float
    describe: Callable[[int], str]


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class OpState:
    """Host bookkeeping of one op on one workspace (this process's view)."""

    op: str
    last_phase: int = 0
    last_by_buffer: list[int] = dataclasses.field(default_factory=lambda: [0, 0])
    data_table: torch.Tensor | None = None
    flag_table: torch.Tensor | None = None
    checker_: "_Checker | None" = None

    def checker(self) -> "_Checker":
        if self.checker_ is None:
            self.checker_ = _Checker(self.op)
        return self.checker_


# The host bookkeeping of the op a workspace serves is kept on the workspace object itself
# (attribute ``_triton_op_state``): it lives and dies with the workspace, never in a global.
_STATE_ATTR = "_triton_op_state"


def begin_call(op: str, ws, phase: int) -> tuple[OpState, int, int]:
    """Validate ``phase`` and claim its buffer: returns (state, buffer, ack_phase) where
    ack_phase is the phase of the previous call that used the same buffer (0 if none); every
    consumer must have acknowledged it before this call overwrites the buffer.

    One workspace serves one op: all_gather_matmul and matmul_reduce_scatter lay out its bytes
    and signal slots differently, so sharing one workspace between them would let one op's
    peer writes land in a region the other op is still reading.
    """
    positive_int(phase, f"{op}: phase", where=f" (rank {ws.rank})")
    state = getattr(ws, _STATE_ATTR, None)
    if state is None:
        state = OpState(op=op)
        setattr(ws, _STATE_ATTR, state)
    if state.op != op:
        raise ValueError(f"{op}: this workspace of group {ws.group_name} already serves "
                         f"{state.op}; give each op kind its own workspace (rank {ws.rank})")
    check_pending(ws, block=False)
    if phase <= state.last_phase:
        raise ValueError(f"{op}: phase must increase from call to call on a workspace: got "
                         f"{phase} after {state.last_phase} (rank {ws.rank})")
    if state.data_table is None:
        state.data_table = ws.ptr_table()
        state.flag_table = ws.signal_ptr_table()
    buf = phase % 2
    ack_phase = state.last_by_buffer[buf]
    state.last_by_buffer[buf] = phase
    state.last_phase = phase
    return state, buf, ack_phase


def finish_call(state: OpState, status: torch.Tensor, *, ws, phase: int, timeout: float,
                describe: Callable[[int], str], sync: bool, dog: "Watchdog | None" = None,
                ) -> None:
    """Raise now if a wait of this call failed, or leave the check to a checker thread.

    Neither way reads the status word on the host thread in steady state: on CPU the
    watchdog thread has read it once the kernels returned (``dog.words``); on a GPU with
    ``sync=False`` the checker thread reads it once the call's event completes, and a failure
    is raised by the next call on the workspace or by ``check_pending``. ``sync=True`` reads
    it here (a host sync on a GPU: for tests and debugging)."""
    if dog is not None and dog.words is not None:
        if dog.words[0] != 0:
            raise_on_status(dog.words, op=state.op, ws=ws, phase=phase, timeout=timeout,
                            describe=describe, problem=dog.problem)
        return
    if sync:
        raise_on_status(status, op=state.op, ws=ws, phase=phase, timeout=timeout,
                        describe=describe)
        return
    event = None
    if status.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
    state.checker().add(_Pending(status=status, event=event, phase=phase, timeout=timeout,
                                 describe=describe), ws)


class _Checker:
    """A thread that reads the status words of ``sync=False`` calls once their kernels are
    done (it blocks on their events, never the host thread) and keeps the first failure for
    ``check_pending`` to raise."""

    def __init__(self, op: str):
        self.op = op
        self.failure: BaseException | None = None
        self._queue: list[tuple[_Pending, object]] = []
        self._cv = threading.Condition()
        self._busy = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"overlap-triton-check-{op}")
        self._thread.start()

    def add(self, pending: _Pending, ws) -> None:
        with self._cv:
            self._queue.append((pending, ws))
            self._cv.notify_all()

    def drain(self) -> None:
        with self._cv:
            while self._queue or self._busy:
                self._cv.wait()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                p, ws = self._queue.pop(0)
                self._busy = True
            try:
                if p.event is not None:
                    p.event.synchronize()
                if self.failure is None:
                    raise_on_status(p.status.tolist(), op=self.op, ws=ws, phase=p.phase,
                                    timeout=p.timeout, describe=p.describe)
            except BaseException as exc:  # noqa: BLE001 - raised by check_pending
                if self.failure is None:
                    self.failure = exc
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


def check_pending(ws, *, block: bool = True) -> None:
    """Raise the error of the first call made with ``sync=False`` on ``ws`` whose wait failed.
    ``block=False`` (every call does it first) raises only what the checker thread has found
    so far, without touching the device; ``block=True`` first waits until every earlier call
    has been checked."""
    state = getattr(ws, _STATE_ATTR, None)
    if state is None or state.checker_ is None:
        return
    if block:
        state.checker_.drain()
    if state.checker_.failure is not None:
        raise state.checker_.failure
