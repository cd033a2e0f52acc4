"""The `tenx` command's argparse machinery: parsers that add a subcommand's flags only when it is used,
help that shows every default, and the helpers that register a subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it or there is none
    (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, [], "", argparse.SUPPRESS)
            and "default" not in text.lower()
        ):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """A parser whose arguments may be added when it is first used (`defer`), so that building the whole
    CLI imports no component: `tenx status` does not import torch for the flags of `tenx ladder`."""

    _deferred: Callable[[argparse.ArgumentParser], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def defer(self, add_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
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


def command(
    subparsers: Any,
    name: str,
    help: str,
    func: Callable[[argparse.Namespace], None],
    add_arguments: Callable[[argparse.ArgumentParser], None],
) -> argparse.ArgumentParser:
    """Register subcommand `name` running `func`; `add_arguments(parser)` adds its flags when it is first
    used (at once on a plain argparse parser)."""
    parser = subparsers.add_parser(name, help=help)
    parser.set_defaults(func=func)
    if isinstance(parser, Parser):
        parser.defer(add_arguments)
    else:
        add_arguments(parser)
    return parser


def add_set(parser: argparse.ArgumentParser, help: str) -> None:
    """The repeatable `--set SECTION.KEY=VALUE` override."""
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help)
