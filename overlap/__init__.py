"""overlap: hide communication behind computation in tensor-, pipeline- and data-parallel training.

Layers (each uses only the ones below it): transport (``overlap.dist``, ``overlap.symm``),
kernels (``overlap.kernels``, ``csrc/``), fused ops (``overlap.tp.ops``, ``overlap.comm``), and
layers (``overlap.tp``, ``overlap.dp``, ``overlap.pp``). See docs/cpu-twins.md for what runs on CPU.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# Triton picks interpreter or compiler when a function is defined, its own standard library
# included (at `import triton`). Decide before anything imports triton: without a GPU, the
# Triton kernels run under the interpreter on CPU tensors. Asked without initialising CUDA:
# the launcher's fork server imports this before it forks the ranks (gpu_present).
if "TRITON_INTERPRET" not in _os.environ and "triton" not in _sys.modules:
    from overlap.dist.device import gpu_present as _gpu_present

    _os.environ["TRITON_INTERPRET"] = "0" if _gpu_present() else "1"
