"""``OverlapError``: the one base of every error overlap raises on purpose.

``except OverlapError`` catches whatever overlap refused or gave up on: a bad argument or
setting, a disagreement between ranks, a timeout, a dead peer, a failed communicator. Each
error also keeps the builtin type callers already catch (a timeout is a ``TimeoutError``, a
bad setting a ``ValueError``, a failure a ``RuntimeError``), and its own name where users catch
it (``TPCommFailed``, ``SignalTimeout``, ``Disagreement``, ...). ``ConfigError`` is the one
error of every command's settings (overlap-train, overlap-selftest). This module imports
nothing, so every layer may use it.
"""

from __future__ import annotations

__all__ = ["OverlapError", "ConfigError"]


class OverlapError(Exception):
    """Base of every error overlap raises on purpose."""


class ConfigError(OverlapError, ValueError):
    """A setting that cannot work; the message is one line naming the flag."""
