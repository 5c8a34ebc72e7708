"""``overlap-selftest``: what this machine has, and whether every overlap path works on it.

    overlap-selftest                      # or: python -m overlap.selftest
    overlap-selftest --json selftest.json --world-size 4
    torchrun --nproc-per-node 8 -m overlap.selftest

Modules: config (SelftestConfig, the CLI generated from it), env (device, version and
interconnect detection), checks (each check against its reference), runner (local ranks or
torchrun; the per-rank loop), report (merging over ranks, the table, JSON), __main__.
"""

from overlap.selftest.config import SelftestConfig

__all__ = ["SelftestConfig"]
