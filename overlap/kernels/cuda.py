"""Builds and loads the CUDA kernels of csrc/*.cu at first use, on GPU machines only.

The kernels are compiled at run time with NVRTC through cupy (``pip install overlap[cuda]``;
NVRTC itself ships with torch's CUDA wheels), for the architecture of the current device, and
cached per (file, device). Nothing here runs at install time, so ``pip install`` needs no CUDA
toolkit. CI compile-checks the same files with ``nvcc -arch=sm_90a`` and ``-arch=sm_80``.

Kernels are launched on torch's *current* CUDA stream, so they are ordered with the torch work
around them without any host synchronisation.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["csrc_dir", "load_module", "launch_kernel"]


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
    major, minor = torch.cuda.get_device_capability(device_index)
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=code, options=("-std=c++17", f"-I{src_dir}", f"-arch={arch}"))


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
