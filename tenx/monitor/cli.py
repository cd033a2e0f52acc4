"""`tenx status RUN_DIR`: a run's progress, newest verified checkpoint, goodput and events."""

from __future__ import annotations

import argparse
from typing import Any

from tenx.utils.cli import subcommand


def cmd_status(args: argparse.Namespace) -> None:
    """Print the run's status (tenx.monitor.goodput.format_status)."""
    from tenx.monitor.goodput import format_status

    print(format_status(args.run_dir))


def _status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory")


def register(subparsers: Any) -> None:
    """Register `tenx status` on the CLI's subparsers."""
    about = "progress, newest verified checkpoint, goodput and events of a run"
    subcommand(subparsers, "status", about, cmd_status, _status_arguments)
