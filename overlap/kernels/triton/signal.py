"""Signal wait/set as Triton device functions, and a peer-copy kernel that uses them.

The same protocol as csrc/signal.cuh: a flag is an int64 phase counter in a (possibly peer's)
symmetric workspace; ``set_signal`` release-stores after the kernel's prior stores, and
``wait_signal`` spins with acquire loads until the flag reaches the phase. Triton has no clock
that works under the interpreter, so the wait is bounded by a spin count and reports whether it
succeeded instead of hanging: callers write the result to an error word the host checks.

Under ``TRITON_INTERPRET=1`` these run on CPU shared memory across processes: raw addresses are
cast to pointers with ``.to(tl.pointer_type(...))`` and the atomics are real.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overlap.kernels.triton.spec import CompileSpec, ints
from overlap.kernels.triton.tp_sync import load_acquire, store_release

__all__ = ["wait_signal", "set_signal", "pull_from_peer", "signal_from_kernel", "compile_specs"]


@triton.jit
def wait_signal(flag_ptr, phase, max_spins):
    """Spin until *flag_ptr >= phase; returns 1 if reached, 0 after max_spins loads."""
    seen = load_acquire(flag_ptr)
    spins = 0
    while (seen < phase) & (spins < max_spins):
        seen = load_acquire(flag_ptr)
        spins += 1
    return (seen >= phase).to(tl.int32)


@triton.jit
def set_signal(flag_ptr, value):
    """Release-store value into *flag_ptr once this program's earlier stores are visible.
    The barrier first makes every thread of the program finish its stores: the release orders
    only the signalling thread's own prior writes."""
    tl.debug_barrier()
    store_release(flag_ptr, value)


@triton.jit
def _pull_kernel(src_addr_ptr, flag_addr_ptr, out_ptr, status_ptr, phase, max_spins, numel,
                 BLOCK: tl.constexpr):
    # Wait for the peer's "data ready" flag, then copy its buffer: the consumer half of the
    # AllGather-GEMM pattern, where a tile waits on the signal of the chunk it needs.
    pid = tl.program_id(0)
    flag = tl.load(flag_addr_ptr).to(tl.pointer_type(tl.int64))
    ok = wait_signal(flag, phase, max_spins)
    tl.atomic_min(status_ptr, ok)
    if ok != 0:
        src = tl.load(src_addr_ptr).to(tl.pointer_type(tl.float32))
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(out_ptr + offs, tl.load(src + offs, mask=mask), mask=mask)


def pull_from_peer(src_addr: int, flag_addr: int, phase: int, numel: int, *,
                   max_spins: int = 1_000_000, block: int = 1024) -> torch.Tensor:
    """Copy ``numel`` fp32 values from raw address ``src_addr`` once the int64 flag at
    ``flag_addr`` reaches ``phase``. Raises TimeoutError if the flag never got there."""
    out = torch.empty(numel, dtype=torch.float32)
    status = torch.ones(1, dtype=torch.int32)
    addrs = torch.tensor([src_addr, flag_addr], dtype=torch.int64)
    grid = (triton.cdiv(numel, block),)
    _pull_kernel[grid](addrs[0:1], addrs[1:2], out, status, phase, max_spins, numel, BLOCK=block)
    if int(status.item()) != 1:
        raise TimeoutError(f"pull_from_peer: the flag at {flag_addr:#x} did not reach {phase} "
                           f"within {max_spins} spins")
    return out


@triton.jit
def _set_kernel(flag_addr_ptr, value):
    set_signal(tl.load(flag_addr_ptr).to(tl.pointer_type(tl.int64)), value)


def signal_from_kernel(flag_addr: int, value: int) -> None:
    """Release-store ``value`` at raw address ``flag_addr`` from a one-program Triton kernel."""
    _set_kernel[(1,)](torch.tensor([flag_addr], dtype=torch.int64), value)


def compile_specs() -> list[CompileSpec]:
    """The two kernels as the helpers above launch them (on CPU tensors today; compiled for
    the GPU all the same, since a kernel the compiler rejects is broken)."""
    return [CompileSpec(_pull_kernel, {"src_addr_ptr": "*i64", "flag_addr_ptr": "*i64",
                                       "out_ptr": "*fp32", "status_ptr": "*i32",
                                       **ints("phase max_spins numel")}, dict(BLOCK=1024)),
            CompileSpec(_set_kernel, {"flag_addr_ptr": "*i64", "value": "i32"}, {})]
