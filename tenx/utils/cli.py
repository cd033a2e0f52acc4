"""Registering a `tenx` subcommand from the module that implements it (below tenx.cli in the layers)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def subcommand(
    subparsers: Any,
    name: str,
    about: str,
    func: Callable[[argparse.Namespace], None],
    add: Callable[..., None],
) -> argparse.ArgumentParser:
    """Register subcommand `name` running `func`; `add(parser)` adds its flags, when the subcommand is used
    if the parser can defer them (tenx.cli_parsing.Parser), at once otherwise."""
    parser = subparsers.add_parser(name, help=about, description=about)
    parser.set_defaults(func=func)
    if hasattr(parser, "defer"):
        parser.defer(add)
    else:
        add(parser)
    return parser
