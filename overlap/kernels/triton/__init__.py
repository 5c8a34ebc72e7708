"""Triton kernels.

On a machine without a CUDA GPU they run under Triton's interpreter on CPU tensors. Triton
decides interpreter vs compiler when a function is *defined* (``@triton.jit``), and that
includes its own standard library (``tl.max``, ``tl.sum``, ...), defined when ``triton`` is
first imported. So ``overlap`` sets ``TRITON_INTERPRET=1`` when the package is imported (see
``overlap/__init__.py``), unless the variable is already set or a GPU is present, and this
module checks that Triton was not imported in the other mode first.
"""

import os
import warnings

from overlap.dist.device import gpu_present
from overlap.versions import release

if "TRITON_INTERPRET" not in os.environ:  # asked without initialising CUDA (gpu_present)
    os.environ["TRITON_INTERPRET"] = "0" if gpu_present() else "1"
INTERPRET = os.environ["TRITON_INTERPRET"] == "1"


def _check_triton_mode() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if INTERPRET and not isinstance(tl.max, InterpretedFunction):
        # A warning, not an error: code that never launches a Triton kernel still works.
        warnings.warn(
            "overlap.kernels.triton: triton was imported before TRITON_INTERPRET=1 was set (for "
            "example by torch.distributed.pipelining or torch._inductor), so its standard "
            "library is compiled for a GPU and the interpreter cannot run overlap's Triton "
            "kernels on this CPU machine. Import overlap before those modules, or export "
            "TRITON_INTERPRET=1.", RuntimeWarning, stacklevel=2)


def _scalar_index_fix() -> None:
    """Triton before 3.9 interprets ``range(0, n)`` over a runtime scalar with ``int(array)`` of
    a one-element array, which numpy 2 refuses ("only 0-dimensional arrays can be converted"):
    every loop over a kernel argument failed under the interpreter of Triton 3.4 to 3.8 (the
    Triton of torch 2.8 to 2.10). Their interpreter gets 3.9's conversion (``squeeze`` first).
    The interpreter only: compiled kernels never reach this."""
    import triton
    from triton.runtime import interpreter

    if release(triton.__version__) >= (3, 9) or getattr(interpreter, "_overlap_index_fix", 0):
        return
    patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, *args, **kwargs):
        out = patch(tensor, *args, **kwargs)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())
        return out

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._overlap_index_fix = 1


_check_triton_mode()
if INTERPRET:
    _scalar_index_fix()
