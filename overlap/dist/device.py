"""The device a rank computes on: its GPU when the default process group is NCCL, else CPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["rank_device"]


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
