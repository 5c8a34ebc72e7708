"""Kernels: Triton (``overlap.kernels.triton``), CUDA (``csrc/*.cu`` loaded by
``overlap.kernels.cuda``) and the C++ CPU extension ``overlap._C``."""
