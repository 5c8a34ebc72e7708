import gc
import multiprocessing
import os

# Before torch and numpy start their thread pools: an idle OpenMP thread sleeps instead of
# spinning. Three workers share two cores, and a thread spinning in one worker's reference
# computation took CPU from another test's ranks (about 4% of the suite's CPU).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS threads spin the same way

import pytest  # noqa: E402

from harness import shm_leaks_since  # noqa: E402
from overlap.dist.launch import orphaned_shm_segments  # noqa: E402


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no rank processes and no overlap /dev/shm segments behind."""
    before = set(orphaned_shm_segments())
    yield
    children = [p for p in multiprocessing.active_children() if p.name.startswith("overlap-rank")]
    # Only segments whose creator has exited, and still there after the settling time: the
    # other workers' tests (pytest-xdist), or another session, may be using theirs right now.
    leaked = shm_leaks_since(before)
    for name in leaked:
        os.unlink(os.path.join("/dev/shm", name))
    assert not children, f"rank processes outlived the test: {children}"
    assert not leaked, f"/dev/shm segments outlived the test (removed now): {leaked}"


# -- order: tests/durations.json has each file's seconds in a serial run and which files keep
# the cores busy (end-to-end jobs, compiles) rather than wait (on peers, timeouts, stalls they
# provoke). Run concurrently (the README's command: pytest-xdist, 3 workers), the two kinds are
# interleaved in proportion to their totals, so that waiting tests run beside busy ones instead
# of after them, and within each kind the longest files come first, so that no worker is left
# alone with a long tail. Within a file the order is kept. A file without an entry counts as
# 5 s of waiting.
def pytest_collection_modifyitems(config, items):
    import json

    path = os.path.join(os.path.dirname(__file__), "durations.json")
    try:
        with open(path) as f:
            doc = json.load(f)
        seconds, busy = doc["seconds_per_file"], set(doc.get("cpu_bound", ()))
    except (OSError, ValueError, KeyError):
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.path.name, []).append(item)
    streams = [sorted((f for f in files if (f in busy) == kind),
                      key=lambda f: -seconds.get(f, 5.0)) for kind in (True, False)]
    totals = [sum(seconds.get(f, 5.0) for f in s) or 1.0 for s in streams]
    done, order = [0.0, 0.0], []
    while any(streams):
        k = min((i for i in (0, 1) if streams[i]), key=lambda i: done[i] / totals[i])
        f = streams[k].pop(0)
        done[k] += seconds.get(f, 5.0)
        order += files[f]
    items[:] = order


# What collection imported (torch, transformers, every test module) lives for the session: out
# of the collector's reach, so its full passes do not walk it after every few tests. Given back
# at the end, so that the interpreter's exit frees it as usual.
def pytest_collection_finish(session):
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()
