"""`tenx dashboard` and `tenx report`: their flags and what they run."""

from __future__ import annotations

import argparse
from typing import Any

from tenx.utils.cli import above, subcommand
from tenx.utils.text import counted


def cmd_dashboard(args: argparse.Namespace) -> None:
    """Serve the runs' dashboard until Ctrl-C."""
    from tenx.monitor.dashboard.server import serve

    serve(args.run_dirs, bind=args.bind, refresh_s=args.refresh)


def cmd_report(args: argparse.Namespace) -> None:
    """Write the runs' dashboard as one self-contained HTML file."""
    from tenx.monitor.dashboard.page import write_report

    path = write_report(args.run_dirs, args.output, force=args.force)
    size = path.stat().st_size / 2**20
    print(f"wrote {path} ({counted(len(args.run_dirs), 'run')}, {size:.1f} MB; opens offline in any browser)")


def _add_run_dirs(p: argparse.ArgumentParser) -> None:
    """The runs the dashboard and the report draw."""
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, overlaid on the same charts"
    )


def _dashboard_arguments(p: argparse.ArgumentParser) -> None:
    from tenx.monitor.dashboard.server import DEFAULT_BIND

    _add_run_dirs(p)
    p.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="HOST:PORT",
        help="where to listen; port 0 picks a free one. Another address than loopback lets anyone who "
        "reaches it read the runs (docs/security.md)",
    )
    p.add_argument(
        "--refresh",
        type=above(float, 0, maximum=86400),
        default=5.0,
        metavar="SECONDS",
        help="how often the page re-reads the runs (at most a day)",
    )


def _report_arguments(p: argparse.ArgumentParser) -> None:
    _add_run_dirs(p)
    p.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="the HTML file to write, e.g. report.html"
    )
    p.add_argument(
        "--force", action="store_true", help="replace FILE even if it is not an earlier tenx report"
    )


def register(subparsers: Any) -> None:
    """Register `tenx dashboard` and `tenx report` on the CLI's subparsers."""
    about = "a live web page of runs: loss and prediction band, statistics, throughput, goodput, events"
    subcommand(subparsers, "dashboard", about, cmd_dashboard, _dashboard_arguments)
    about = "write the dashboard of runs as one self-contained HTML file that opens offline"
    subcommand(subparsers, "report", about, cmd_report, _report_arguments)
