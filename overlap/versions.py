"""The torch and Triton releases overlap supports, and why another one cannot run here.

    TORCH_MIN          (2, 8)   the oldest torch (it ships Triton 3.4)
    TORCH_COMPILE_MIN  (2, 11)  torch._opaque_base: TPComm and CPComm are opaque objects to
                                torch.compile (custom ops take them as arguments); below it
                                they are plain objects, eager runs, torch.compile is refused
    TRITON_MIN         (3, 4)   the oldest Triton every kernel compiles with for sm_80/sm_90
                                (overlap.kernels.compile_check; CI runs 3.4 and the newest)

``torch_problem()`` / ``triton_problem()`` / ``compile_problem()`` return None when the
installed release is supported, else one sentence naming it and the range. ``OpaqueBase``,
``MemberType``, ``register_opaque_type``: torch's, or stand-ins below TORCH_COMPILE_MIN.
The narrative: docs/design/kernels.md.
"""

from __future__ import annotations

import importlib.util
import re

__all__ = ["TORCH_MIN", "TORCH_COMPILE_MIN", "TRITON_MIN", "TRITON_CHECKED", "release",
           "torch_problem", "triton_problem", "compile_problem", "HAVE_OPAQUE", "OpaqueBase",
           "MemberType", "register_opaque_type"]

try:
    from torch._library.opaque_object import MemberType, register_opaque_type
    from torch._opaque_base import OpaqueBase

    HAVE_OPAQUE = True
except ImportError:  # torch < 2.11: communicators are plain objects (eager only)
    HAVE_OPAQUE = False

    class OpaqueBase:  # type: ignore[no-redef]
        """Stands for torch._opaque_base.OpaqueBase where torch has none."""

    class MemberType:  # type: ignore[no-redef]
        USE_REAL = "use_real"

    def register_opaque_type(cls, **kwargs) -> None:  # type: ignore[no-redef]
        """Nothing to register: without opaque objects torch.compile is refused instead."""

TORCH_MIN = (2, 8)
TORCH_COMPILE_MIN = (2, 11)
TRITON_MIN = (3, 4)
TRITON_CHECKED = "3.4 to 3.9"  # the Triton releases the kernels were compile-checked on


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.13.0+cpu" -> (2, 13)."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _text(v: tuple[int, int]) -> str:
    return ".".join(map(str, v))


def torch_problem(version: str | None = None) -> str | None:
    """None for a supported torch (the installed one unless ``version`` is given), else why
    not, naming the version and the range."""
    if version is None:
        import torch

        version = torch.__version__
    if release(version) < TORCH_MIN:
        return f"torch {version} is older than overlap supports (torch >= {_text(TORCH_MIN)})"
    return None


def compile_problem(what: str) -> str | None:
    """None when torch.compile can trace ``what`` (a fused op taking a communicator), else
    why not: torch before TORCH_COMPILE_MIN has no opaque objects for the communicator."""
    if HAVE_OPAQUE:
        return None
    import torch

    return (f"{what} under torch.compile needs torch >= {_text(TORCH_COMPILE_MIN)} (opaque "
            f"objects for the communicator); this is torch {torch.__version__}: run it eagerly")


def triton_problem() -> str | None:
    """None when the installed Triton can compile and run overlap's Triton kernels, else why
    not (not installed, fails to import, or too old), naming the version and the range."""
    need = f"overlap's Triton kernels need Triton >= {_text(TRITON_MIN)} ({TRITON_CHECKED} " \
           "compile-checked)"
    if importlib.util.find_spec("triton") is None:
        return f"Triton is not installed; {need}"
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason like any other
        return f"Triton does not import ({type(exc).__name__}: {exc}); {need}"
    version = getattr(triton, "__version__", "?")
    if release(version) < TRITON_MIN:
        return f"Triton {version} is installed; {need}"
    return None
