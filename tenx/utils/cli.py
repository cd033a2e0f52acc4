"""How a `tenx` subcommand is registered: the one helper every package's `register(subparsers)` calls.

`subcommand` adds a subcommand whose flags are added when it is first used (`Parser.defer`), so building the
whole CLI imports no component: `tenx status` does not import torch for the flags of `tenx plan shapes`.
`Parser` also ends every option's help with its default (`DefaultsFormatter`). This module sits in the
lowest layer so that any package can register its own commands; tenx/cli.py only lists the packages.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

AddArguments = Callable[[argparse.ArgumentParser], None]
"""Adds a subcommand's flags (and, for a group such as `tenx data`, its own subcommands) to its parser."""


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it or there is none
    (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default is not None
            and default is not False  # by identity: a default of 0 or 0.0 is shown
            and default not in ([], "", argparse.SUPPRESS)
            and "default" not in text.lower()
        ):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """A parser whose arguments may be added when it is first used (`defer`): parsing, usage or help."""

    _deferred: AddArguments | None = None
    made_by_subcommand = False
    """True for the parser of a subcommand `subcommand` registered (tests/test_layers.py checks them all)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def defer(self, add_arguments: AddArguments) -> None:
        """Call `add_arguments(self)` when the parser is first used, not now."""
        self._deferred = add_arguments

    def _complete(self) -> None:
        if self._deferred is not None:
            add_arguments, self._deferred = self._deferred, None
            add_arguments(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._complete()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._complete()
        return super().format_usage()

    def format_help(self) -> str:
        self._complete()
        return super().format_help()


def subcommand(
    subparsers: Any,
    name: str,
    about: str,
    func: Callable[[argparse.Namespace], Any] | None,
    add_arguments: AddArguments,
) -> argparse.ArgumentParser:
    """Register subcommand `name` (its help and description `about`) running `func(args)`.

    `add_arguments(parser)` adds its flags when the subcommand is first used (at once on a plain argparse
    parser, as tests build). A group of subcommands (`tenx data`) has no `func`: its `add_arguments` adds
    the group's own subparsers and registers them with this helper in turn.
    """
    parser = subparsers.add_parser(name, help=about, description=about)
    if func is not None:
        parser.set_defaults(func=func)
    parser.made_by_subcommand = True  # type: ignore[attr-defined]
    if isinstance(parser, Parser):
        parser.defer(add_arguments)
    else:
        add_arguments(parser)
    return parser


Command = tuple[str, str, Callable[[argparse.Namespace], Any], AddArguments]
"""A subcommand as `subcommand` takes it: its name, its help, the function it runs and what adds its flags."""


def add_subcommands(
    parser: argparse.ArgumentParser, dest: str, commands: list[Command], *, required: bool = True
) -> None:
    """Give `parser` the subcommands `commands` (`tenx plan shapes`, `tenx plan failures`), each registered by
    `subcommand`; the name of the one given lands in `args.<dest>` (None when not `required` and none is)."""
    sub = parser.add_subparsers(dest=dest, required=required)
    for name, about, func, add_arguments in commands:
        subcommand(sub, name, about, func, add_arguments)


def command_group(subparsers: Any, name: str, about: str, commands: list[Command]) -> None:
    """Register `name` as a group of subcommands and nothing of its own (`tenx data prepare`, `tenx data
    index`); the subcommand given lands in `args.<name>_command`."""
    subcommand(subparsers, name, about, None, lambda p: add_subcommands(p, f"{name}_command", commands))


def add_set(parser: argparse.ArgumentParser, help: str) -> None:
    """The repeatable `--set SECTION.KEY=VALUE` override."""
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help)


def at_least(
    kind: Callable[[str], Any], minimum: float, maximum: float | None = None
) -> Callable[[str], Any]:
    """An argparse `type=` for a flag that takes a finite `kind` (int or float) >= `minimum` (and <= `maximum`
    when given): anything else is a usage error naming the flag (`argument --ranks: must be an integer >= 1,
    got '-3'`), exit status 2."""
    return _bounded(kind, minimum, maximum, strict=False)


def above(kind: Callable[[str], Any], minimum: float, maximum: float | None = None) -> Callable[[str], Any]:
    """An argparse `type=` for a flag that takes a finite `kind` (int or float) > `minimum` (see `at_least`)."""
    return _bounded(kind, minimum, maximum, strict=True)


def _bounded(
    kind: Callable[[str], Any], minimum: float, maximum: float | None, *, strict: bool
) -> Callable[[str], Any]:
    what = f"{'an integer' if kind is int else 'a number'} {'>' if strict else '>='} {minimum:g}"
    if maximum is not None:
        what += f" and <= {maximum:,g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or (value <= minimum if strict else value < minimum):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse's own messages name the type by it
    return parse
