"""The symmetric EP exchange's send in one Triton kernel: gather each routed row from its
source tensor (the permutation), store it straight into its owner's receive region (a peer's
userbuffer), write the per-expert counts, and signal every owner once all rows are stored.

Shapes (per source rank ``rank`` of ``world``; see overlap.moe.symmetric for the layout):

    src    [m, w]   rows to send (the activations, or their INT8/BF16 wire form), w elements
    index  [n]      int64: row of ``src`` for each routed row, -1 for an empty slot (zeros)
    owner  [n]      int64: the owner rank of each routed row
    place  [n]      int64: its row inside the owner's region for this source (< R)
    counts [world, El] int64: rows to each (owner, local expert)

A row lands at ``data(owner) + receive_off + (rank * (R + 1) + place) * row_elems``, the counts
at ``data(o) + rank * El * 8``; then the last program to arrive release-stores ``phase`` into
slot ``rank`` of every owner's flags. The narrative: docs/moe.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overlap.kernels.triton.spec import GEMM_DTYPES, CompileSpec, ints, ptr
from overlap.kernels.triton.tp_sync import arrive_last, publish

__all__ = ["dispatch_rows", "compile_specs"]


@triton.jit(do_not_specialize=["phase"])
def _ep_dispatch_kernel(src_ptr, index_ptr, owner_ptr, place_ptr, counts_ptr, data_table,
                        flag_table, counter_ptr, n, w, rank, world, num_local, receive_off,
                        region_rows, row_elems, phase, BLOCK_R: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n
    index = tl.load(index_ptr + rows, mask=live, other=-1)
    owner = tl.load(owner_ptr + rows, mask=live, other=0)
    place = tl.load(place_ptr + rows, mask=live, other=0)
    base = tl.load(data_table + owner, mask=live, other=0).to(
        tl.pointer_type(src_ptr.dtype.element_ty))
    at = receive_off + (rank * region_rows + place) * row_elems
    for c0 in range(0, w, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        inside = cols < w
        vals = tl.load(src_ptr + index[:, None] * w + cols[None, :],
                       mask=(live & (index >= 0))[:, None] & inside[None, :], other=0)
        tl.store(base[:, None] + at[:, None] + cols[None, :], vals,
                 mask=live[:, None] & inside[None, :])
    if arrive_last(counter_ptr, tl.num_programs(0)):
        for o in range(0, world):
            peer = tl.load(data_table + o).to(tl.pointer_type(tl.int64))
            j = tl.arange(0, 64)
            for j0 in range(0, num_local, 64):
                sel = (j0 + j) < num_local
                tl.store(peer + rank * num_local + j0 + j,
                         tl.load(counts_ptr + o * num_local + j0 + j, mask=sel), mask=sel)
        for o in range(0, world):
            flags = tl.load(flag_table + o).to(tl.pointer_type(tl.int64))
            publish(flags + rank, phase)


def dispatch_rows(ws, src: torch.Tensor, index: torch.Tensor, owner: torch.Tensor,
                  place: torch.Tensor, counts: torch.Tensor, *, receive_off: int, rows: int,
                  row_bytes: int, phase: int, block_rows: int = 16) -> None:
    """Launch the kernel on ``ws`` (a SymmetricWorkspace) for this rank's routed rows; every
    owner's flag ``ws.rank`` reaches ``phase`` once they (and the counts) are stored."""
    itemsize = src.element_size()
    if receive_off % itemsize or row_bytes % itemsize:
        raise ValueError(f"dispatch_rows: offsets must be multiples of {itemsize} bytes "
                         f"({src.dtype}) (rank {ws.rank})")
    n, w = index.shape[0], src.shape[1]
    counter = torch.zeros(1, dtype=torch.int32, device=src.device)
    grid = (max(1, triton.cdiv(n, block_rows)),)
    _ep_dispatch_kernel[grid](
        src.contiguous(), index.contiguous(), owner.contiguous(), place.contiguous(),
        counts.contiguous(), ws.ptr_table(), ws.signal_ptr_table(), counter, n, w, ws.rank,
        ws.world, counts.shape[1], receive_off // itemsize, rows + 1, row_bytes // itemsize,
        phase, **_meta(block_rows, w))


def _meta(block_rows: int, w: int) -> dict:
    """The launch's constexprs (shared with compile_specs)."""
    return dict(BLOCK_R=block_rows, BLOCK_W=min(128, triton.next_power_of_2(max(w, 1))))


def compile_specs() -> list[CompileSpec]:
    """The GPU launches: rows of the activations' dtypes or of the INT8 wire form."""
    return [CompileSpec(_ep_dispatch_kernel, {
        "src_ptr": ptr(dtype), "index_ptr": "*i64", "owner_ptr": "*i64", "place_ptr": "*i64",
        "counts_ptr": "*i64", "data_table": "*i64", "flag_table": "*i64", "counter_ptr": "*i32",
        **ints("n w rank world num_local receive_off region_rows row_elems phase")},
        _meta(16, 4096), str(dtype)) for dtype in GEMM_DTYPES + (torch.int8,)]
