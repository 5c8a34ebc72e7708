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
