"""The multi-process test harness: run a test body on N local gloo ranks.

Every distributed test calls ``run_ranks(fn, world_size, ...)``. ``fn`` must be a module-level
function of the test module (it is pickled by reference into each rank). It runs with the
default process group initialised; what it returns on each rank comes back as a list.

On failure pytest sees one error that names the failing ranks and shows their tracebacks; a
hanging rank is killed at ``timeout`` and its Python stack is shown. Rank processes, threads and
``/dev/shm`` segments never outlive the call (``overlap.dist.launch`` guarantees it, and the
autouse fixture in conftest.py checks it after every test).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest

from overlap.dist.device import gpu_present
from overlap.dist.launch import LaunchError, RankOutcome, launch, orphaned_shm_segments

__all__ = ["run_ranks", "run_ranks_outcomes", "requires_gpu", "LaunchError", "RankOutcome",
           "WORLD_SIZES", "shm_leaks_since", "gpu_world"]

# GPU-only tests carry this mark. Each has a CPU twin that runs the same logic on gloo / shared
# memory / the Triton interpreter, so nothing is untested here. Asked without initialising CUDA:
# the launcher's fork server imports this module before it forks the ranks.
_skip_without_gpu = pytest.mark.skipif(not gpu_present(),
                                       reason="needs a CUDA GPU; its CPU twin runs here")


def requires_gpu(test):
    """A GPU-only test: marked ``gpu`` (``pytest -m gpu`` selects them: tools/gpu_check.py)
    and skipped where torch sees no GPU."""
    return pytest.mark.gpu(_skip_without_gpu(test))

def without_gpus(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that sees no GPU (``CUDA_VISIBLE_DEVICES`` empty: torch
    and NVML find none), so a test of the CPU-only paths and errors runs on a GPU machine too
    instead of being skipped there."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", **extra)


# The transport of every CPU test: gloo with NCCL's ordering rules (overlap.dist.nccl_twin), so
# an order that would deadlock on NCCL fails here too. OVERLAP_TEST_BACKEND=gloo opts out.
CPU_BACKEND = os.environ.get("OVERLAP_TEST_BACKEND", "nccl_twin")

WORLD_SIZES = (1, 2, 4)


def gpu_world(least: int = 2, most: int = 4) -> int:
    """Ranks a GPU test starts: every visible GPU times OVERLAP_RANKS_PER_GPU (launch puts rank
    r on GPU r // ranks_per_gpu), at most ``most``; skips when fewer than ``least`` fit, naming
    the setting that would make room (one GPU runs the multi-rank tests at 2 per GPU)."""
    import torch

    from overlap.dist.device import RANKS_PER_GPU_ENV, ranks_per_gpu

    gpus = torch.cuda._device_count_nvml()  # no CUDA initialised in the test process
    gpus = gpus if gpus >= 0 else torch.cuda.device_count()
    room = gpus * ranks_per_gpu()
    if room < least:
        pytest.skip(f"needs {least} ranks, {gpus} GPU(s) at {ranks_per_gpu()} per GPU give "
                    f"{room}: set {RANKS_PER_GPU_ENV}={-(-least // max(gpus, 1))}")
    return min(room, most)
# Imported once by the fork server instead of by every rank of every test.
_PRELOAD = ("pytest", "numpy", "harness", "overlap.dist.nccl_twin", "overlap.kernels.triton.tp_gemm", "overlap.tp",
            "overlap.nn", "overlap.models", "overlap.moe", "overlap.cp", "overlap.pp", "overlap.dp",
            "torch._dynamo", "torch.distributed.tensor.parallel", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2")
DEFAULT_TIMEOUT = 60.0


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
              env: dict[str, str] | None = None, backend: str | None = None,
              **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results.
    ``backend`` defaults to CPU_BACKEND; ``backend="nccl"`` is for GPU-only tests."""
    try:
        return launch(fn, world_size, args=args, kwargs=kwargs, timeout=timeout, env=env,
                      backend=backend or CPU_BACKEND, preload=_PRELOAD)
    except LaunchError as exc:
        # Re-raise without the launcher's frames: the ranks' tracebacks are in the message.
        raise LaunchError(str(exc), exc.outcomes) from None


def run_ranks_outcomes(fn: Callable[..., Any], world_size: int, *args: Any,
                       timeout: float = DEFAULT_TIMEOUT, grace: float = 3.0,
                       backend: str | None = None, **kwargs: Any) -> list[RankOutcome]:
    """Like run_ranks, but returns every rank's RankOutcome instead of raising, for tests
    that expect failures (a killed peer, a timeout)."""
    return launch(fn, world_size, args=args, kwargs=kwargs, timeout=timeout, grace=grace,
                  raise_on_error=False, backend=backend or CPU_BACKEND, preload=_PRELOAD)


def last_rank_fails_during(kind: str, timeout: float, call: Callable[[], Any]):
    """Run ``call`` once on every rank, then again with the last rank gone: ``kind`` "dead"
    (it exits) or "stalled" (alive, but it never calls). The others return (seconds until
    ``call`` returned or raised, "ExcType: message" or "returned"); the last rank None."""
    import time

    import torch.distributed as dist

    call()  # one good call first
    dist.barrier()
    if dist.get_rank() == dist.get_world_size() - 1:
        if kind == "dead":
            os._exit(3)
        time.sleep(timeout * 3)
        return None
    time.sleep(0.2)
    t0 = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - t0, "returned"


def fail_signals_then_call(mode: str, stall_s: float, call: Callable[[], Any]) -> None:
    """On this rank, make every userbuffer signal fail as a broken peer would (``mode``
    "kill": the process exits at its first signal; "stall": each signal hangs ``stall_s``
    seconds and is never stored), then run ``call``, ignoring what it raises."""
    import time

    from overlap.symm.shm import ShmWorkspace

    def failing_signal(self, peer, slot, value):
        if mode == "kill":
            os._exit(3)
        time.sleep(stall_s)

    ShmWorkspace.signal = failing_signal
    try:
        call()
    except Exception:  # noqa: BLE001 - the peers' outcomes are what the tests check
        pass


def shm_leaks_since(before: set[str], settle_s: float = 6.0) -> list[str]:
    """/dev/shm segments orphaned (creator exited) that were not orphaned at ``before``
    (``set(orphaned_shm_segments())``). Tests run concurrently (pytest-xdist): a segment of a
    rank that another test killed is orphaned until its own launcher removes it, within that
    launcher's grace, so a segment counts as leaked only if it is still there after
    ``settle_s``."""
    import time

    leaked = set(orphaned_shm_segments()) - before
    deadline = time.monotonic() + settle_s
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked &= set(orphaned_shm_segments())
    return sorted(leaked)
