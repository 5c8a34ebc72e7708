"""Helpers of the tests that run the main job as users do (``python -m overlap.train`` by
``sys.executable``): run it, read its per-step losses and --check differences, read a saved
DCP checkpoint back as plain tensors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import torch

__all__ = ["run_train", "check_diffs", "step_losses", "read_checkpoint"]


def run_train(args, *, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "overlap.train", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def check_diffs(out: str) -> list[float]:
    """The |diff| column of --check's table."""
    return [float(d) for d in re.findall(r"^ +\d+ +[\d.]+ +[\d.]+ +([\d.e+-]+)$", out, re.M)]


def step_losses(out: str) -> dict[int, str]:
    """Step number -> the loss as printed by the progress rows."""
    return {int(s): loss for s, loss in re.findall(r"^step +(\d+)/\d+ .* loss +([\d.]+)", out,
                                                   re.M)}


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint directory, unsharded, without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    md = reader.read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype)
          for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd
