"""Run a function on N local ranks: the engine behind the test harness, the benchmarks and the
CPU mode of ``python -m overlap.train``.

``launch(fn, world_size)`` starts one process per rank, joins them into a ``torch.distributed``
process group (gloo on CPU) through a TCPStore that the launcher owns, runs
``fn(*args, **kwargs)`` on every rank and returns the per-rank results in rank order. A rank
that raises: its exception and traceback reach the caller within ``grace`` seconds. A rank that
dies without reporting: reported with its exit code. A rank that hangs: killed at ``timeout``,
its Python stack in the error. Then the other ranks are killed, and nothing outlives the call:
every rank process is joined, every ``/dev/shm`` segment a rank created is unlinked and reported.

The narrative: docs/design/dist.md.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Literal, Sequence

from overlap.defaults import positive_int, positive_seconds
from overlap.dist import run_stats
from overlap.dist.device import RANKS_PER_GPU_ENV, sharing_env
from overlap.dist.device import ranks_per_gpu as per_gpu_setting
from overlap.errors import OverlapError

__all__ = ["launch", "LaunchError", "RankOutcome", "leaked_shm_segments"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "overlap_"
_PRELOAD = ["torch", "torch.distributed", "overlap", "overlap._C", "overlap.dist.launch",
            "overlap.dist.nccl_twin"]
_preload_set = False

Status = Literal["ok", "error", "died", "hung", "aborted"]


@dataclasses.dataclass(slots=True)
class RankOutcome:
    """What happened on one rank. ``status`` is ok, error (raised), died (exited without
    reporting), hung (still running at the timeout) or aborted (killed after a peer failed)."""

    rank: int
    status: Status
    value: Any = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    seconds: float = 0.0
    finished_at: float = 0.0  # wall clock (time.time()) when the rank finished or was found failed


class LaunchError(OverlapError, RuntimeError):
    """One or more ranks failed. ``outcomes`` holds every rank's RankOutcome."""

    def __init__(self, message: str, outcomes: list[RankOutcome]):
        super().__init__(message)
        self.outcomes = outcomes


def shm_segments_of(pids: Sequence[int]) -> list[str]:
    """Names of /dev/shm segments created by any of these pids (``overlap_<pid>_...``)."""
    wanted = {f"{SHM_PREFIX}{pid}_" for pid in pids}
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if any(n.startswith(w) for w in wanted))


def leaked_shm_segments() -> list[str]:
    """Every /dev/shm segment whose name says overlap, whoever created it."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX))
    except FileNotFoundError:
        return []


def orphaned_shm_segments() -> list[str]:
    """The overlap /dev/shm segments whose creator (the pid in the name) has exited: leaks.
    A live creator's segment may be in use by a run beside this one (concurrent tests)."""
    from overlap.dist.host import pid_alive

    def alive(name: str) -> bool:
        try:
            return pid_alive(int(name[len(SHM_PREFIX):].split("_")[0]))
        except (IndexError, ValueError):
            return False

    return [n for n in leaked_shm_segments() if not alive(n)]


def _watch_launcher(launcher_pid: int, deadline: float) -> None:
    # A rank must not outlive its launcher (e.g. pytest killed with SIGKILL) nor its hard deadline.
    while True:
        time.sleep(0.5)
        gone = False
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:
            gone = True
        if gone or time.monotonic() > deadline:
            os._exit(113)


def _rank_main(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    rank: int,
    world_size: int,
    store_port: int,
    backend: str,
    env: dict[str, str],
    conn: mp.connection.Connection,
    stack_path: str,
    timeout: float,
    launcher_pid: int,
    num_threads: int,
) -> None:
    t_enter = time.time()  # forked and unpickled (the test module imported)
    # What the fork server preloaded (torch, overlap) lives as long as the rank: out of the
    # collector's reach, so that its full collections do not walk it (nor copy its pages).
    gc.freeze()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port),
    )
    # Ranks sharing a GPU: each its own NCCL host id (launch put the count in env).
    os.environ.update(sharing_env(rank, int(env[RANKS_PER_GPU_ENV])))
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(
        target=_watch_launcher, args=(launcher_pid, time.monotonic() + timeout + 30), daemon=True
    ).start()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    t0 = time.monotonic()
    try:
        if backend == "nccl" and torch.cuda._is_in_bad_fork():
            raise RuntimeError(
                "launch: this rank cannot use CUDA: CUDA was initialised in the launcher's fork "
                "server before the rank was forked ('Cannot re-initialize CUDA in forked "
                "subprocess'); a module of the fork server's preload list touches CUDA at import "
                "(ask overlap.dist.device.gpu_present() there; tests/test_forkserver_cuda.py "
                "names the module)")
        if backend == "nccl_twin":
            from overlap.dist import nccl_twin

            nccl_twin.register()
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        t_ready = time.time()
        value = fn(*args, **kwargs)
        run_stats.write(kind="rank", rank=rank, enter=t_enter, ready=t_ready, done=time.time())
        msg: tuple = ("ok", value, None, None, time.monotonic() - t0, time.time())
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        msg = ("error", None, f"{type(exc).__name__}: {exc}", traceback.format_exc(),
               time.monotonic() - t0, time.time())
    # Plain pickle, not the connection's ForkingPickler: that one ships tensors as shared-memory
    # file descriptors, which die with this process before the launcher reads them.
    try:
        payload = pickle.dumps(msg)
    except Exception as exc:  # the result itself may not pickle
        payload = pickle.dumps(("error", None, f"rank {rank}: result could not be sent: {exc!r}",
                                None, time.monotonic() - t0, time.time()))
    conn.send_bytes(payload)
    if msg[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    conn.close()
    stack_file.close()
    # Skip interpreter teardown: a failed rank may hold threads blocked in gloo.
    os._exit(0)


def _context(preload: Sequence[str]) -> mp.context.BaseContext:
    # The fork server starts once per launcher process; what it preloads is fixed then. No
    # preload module may initialise CUDA (a rank forked after that cannot use it): they ask
    # overlap.dist.device.gpu_present(), and tests/test_forkserver_cuda.py checks every list.
    global _preload_set
    ctx = mp.get_context("forkserver")
    if not _preload_set:
        # One module, overlap.dist.preload, imports the list with the collector paused; the
        # list reaches the server in its environment, set only while it starts.
        ctx.set_forkserver_preload(["overlap.dist.preload"])
        os.environ["OVERLAP_PRELOAD"] = ",".join(dict.fromkeys([*_PRELOAD, *preload]))
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            del os.environ["OVERLAP_PRELOAD"]
        _preload_set = True
    return ctx


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 120.0,
    grace: float = 3.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    num_threads: int = 1,
    raise_on_error: bool = True,
    preload: Sequence[str] = (),
    ranks_per_gpu: int | None = None,
) -> list[Any] | list[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks and return their results.

    ``fn`` and its arguments must be picklable (a module-level function). Inside ``fn`` the
    default process group is initialised and ``RANK``/``WORLD_SIZE``/``LOCAL_*`` are set.
    With ``raise_on_error`` (default) a failure raises LaunchError naming the failing ranks with
    their tracebacks; otherwise the list of RankOutcome is returned whatever happened.
    ``preload`` names extra modules the fork server imports once (it only matters on the first
    launch of this process), so that ranks do not each pay for importing them.
    """
    positive_int(world_size, "launch: world_size")
    positive_seconds(timeout, "launch: timeout")
    import torch.distributed as dist

    kwargs = kwargs or {}
    child_env = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    child_env.update(env or {})
    # ranks_per_gpu, else env's entry, else this process's environment (per_gpu_setting)
    per_gpu = ranks_per_gpu if ranks_per_gpu is not None else child_env.get(RANKS_PER_GPU_ENV)
    child_env[RANKS_PER_GPU_ENV] = str(per_gpu_setting(per_gpu, what="launch: ranks_per_gpu"))
    launch_id = f"{os.getpid()}-{time.monotonic_ns()}"
    child_env["OVERLAP_LAUNCH_ID"] = launch_id
    ctx = _context(preload)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    tmpdir = tempfile.TemporaryDirectory(prefix="overlap_launch_")
    procs: list[mp.process.BaseProcess] = []
    pids: list[int] = []
    conns: list[mp.connection.Connection] = []
    outcomes: list[RankOutcome | None] = [None] * world_size
    t_start, t_wall, t_started = time.monotonic(), time.time(), None
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            stack_path = os.path.join(tmpdir.name, f"stack{rank}.txt")
            p = ctx.Process(
                target=_rank_main,
                args=(fn, args, kwargs, rank, world_size, store.port, backend, child_env,
                      child_conn, stack_path, timeout, os.getpid(), num_threads),
                name=f"overlap-rank{rank}",
                daemon=True,
            )
            p.start()
            pids.append(p.pid)
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)
        t_started = time.time()
        _collect(procs, conns, outcomes, t_start, timeout, grace, tmpdir.name)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
            p.close()
        for c in conns:
            c.close()
        leaked = shm_segments_of(pids)
        for name in leaked:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
        del store
        tmpdir.cleanup()
        run_stats.write(kind="launch", launch=launch_id, world=world_size, start=t_wall,
                        started=t_started, end=time.time(),
                        test=os.environ.get("PYTEST_CURRENT_TEST", ""))

    final = [o for o in outcomes if o is not None]
    failed = [o for o in final if o.status != "ok"]
    if leaked and not failed:
        # Every rank returned normally, so nothing had an excuse to leave a segment behind.
        raise LaunchError(f"launch: ranks returned but left /dev/shm segments {leaked} "
                          "(removed now); something skips close()", final)
    if not raise_on_error:
        return final
    if failed:
        raise LaunchError(_describe(failed, world_size, timeout), final)
    return [o.value for o in final]


def _collect(procs, conns, outcomes, t_start, timeout, grace, stack_dir) -> None:
    deadline = t_start + timeout
    first_failure: float | None = None
    pending = set(range(len(procs)))
    by_obj: dict[Any, int] = {}
    for r in pending:
        by_obj[conns[r]] = r
        by_obj[procs[r].sentinel] = r
    while pending:
        now = time.monotonic()
        limit = deadline if first_failure is None else min(deadline, first_failure + grace)
        if now >= limit:
            break
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = mp.connection.wait(waitables, timeout=limit - now)
        for obj in ready:
            r = by_obj[obj]
            if r not in pending:
                continue
            outcome = _receive(r, conns[r], procs[r], time.monotonic() - t_start)
            if outcome is None:
                continue
            outcomes[r] = outcome
            pending.discard(r)
            if outcome.status != "ok" and first_failure is None:
                first_failure = time.monotonic()
    if pending:
        hung_status: Status = "hung" if first_failure is None else "aborted"
        for r in pending:
            if procs[r].is_alive():
                os.kill(procs[r].pid, signal.SIGUSR1)
        time.sleep(0.3)
        for r in sorted(pending):
            # The rank may have reported in the meantime.
            late = _receive(r, conns[r], procs[r], time.monotonic() - t_start)
            if late is not None:
                outcomes[r] = late
                continue
            stack = ""
            try:
                with open(os.path.join(stack_dir, f"stack{r}.txt")) as f:
                    stack = f.read()
            except OSError:
                pass
            outcomes[r] = RankOutcome(
                rank=r, status=hung_status, traceback=stack or None,
                error=(f"still running after {timeout:.0f}s" if hung_status == "hung"
                       else "killed after a peer failed"),
                seconds=time.monotonic() - t_start, finished_at=time.time(),
            )


def _receive(rank, conn, proc, elapsed) -> RankOutcome | None:
    """The rank's outcome if it has reported or exited, else None (still running)."""
    if conn.poll():
        try:
            status, value, error, tb, secs, at = pickle.loads(conn.recv_bytes())
            return RankOutcome(rank=rank, status=status, value=value, error=error, traceback=tb,
                               seconds=secs, finished_at=at)
        except (EOFError, OSError):
            pass  # the pipe closed without a message: the rank died before reporting
    elif proc.is_alive():
        return None
    proc.join(timeout=5)
    return RankOutcome(rank=rank, status="died", exitcode=proc.exitcode, seconds=elapsed,
                       finished_at=time.time(),
                       error=f"exited with code {proc.exitcode} without reporting a result")


def _describe(failed: list[RankOutcome], world_size: int, timeout: float) -> str:
    # A rank that died is almost always the root cause; otherwise the first error is, and the
    # errors of its peers ("connection closed by peer") follow from it.
    order = {"died": 0, "error": 1, "hung": 2, "aborted": 3}
    failed = sorted(failed, key=lambda o: (order[o.status], o.finished_at))
    hung = [o.rank for o in failed if o.status == "hung"]
    head = []
    if hung:
        head.append(f"ranks {hung} of {world_size} hung past the {timeout:.0f}s timeout")
    errs = [o.rank for o in failed if o.status in ("error", "died")]
    if errs:
        head.append(f"ranks {errs} of {world_size} failed")
    parts = ["; ".join(head)]
    for o in failed:
        parts.append(f"--- rank {o.rank}: {o.status}: {o.error}")
        if o.traceback:
            parts.append(o.traceback.rstrip())
    return "\n".join(parts)
