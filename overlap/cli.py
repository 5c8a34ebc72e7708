"""Command lines generated from typed config dataclasses: one definition of every setting.

Each field becomes ``--field-name`` (a ``bool`` becomes ``--name/--no-name``); its metadata gives
``help``, ``metavar``, optional ``choices`` (matched in any case, ``-`` and ``_`` alike, plus
``aliases``: spelling -> choice) and ``hidden`` (for test-only flags). The help lists the flags
in titled groups, each default once, and the command's examples last. Every error is one line
and exit status 2 (argparse's own too: no usage block); ``parse`` validates the result with the
config's ``validate()`` before anything starts (overlap-train, -plan, -selftest, -analyze).
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import types
import typing
from typing import Any, Sequence, TypeVar

__all__ = ["field", "ArgumentParser", "build_parser", "parse"]

T = TypeVar("T")
_TYPE_METAVARS = {int: "N", float: "X", str: "TEXT"}


def field(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its help text (and ``metavar=``, ``choices=``, ``aliases=``,
    ``hidden=``) for the CLI."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``PROG: error: MESSAGE``, and exit status 2: a bad
    choice names the flag, the value and the choices; other errors point at --help."""

    def error(self, message: str) -> typing.NoReturn:
        hint = "" if "invalid choice" in message else f" (see {self.prog} --help)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


class _Flag(argparse.BooleanOptionalAction):
    """``--x/--no-x`` without the second "(default: ...)" Python 3.11-3.13 append to the help."""

    def __init__(self, *args: Any, help: str | None = None, **kw: Any) -> None:
        super().__init__(*args, help=help, **kw)
        self.help = help


def _fold(s: str) -> str:
    return s.strip().lower().replace("_", "-")


def _choice(choices: Sequence[str], aliases: dict[str, str]) -> Any:
    """argparse ``type`` that maps any accepted spelling to its choice, else names them all."""
    table = {_fold(c): c for c in choices} | {_fold(a): c for a, c in aliases.items()}
    listed = ", ".join(choices) + (f"; also {', '.join(aliases)}" if aliases else "")

    def convert(value: str) -> str:
        try:
            return table[_fold(value)]
        except KeyError:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {value!r} (choose from {listed}; any case)") from None

    return convert


def _arg_type(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _help(f: dataclasses.Field, tp: Any, note: str | None) -> str:
    text = f.metadata["help"]
    if tp is bool:
        text += f" (default: {'on' if f.default else 'off'})"
    elif f.default is not None and "default" not in text:  # some say it in their own words
        text += f" (default: {f.default})"
    if note:
        text += f"; {note}"
    return text.replace("%", "%%")


def build_parser(cls: type, *, prog: str, description: str,
                 groups: Sequence[tuple[str, Sequence[str]]] = (), epilog: str = "",
                 notes: dict[str, str] | None = None) -> ArgumentParser:
    """``groups``: (title, field names) in help order; other fields go under "other options".
    ``epilog``: shown verbatim after the flags (the examples). ``notes``: field -> a remark
    appended to its help."""
    p = ArgumentParser(prog=prog, usage="%(prog)s [options]",
                       description=textwrap.fill(description, 78, break_on_hyphens=False),
                       epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = {name: title for title, names in groups for name in names}
    unknown = sorted(set(where) - set(fields))
    if unknown:
        raise ValueError(f"cli.build_parser({cls.__name__}): groups name no field {unknown}")
    sections = {title: p.add_argument_group(title) for title, _ in groups}
    for f in fields.values():
        tp = _arg_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        hidden = f.metadata.get("hidden")
        kw: dict[str, Any] = {"default": f.default, "dest": f.name,
                              "help": argparse.SUPPRESS if hidden
                              else _help(f, tp, (notes or {}).get(f.name))}
        choices = f.metadata.get("choices")
        if tp is bool:
            kw["action"] = _Flag
        else:
            kw["type"] = tp
            kw["metavar"] = f.metadata.get("metavar", _TYPE_METAVARS.get(tp, "VALUE"))
            if choices is not None and tp is str:
                kw["type"] = _choice(choices, f.metadata.get("aliases", {}))
                listed = ",".join(choices)
                kw["metavar"] = f.metadata.get("metavar",
                                               "{" + listed + "}" if len(listed) <= 40 else "NAME")
                if "{" not in kw["metavar"] and not hidden:
                    kw["help"] += f" (one of: {', '.join(choices)})"
            elif choices is not None:
                kw["choices"] = choices
                kw["metavar"] = f.metadata.get("metavar",
                                               "{" + ",".join(map(str, choices)) + "}")
        title = where.get(f.name, "other options")
        if not hidden and title not in sections:
            sections[title] = p.add_argument_group(title)
        (p if hidden else sections[title]).add_argument(flag, **kw)
    return p


def parse(cls: type[T], argv: list[str] | None, *, prog: str, description: str,
          errors: tuple[type[BaseException], ...] = (ValueError,), **layout: Any) -> T:
    """Parse ``argv`` into ``cls`` and validate; a bad value exits 2 with one line.
    ``layout``: ``groups``, ``epilog`` and ``notes`` of :func:`build_parser`."""
    parser = build_parser(cls, prog=prog, description=description, **layout)
    cfg = cls(**vars(parser.parse_args(argv)))
    try:
        cfg.validate()
    except errors as exc:
        parser.exit(2, f"{prog}: error: {exc}\n")
    return cfg
