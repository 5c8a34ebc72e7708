"""The device a rank computes on: its GPU when the default process group is NCCL, else CPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["rank_device", "comm_device", "gpu_present", "plain_gloo"]


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
    """``cuda:LOCAL_RANK`` (or ``rank % device_count`` without LOCAL_RANK) under NCCL, made the
    current CUDA device; ``cpu`` otherwise (gloo, the CPU twin)."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        local = os.environ.get("LOCAL_RANK")
        index = int(local) if local is not None else dist.get_rank() % torch.cuda.device_count()
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


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
