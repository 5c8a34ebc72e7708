"""Memory tools beside recomputation: activation offloading to host memory with prefetch
(``ActivationOffloader``). The user's view: docs/memory.md."""

from overlap.memory.offload import ActivationOffloader, OffloadStats

__all__ = ["ActivationOffloader", "OffloadStats"]
