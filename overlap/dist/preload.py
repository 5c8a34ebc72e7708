"""The fork server's preload, imported with Python's collector paused.

``overlap.dist.launch`` starts its fork server with this one module to preload and the list of
modules in ``OVERLAP_PRELOAD`` (set only while the server starts). Importing torch and the
layers allocates millions of objects that all live as long as the process, and the collector's
full passes over them were about 40% of the fork server's start-up CPU (3.2 s -> 1.9 s for the
main job's list on one core). Reference counting still frees what dies; the collector runs
again once the imports are done. A module that fails to import is skipped, as
``multiprocessing.forkserver`` does with its own list (the rank then imports it and fails).
"""

from __future__ import annotations

import gc
import importlib
import os


def _preload(names: str) -> None:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name in filter(None, names.split(",")):
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    finally:
        if was_enabled:
            gc.enable()


_preload(os.environ.get("OVERLAP_PRELOAD", ""))
