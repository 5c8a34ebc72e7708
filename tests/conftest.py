import multiprocessing
import os

import pytest

from overlap.dist.launch import leaked_shm_segments


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no rank processes and no overlap /dev/shm segments behind."""
    before = set(leaked_shm_segments())
    yield
    children = [p for p in multiprocessing.active_children() if p.name.startswith("overlap-rank")]
    leaked = sorted(set(leaked_shm_segments()) - before)
    for name in leaked:
        os.unlink(os.path.join("/dev/shm", name))
    assert not children, f"rank processes outlived the test: {children}"
    assert not leaked, f"/dev/shm segments outlived the test (removed now): {leaked}"
