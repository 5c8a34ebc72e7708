"""Join the default process group from a launcher's environment (torchrun; RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), safely across torchrun's restarts.

torchrun keeps one store for the whole job: after ``--max-restarts`` restarts the workers, the
keys of the previous attempt's groups are still in it, and a group created under the same name
reads the dead processes' addresses (gloo: "connection refused" in the new attempt's very first
collective). ``init_from_env`` puts every key of an attempt under its own prefix
(``TORCHELASTIC_RESTART_COUNT``), so each attempt starts from an empty namespace.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from overlap.dist.device import apply_sharing

__all__ = ["init_from_env", "restart_attempt"]


def restart_attempt() -> int:
    """0 on the first run; k on torchrun's k-th restart of the workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def init_from_env(backend: str, *, timeout: float, ranks_per_gpu: int | None = None) -> dist.Store:
    """``init_process_group`` from the environment, its store keys prefixed by the attempt.
    Returns that attempt's store (``overlap.dist.heartbeat`` keeps its keys there). Ranks that
    share a GPU (``ranks_per_gpu``, default env OVERLAP_RANKS_PER_GPU) get their own NCCL
    host id first (overlap.dist.device.apply_sharing)."""
    apply_sharing(ranks_per_gpu)
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    # The agent hosts the store (TORCHELASTIC_USE_AGENT_STORE) or rank 0 does (plain env://).
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False)
    attempt = dist.PrefixStore(f"overlap/attempt{restart_attempt()}", store)
    dist.init_process_group(backend, store=attempt, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    return attempt
