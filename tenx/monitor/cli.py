"""`tenx status RUN_DIR`: a run's progress, newest verified checkpoint, goodput and events."""

from __future__ import annotations

import argparse
from typing import Any

from tenx.utils.cli import subcommand


def cmd_status(args: argparse.Namespace) -> None:
    """Print the run's status (tenx.monitor.status.format_status)."""
    from tenx.monitor.status import format_status

    print(format_status(args.run_dir, events_shown=args.events))


def _event_count(text: str) -> int | None:
    """`--events`: a positive number of events, or `all` (None)."""
    if text == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of events or 'all', got {text!r}")
    return n


def _status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory")
    p.add_argument(
        "--events",
        type=_event_count,
        default=5,
        metavar="N|all",
        help="list the last N events of events.jsonl, or all of them; every kind is counted either way",
    )


def register(subparsers: Any) -> None:
    """Register `tenx status` on the CLI's subparsers."""
    about = "progress, newest verified checkpoint, goodput and events of a run"
    subcommand(subparsers, "status", about, cmd_status, _status_arguments)
