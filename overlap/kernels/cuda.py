"""Builds and loads the CUDA kernels of csrc/*.cu at first use, on GPU machines only.

The kernels are compiled at run time with NVRTC through cupy (``pip install overlap[cuda]``;
NVRTC itself ships with torch's CUDA wheels), for the architecture of the current device, and
cached per (file, device). cupy picks the architecture: it appends its own ``-arch`` for the
current device, so ``nvrtc_options`` passes none (NVRTC rejects a second ``-arch`` with
NVRTC_ERROR_INVALID_OPTION). cupy also appends ``-ftz=true``; the quantization arithmetic
(csrc/quant.cuh) writes the same bytes with or without flush-to-zero. Nothing here runs at
install time, so ``pip install`` needs no CUDA toolkit. CI compiles the same files as this
loader does, through cupy's NVRTC call with these options, for sm_80 and sm_90, no GPU needed
(``python -m overlap.kernels.compile_check --nvrtc``; NVRTC has no C++ standard headers), and
with ``nvcc -arch=sm_90a`` and ``-arch=sm_80``, warnings as errors.

Kernels are launched on torch's *current* CUDA stream, so they are ordered with the torch work
around them without any host synchronisation.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["csrc_dir", "nvrtc_options", "load_module", "launch_kernel", "quantize_blocks",
           "dequantize_blocks", "dequant_reduce_blocks"]

# Options that choose the target; cupy adds exactly one of its own (see nvrtc_options).
ARCH_OPTIONS = ("-arch", "--gpu-architecture", "-gencode", "--generate-code", "-code",
                "--gpu-code")


def csrc_dir() -> Path:
    """Where the .cu/.cuh sources are: $OVERLAP_CSRC, the installed copy, or the source tree."""
    env = os.environ.get("OVERLAP_CSRC")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent.parent
    candidates += [here / "_csrc", here.parent / "csrc"]
    for c in candidates:
        if (c / "signal.cu").is_file():
            return c
    raise FileNotFoundError(f"overlap.kernels.cuda: csrc/ sources not found in {candidates}; "
                            "set OVERLAP_CSRC to the repository's csrc directory")


def nvrtc_options(src_dir: Path) -> tuple[str, ...]:
    """The NVRTC options the loader passes to cupy: language and include path, no target.

    cupy's compile step appends ``-arch=sm_XY`` for the current device (``compute_XY``, PTX,
    when the GPU is newer than NVRTC knows), so an ``-arch`` here would be the second one. The
    kernels use nothing arch-specific (no sm_90a-only instructions), so cupy's choice is right.
    """
    return ("-std=c++17", f"-I{src_dir}")


@functools.cache
def load_module(filename: str, device_index: int) -> Any:
    """Compile ``csrc/<filename>`` for the given device with NVRTC; returns a cupy RawModule."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError("overlap.kernels.cuda needs cupy for run-time compilation: "
                          "pip install 'overlap[cuda]'") from exc
    src_dir = csrc_dir()
    code = (src_dir / filename).read_text()
    # cupy targets the *current* device, hence the device context around the compile too.
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=code, options=nvrtc_options(src_dir))


def launch_kernel(filename: str, name: str, grid: Sequence[int], block: Sequence[int],
                  args: Sequence[Any], device: torch.device) -> None:
    """Launch kernel ``name`` of ``csrc/<filename>`` on the current torch stream of ``device``.

    ``args`` are passed to cupy: use numpy scalars of the kernel's C types (np.int64, np.uint64)
    and raw addresses as np.uint64 for pointers.
    """
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = load_module(filename, index).get_function(name)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, index)
    with cupy.cuda.Device(index):
        fn(tuple(grid), tuple(block), tuple(args), stream=stream)


# ---- blockwise INT8 quantization (csrc/quant.cu) ---------------------------------------------
# The GPU kernels where Triton is absent (overlap.comm.quant.kernels, impl="cuda"). The three
# functions take what overlap._C's functions of the same names take (raw addresses and sizes,
# the layout csrc/quant.cpp documents), less num_threads, plus the device; the *_launch helpers
# build the grid and the kernel arguments and run anywhere, so CPU tests check them against the
# kernel signatures.

_QUANT_CU = "quant.cu"
_THREADS = 256  # a power of two <= 1024, as the kernels' shared-memory max reduction needs
_DEQUANT_MAX_BLOCKS = 1 << 16  # the dequantize kernel is grid-stride


def _ptr(p: int) -> np.uint64:
    return np.uint64(p)


def quantize_launch(x: int, dtype: int, numel: int, flat_row: int, rows: int, row_len: int,
                    block: int, q: int, q_stride: int, s: int, s_stride: int, stochastic: bool,
                    key: int, index_base: int) -> tuple[tuple, tuple, tuple]:
    """(grid, block, args) of ``overlap_quantize_blocks``: one thread block per quantization
    block."""
    grid = (rows * (row_len // block),)
    args = (_ptr(x), np.int32(dtype), np.int64(numel), np.int64(flat_row), np.int64(row_len),
            np.int64(block), _ptr(q), np.int64(q_stride), _ptr(s), np.int64(s_stride),
            np.int32(bool(stochastic)), np.uint32(key), np.int64(index_base))
    return grid, (min(block, _THREADS),), args


def dequantize_launch(q: int, q_stride: int, s: int, s_stride: int, rows: int, row_len: int,
                      block: int, out: int, numel: int,
                      flat_row: int) -> tuple[tuple, tuple, tuple]:
    """(grid, block, args) of ``overlap_dequantize_blocks`` (grid-stride over ``numel``)."""
    grid = (min(-(-numel // _THREADS), _DEQUANT_MAX_BLOCKS),)
    args = (_ptr(q), np.int64(q_stride), _ptr(s), np.int64(s_stride), np.int64(block), _ptr(out),
            np.int64(numel), np.int64(flat_row))
    return grid, (_THREADS,), args


def dequant_reduce_launch(q: int, q_stride: int, s: int, s_stride: int, num_src: int,
                          row_len: int, block: int, divisor: float, out: int, q_out: int,
                          s_out: int, stochastic: bool, key: int,
                          index_base: int) -> tuple[tuple, tuple, tuple]:
    """(grid, block, args) of ``overlap_dequant_reduce_blocks``: one thread block per
    quantization block; ``out`` 0 means requantize into ``q_out``/``s_out``."""
    grid = (row_len // block,)
    args = (_ptr(q), np.int64(q_stride), _ptr(s), np.int64(s_stride), np.int64(num_src),
            np.int64(block), np.float32(divisor), _ptr(out), _ptr(q_out), _ptr(s_out),
            np.int32(bool(stochastic)), np.uint32(key), np.int64(index_base))
    return grid, (min(block, _THREADS),), args


def _launch_quant(name: str, launch: tuple[tuple, tuple, tuple], device: torch.device) -> None:
    grid, threads, args = launch
    if grid[0] > 0:
        launch_kernel(_QUANT_CU, name, grid, threads, args, device)


def quantize_blocks(*args, device: torch.device) -> None:
    """``overlap._C.quantize_blocks`` on the GPU (the same arguments less ``num_threads``)."""
    _launch_quant("overlap_quantize_blocks", quantize_launch(*args), device)


def dequantize_blocks(*args, device: torch.device) -> None:
    """``overlap._C.dequantize_blocks`` on the GPU (the same arguments less ``num_threads``)."""
    _launch_quant("overlap_dequantize_blocks", dequantize_launch(*args), device)


def dequant_reduce_blocks(*args, device: torch.device) -> None:
    """``overlap._C.dequant_reduce_blocks`` on the GPU (the same arguments less
    ``num_threads``)."""
    _launch_quant("overlap_dequant_reduce_blocks", dequant_reduce_launch(*args), device)
