"""The package's structure, as a maintainer relies on it: one exception base for everything
overlap raises on purpose (``overlap.errors.OverlapError``), found by walking every class of
every module."""

import importlib
import inspect
import pkgutil

import pytest

import overlap
from overlap.errors import ConfigError, OverlapError

pytestmark = pytest.mark.no_delay_pass("imports and classes only")


def _modules():
    for info in pkgutil.walk_packages(overlap.__path__, "overlap."):
        yield importlib.import_module(info.name)


def test_every_project_exception_derives_from_overlap_error():
    found, outside = [], []
    for mod in _modules():
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == mod.__name__ and issubclass(cls, BaseException):
                found.append(f"{mod.__name__}.{cls.__name__}")
                if not issubclass(cls, OverlapError):
                    outside.append(found[-1])
    assert not outside, f"exceptions not derived from OverlapError: {outside}"
    assert len(found) >= 22  # the walk reached the whole package


def test_one_config_error_for_every_command_keeping_the_builtin_types():
    from overlap.selftest import config as selftest_config
    from overlap.symm.base import SignalTimeout
    from overlap.tp.comm import TPCommFailed
    from overlap.train import config as train_config

    assert selftest_config.ConfigError is train_config.ConfigError is ConfigError
    assert issubclass(ConfigError, ValueError)
    assert issubclass(SignalTimeout, TimeoutError) and issubclass(TPCommFailed, RuntimeError)
