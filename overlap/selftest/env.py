"""What this machine has: devices, library versions, GPU peer access and interconnect.

Every probe is best effort and never raises: a missing library reads "not installed", a
question that needs GPUs reads "n/a" on a machine without them, and one that could not be
answered reads "unknown" or "error: ...". Nothing here starts a process group, so it runs in
the launcher process before any rank starts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import re
import shutil
import socket
import subprocess
from typing import Any

import torch

import overlap

__all__ = ["Environment", "detect", "nvlink_from_topo"]

NA = "n/a"
_CU_P2P_NATIVE_ATOMIC = 3  # CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED


@dataclasses.dataclass(kw_only=True, slots=True)
class Environment:
    host: str
    python: str
    cpu_cores: int
    overlap: str
    overlap_c_extension: str      # "built" or "missing: <error>"
    torch: str
    torch_cuda_runtime: str       # torch.version.cuda, "n/a" for a CPU build
    triton: str
    triton_mode: str              # "interpreter, TRITON_INTERPRET=1" or "compiled"
    nccl: str                     # torch.cuda.nccl.version(), "n/a" without CUDA
    cupy: str
    cuda_driver: str
    num_gpus: int
    devices: list[str]            # "cpu" plus one "cuda:i <name> (sm_XY, N GiB)" per GPU
    peer_access: Any              # "n/a", or {"0->1": bool, ...}
    p2p_atomics: Any              # "n/a", "unknown", or {"0->1": bool, ...}
    nvlink: str                   # "n/a", "unknown", "yes: ...", "no: ..."
    torch_symmetric_memory: str   # "n/a" on CPU, else "importable" / "import failed: ..."

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for the printed summary."""
        def pairs(v: Any) -> str:
            if isinstance(v, dict):
                return ", ".join(f"{k} {'yes' if ok else 'no'}" for k, ok in v.items()) or "-"
            return str(v)

        return [("host", f"{self.host}, Python {self.python}, {self.cpu_cores} CPU cores"),
                ("devices", "; ".join(self.devices)),
                ("overlap", f"{self.overlap} (C++ extension {self.overlap_c_extension})"),
                ("torch", f"{self.torch} (CUDA runtime {self.torch_cuda_runtime})"),
                ("triton", f"{self.triton} ({self.triton_mode})"),
                ("NCCL", self.nccl), ("cupy", self.cupy), ("CUDA driver", self.cuda_driver),
                ("peer access", pairs(self.peer_access)),
                ("P2P atomics", pairs(self.p2p_atomics)),
                ("NVLink", self.nvlink),
                ("torch symm. memory", self.torch_symmetric_memory)]


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as exc:  # noqa: BLE001 - an optional dependency may fail in any way
        return "not installed" if isinstance(exc, ImportError) else f"error: {exc}"
    return str(getattr(mod, "__version__", "unknown"))


def _c_extension() -> str:
    try:
        import overlap._C  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"missing: {exc}"
    return "built"


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _libcuda() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


def _nccl() -> str:
    if not torch.cuda.is_available():
        return NA
    try:
        v = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001 - torch built without NCCL raises varied errors
        return f"unavailable: {exc}"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _driver(num_gpus: int) -> str:
    if num_gpus == 0:
        return NA
    parts = []
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi and smi.strip():
        parts.append(smi.strip().splitlines()[0].strip())
    lib = _libcuda()
    if lib is not None:
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            parts.append(f"CUDA {v.value // 1000}.{(v.value % 1000) // 10}")
    return ", ".join(parts) if parts else "unknown"


def _devices(num_gpus: int) -> list[str]:
    devices = ["cpu"]
    for i in range(num_gpus):
        try:
            p = torch.cuda.get_device_properties(i)
            devices.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, "
                           f"{p.total_memory / 2**30:.0f} GiB)")
        except Exception as exc:  # noqa: BLE001
            devices.append(f"cuda:{i} (error: {exc})")
    return devices


def _pairs(num_gpus: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(num_gpus) for j in range(num_gpus) if i != j]


def _peer_access(num_gpus: int) -> Any:
    if num_gpus == 0:
        return NA
    try:
        return {f"{i}->{j}": bool(torch.cuda.can_device_access_peer(i, j))
                for i, j in _pairs(num_gpus)}
    except Exception as exc:  # noqa: BLE001
        return f"error: {exc}"


def _p2p_atomics(num_gpus: int) -> Any:
    """Native atomics across the link (what a signal flag set from a peer GPU relies on)."""
    if num_gpus == 0:
        return NA
    lib = _libcuda()
    if lib is None:
        return "unknown"
    result = {}
    for i, j in _pairs(num_gpus):
        src, dst, val = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if (lib.cuDeviceGet(ctypes.byref(src), i) or lib.cuDeviceGet(ctypes.byref(dst), j)
                or lib.cuDeviceGetP2PAttribute(ctypes.byref(val), _CU_P2P_NATIVE_ATOMIC,
                                               src, dst)):
            return "unknown"
        result[f"{i}->{j}"] = bool(val.value)
    return result


def nvlink_from_topo(text: str) -> str:
    """Summarise ``nvidia-smi topo -m``: "yes: NV<k> links on P of Q GPU pairs" or "no: ..."."""
    rows = [line.split() for line in text.splitlines() if re.match(r"^GPU\d+\s", line)]
    n = len(rows)
    links = [row[1 + j] for i, row in enumerate(rows) for j in range(n)
             if i != j and len(row) > 1 + j]
    nv = [x for x in links if re.fullmatch(r"NV\d+", x)]
    if not links:
        return "unknown"
    if nv:
        kinds = "/".join(sorted(set(nv)))
        return f"yes: {kinds} on {len(nv)} of {len(links)} GPU pairs"
    return f"no: GPUs linked by {'/'.join(sorted(set(links)))} (PCIe or system)"


def _nvlink(num_gpus: int) -> str:
    if num_gpus == 0:
        return NA
    topo = _run(["nvidia-smi", "topo", "-m"])
    return nvlink_from_topo(topo) if topo else "unknown"


def _symmetric_memory(num_gpus: int) -> str:
    if num_gpus == 0:
        return NA
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"import failed: {exc}"
    return "importable (the symm.torch_symmetric_memory check runs it)"


def detect() -> Environment:
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return Environment(
        host=socket.gethostname(), python=platform.python_version(),
        cpu_cores=os.cpu_count() or 0, overlap=overlap.__version__,
        overlap_c_extension=_c_extension(), torch=torch.__version__,
        torch_cuda_runtime=torch.version.cuda or NA, triton=_version("triton"),
        triton_mode="interpreter, TRITON_INTERPRET=1" if interp else "compiled",
        nccl=_nccl(), cupy=_version("cupy"), cuda_driver=_driver(num_gpus), num_gpus=num_gpus,
        devices=_devices(num_gpus), peer_access=_peer_access(num_gpus),
        p2p_atomics=_p2p_atomics(num_gpus), nvlink=_nvlink(num_gpus),
        torch_symmetric_memory=_symmetric_memory(num_gpus))
