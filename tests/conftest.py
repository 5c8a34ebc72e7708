import multiprocessing
import os

import pytest

from harness import shm_leaks_since
from overlap.dist.launch import orphaned_shm_segments


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


# -- order: the longest files first (tests/durations.json, seconds per file of a serial run), so
# that run concurrently (the README's command: pytest-xdist) the last tests to start are short
# ones and no worker is left alone with a long tail. Within a file the order is kept. A file
# without an entry counts as a minute: new files run early, where a slow one costs least.
def pytest_collection_modifyitems(config, items):
    import json

    path = os.path.join(os.path.dirname(__file__), "durations.json")
    try:
        with open(path) as f:
            seconds = json.load(f)["seconds_per_file"]
    except (OSError, ValueError, KeyError):
        return
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path.name, i)
    items.sort(key=lambda item: (-seconds.get(item.path.name, 60.0), first[item.path.name]))
