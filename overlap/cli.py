"""Command lines generated from typed config dataclasses: one definition of every setting.

Each field becomes ``--field-name`` (a ``bool`` becomes ``--name/--no-name``); its metadata gives
``help``, optional ``choices`` and ``hidden`` (for test-only flags). ``parse`` validates the
result with the config's ``validate()`` and turns a bad value into a one-line error and exit
status 2, before anything starts (``overlap-train``, ``overlap-plan``, ``overlap-selftest``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

__all__ = ["field", "build_parser", "parse"]

T = TypeVar("T")


def field(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its help text (and ``choices=``, ``hidden=``) for the CLI."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def _arg_type(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def build_parser(cls: type, *, prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _arg_type(hints[f.name])
        help = (argparse.SUPPRESS if f.metadata.get("hidden")
                else f.metadata["help"] + f" (default: {f.default})")
        kw: dict[str, Any] = {"help": help, "default": f.default, "dest": f.name}
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = tp
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        p.add_argument("--" + f.name.replace("_", "-"), **kw)
    return p


def parse(cls: type[T], argv: list[str] | None, *, prog: str, description: str,
          errors: tuple[type[BaseException], ...] = (ValueError,)) -> T:
    """Parse ``argv`` into ``cls`` and validate; a bad value exits 2 with one line."""
    parser = build_parser(cls, prog=prog, description=description)
    cfg = cls(**vars(parser.parse_args(argv)))
    try:
        cfg.validate()
    except errors as exc:
        parser.exit(2, f"{prog}: error: {exc}\n")
    return cfg
