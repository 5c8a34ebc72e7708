import multiprocessing
import os

import pytest

from overlap.dist.launch import leaked_shm_segments
from overlap.dist.host import pid_alive as _pid_alive


def _creator_alive(name: str) -> bool:
    try:
        pid = int(name.split("_")[1])
    except (IndexError, ValueError):
        return False
    return _pid_alive(pid)


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no rank processes and no overlap /dev/shm segments behind."""
    before = set(leaked_shm_segments())
    yield
    children = [p for p in multiprocessing.active_children() if p.name.startswith("overlap-rank")]
    # Only segments whose creator has exited: another pytest session on the machine may be
    # using its own segments right now.
    leaked = sorted(n for n in set(leaked_shm_segments()) - before if not _creator_alive(n))
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
