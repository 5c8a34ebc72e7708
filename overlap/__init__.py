"""overlap: hide communication behind computation in tensor-, pipeline- and data-parallel training.

Layers (each uses only the ones below it): transport (``overlap.dist``, ``overlap.symm``),
kernels (``overlap.kernels``, ``csrc/``), fused ops (``overlap.tp.ops``, ``overlap.comm``), and
layers (``overlap.tp``, ``overlap.dp``, ``overlap.pp``). See the README for what runs on CPU.
"""

__version__ = "0.1.0"
