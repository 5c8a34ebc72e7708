"""Triton kernels. On a machine without a GPU they run under ``TRITON_INTERPRET=1`` on CPU
tensors (the variable must be set before triton is imported; ``overlap.dist.launch`` sets it in
every rank)."""
