"""Triton kernels.

On a machine without a CUDA GPU they run under Triton's interpreter on CPU tensors. Triton
decides interpreter vs compiler when a kernel is *defined* (``@triton.jit``), so this package
sets ``TRITON_INTERPRET=1`` before any of its kernel modules is imported, unless the variable is
already set or a GPU is present.
"""

import os

import torch

INTERPRET = os.environ.setdefault(
    "TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1") == "1"
