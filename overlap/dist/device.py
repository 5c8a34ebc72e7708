"""The device a rank computes on: its GPU when the default process group is NCCL, else CPU.

Ranks per GPU (``OVERLAP_RANKS_PER_GPU``, or each command's ``--ranks-per-gpu``; default 1):
local rank r computes on GPU ``r // ranks_per_gpu``, so one GPU can run every multi-rank path.
NCCL refuses two ranks of one host on one GPU, so each sharing rank presents its own host id
(``NCCL_HOSTID``) and NCCL talks to its peers over sockets; ``LOCAL_WORLD_SIZE`` (the node
layout) is unchanged. The mode is for correctness only: timings of ranks that share a GPU say
nothing about speed, and every table and summary printed in it says so (``sharing_note``).
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

__all__ = ["rank_device", "comm_device", "gpu_present", "plain_gloo", "RANKS_PER_GPU_ENV",
           "ranks_per_gpu", "gpu_index", "sharing_env", "apply_sharing", "sharing_note",
           "placement", "gpu_for_rank"]

RANKS_PER_GPU_ENV = "OVERLAP_RANKS_PER_GPU"


def ranks_per_gpu(value: int | str | None = None, *, what: str = "--ranks-per-gpu") -> int:
    """``value`` (a flag's), else env ``OVERLAP_RANKS_PER_GPU``, else 1, checked: a positive
    int, or ValueError naming where the bad value came from."""
    if value is None:
        value, what = os.environ.get(RANKS_PER_GPU_ENV) or 1, f"env {RANKS_PER_GPU_ENV}"
    if isinstance(value, str):
        n = int(value.strip()) if value.strip().isdigit() else 0
    else:
        n = value if type(value) is int else 0  # a bool is not a count
    if n < 1:
        raise ValueError(f"{what} must be a positive int (ranks that share one GPU), "
                         f"got {value!r}")
    return n


def gpu_index(local_rank: int, *, per_gpu: int, gpus: int, local_world: int | None = None) -> int:
    """The GPU of ``local_rank`` when ``per_gpu`` ranks share each of ``gpus`` GPUs; a clear
    ValueError when the node's ranks need more GPUs than it has."""
    need = -(-(local_world if local_world is not None else local_rank + 1) // per_gpu)
    if gpus < 1 or need > gpus:
        ranks = local_world if local_world is not None else local_rank + 1
        raise ValueError(
            f"ranks per GPU: {ranks} local ranks at {per_gpu} per GPU need {need} GPUs, "
            f"this node has {gpus}; set {RANKS_PER_GPU_ENV} (or --ranks-per-gpu) to at least "
            f"{-(-ranks // max(gpus, 1))}" if gpus >= 1 else
            f"ranks per GPU: local rank {local_rank} needs a GPU, this node has none")
    return local_rank // per_gpu


def sharing_env(rank: int, per_gpu: int, *, one_node: bool = True) -> dict[str, str]:
    """What a rank's environment needs before NCCL starts when ``per_gpu`` > 1: its own host id
    (NCCL refuses two ranks of one host on one GPU) and, in a one-node job, the loopback
    interface for NCCL's sockets (kept where the user set one)."""
    if per_gpu <= 1:
        return {}
    env = {"NCCL_HOSTID": f"{socket.gethostname()}-overlap-rank{rank}"}
    if one_node and "NCCL_SOCKET_IFNAME" not in os.environ:
        env["NCCL_SOCKET_IFNAME"] = "lo"
    return env


def apply_sharing(per_gpu: int | None = None) -> int:
    """Under torchrun/srun, before ``init_process_group``: put this rank's sharing settings
    (``sharing_env``) into its environment. Returns the ranks per GPU."""
    n = ranks_per_gpu(per_gpu)
    os.environ[RANKS_PER_GPU_ENV] = str(n)
    env = os.environ
    one_node = env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE")) == env.get("WORLD_SIZE")
    os.environ.update(sharing_env(int(env.get("RANK", "0")), n, one_node=one_node))
    return n


def sharing_note(per_gpu: int | None = None) -> str | None:
    """The line every timing printed with ranks sharing a GPU carries; None at 1 per GPU."""
    n = ranks_per_gpu(per_gpu)
    if n <= 1:
        return None
    return (f"ranks share a GPU ({n} per GPU, {RANKS_PER_GPU_ENV}={n}): a correctness mode; "
            "these timings mean nothing for speed")


def placement() -> dict:
    """Where this rank runs, for reports: ranks per GPU, its NCCL host id, its device."""
    dev = torch.device("cpu")
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    return {"ranks_per_gpu": ranks_per_gpu(), "nccl_hostid": os.environ.get("NCCL_HOSTID"),
            "device": str(dev)}


def gpu_present() -> bool:
    """Whether torch can use a CUDA GPU here, asked without initialising CUDA in this process
    (NVML, as ``PYTORCH_NVML_BASED_CUDA_CHECK`` does): ``torch.cuda.is_available()`` starts the
    driver, and a process forked after that cannot use CUDA, so code that runs at import (the
    launcher's fork server imports overlap before forking the ranks) asks this instead."""
    if not torch.cuda._is_compiled():
        return False
    count = torch.cuda._device_count_nvml()  # honours CUDA_VISIBLE_DEVICES; -1 without NVML
    if count >= 0:
        return count > 0
    return os.path.exists("/dev/nvidiactl")  # no NVML: the driver's device node


def rank_device() -> torch.device:
    """Under NCCL the GPU of this rank (``gpu_for_rank``), made the current CUDA device;
    ``cpu`` otherwise (gloo, the CPU twin)."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return gpu_for_rank()
    return torch.device("cpu")


def gpu_for_rank() -> torch.device:
    """``cuda:(LOCAL_RANK // ranks_per_gpu)`` (without LOCAL_RANK: the rank modulo the GPUs'
    room), made the current CUDA device; call it before NCCL's first op."""
    gpus, per_gpu = torch.cuda.device_count(), ranks_per_gpu()
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        world = os.environ.get("LOCAL_WORLD_SIZE")
        index = gpu_index(int(local), per_gpu=per_gpu, gpus=gpus,
                          local_world=int(world) if world else None)
    else:
        index = gpu_index(dist.get_rank() % (gpus * per_gpu), per_gpu=per_gpu, gpus=gpus)
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    return dev


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """Where a communicator over ``group`` keeps the tensors its collectives carry: the current
    CUDA device when the group is NCCL (which refuses host tensors), else the CPU."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def plain_gloo(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is plain gloo (not the nccl_twin): its receive of a message larger
    than it posted throws on gloo's transport thread and aborts the process, so a caller must
    agree sizes before data moves."""
    return type(group) is dist.ProcessGroup and dist.get_backend(group) == "gloo"
