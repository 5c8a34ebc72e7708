"""overlap: hide communication behind computation in tensor-, pipeline- and data-parallel training.

Layers, bottom first (each imports only its own and lower ones; tests/test_layers.py checks):
``errors``, ``defaults``, ``versions``, ``cli``; instrumentation (``profile``'s names, nvtx,
timers, syncs); transport (``dist``, ``symm.base``); kernels (``kernels``, ``csrc/``);
symmetric memory (``symm``); fused ops (``tp``, ``comm``); ``pp``, ``dp``, ``memory``; ``cp``;
``nn``; ``moe``; the mesh (``dist.dims``); ``models``; the model-aware ``nn.parallelize``;
``profile``; ``plan``; ``train``; ``selftest``. See docs/cpu-twins.md for what runs on CPU.
"""

import gc as _gc
import os as _os
import sys as _sys

# Every overlap process imports torch. Its import allocates millions of objects that live as
# long as the process, and the collector's full passes over them cost about 40% of the import's
# CPU: paused for it (reference counting still frees what dies), and what it made is then
# frozen out of later full passes (gc.freeze; not once triton is loaded, whose bindings report
# frozen objects as leaks at exit).
if "torch" not in _sys.modules and _gc.isenabled():
    _gc.disable()
    try:
        import torch as _torch  # noqa: F401
    finally:
        _gc.enable()
    if "triton" not in _sys.modules:
        _gc.freeze()

__version__ = "0.1.0"

# OVERLAP_STACKS_ON_SIGUSR2=1 (set by tools/gpu_check.py for its steps): SIGUSR2 prints every
# thread's Python stack to stderr, so a checker can show where a hung process of a step (a rank,
# a launcher, its fork server, which inherits the handler) stood before it kills it.
if _os.environ.get("OVERLAP_STACKS_ON_SIGUSR2") == "1":
    import faulthandler as _faulthandler
    import signal as _signal

    _faulthandler.register(_signal.SIGUSR2, all_threads=True)

# Triton picks interpreter or compiler when a function is defined, its own standard library
# included (at `import triton`). Decide before anything imports triton: without a GPU, the
# Triton kernels run under the interpreter on CPU tensors. Asked without initialising CUDA:
# the launcher's fork server imports this before it forks the ranks (gpu_present).
if "TRITON_INTERPRET" not in _os.environ and "triton" not in _sys.modules:
    from overlap.dist.device import gpu_present as _gpu_present

    _os.environ["TRITON_INTERPRET"] = "0" if _gpu_present() else "1"
