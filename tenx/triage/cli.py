"""The triage subcommands (`tenx incidents`, `tenx replay`, `tenx triage`): their flags and what they run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from tenx.utils.cli import at_least, subcommand


def cmd_incidents(args: argparse.Namespace) -> None:
    """Ingest the runs' events and print their incidents (a table, or JSON with --json)."""
    from tenx.triage.incident_store import format_incidents, list_incidents

    found = list_incidents(args.run_dirs, kinds=args.kind or None)
    if args.json:
        print(json.dumps([dataclasses.asdict(i) for i in found], indent=2))
    else:
        print(format_incidents(found, args.run_dirs))


def _incidents_arguments(p: argparse.ArgumentParser) -> None:
    from tenx.triage.incident_store import KINDS

    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    p.add_argument(
        "--kind",
        action="append",
        default=[],
        choices=KINDS,
        help="only incidents of this kind (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the incidents as a JSON list")


def cmd_replay(args: argparse.Namespace) -> None:
    """Rebuild the state before a step, run it again, compare with its record bit for bit."""
    from tenx.triage.replay import replay

    report = replay(args.run_dir, args.step, repeat=args.repeat)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--step", type=int, required=True, help="the step to replay")
    p.add_argument(
        "--repeat",
        type=at_least(int, 1, maximum=1000),
        default=2,
        help="times to run the step from the same state (default 2, at most 1000)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def cmd_triage(args: argparse.Namespace) -> None:
    """Verdicts for incidents (replay, bisection, checksums) and the root causes behind them."""
    from tenx.errors import TenxError
    from tenx.triage.classify import format_causes, format_incident, triage

    if args.incident is None and not args.all:
        raise TenxError(
            "tenx triage: name an incident (--incident ID; `tenx incidents RUN_DIR` lists them) or --all"
        )
    if args.incident is not None and len(args.run_dirs) != 1:
        raise TenxError("tenx triage --incident ID takes one RUN_DIR (incident ids are per run)")

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    incidents, causes, seconds = triage(args.run_dirs, args.incident, again=args.again, progress=progress)
    if args.json:
        print(
            json.dumps(
                {
                    "incidents": [dataclasses.asdict(i) for i in incidents],
                    "root_causes": [dataclasses.asdict(c) for c in causes],
                    "seconds": seconds,
                },
                indent=2,
            )
        )
    elif args.incident is not None:
        print(format_incident(incidents[0]))
    else:
        print(format_causes(incidents, causes))


def _triage_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (restarts included)")
    p.add_argument(
        "--incident",
        type=at_least(int, 1, maximum=2**63 - 1),
        help="triage this incident (an id of `tenx incidents`)",
    )
    p.add_argument(
        "--all", action="store_true", help="triage every incident, then group them into root causes"
    )
    p.add_argument("--again", action="store_true", help="triage incidents that already have a verdict again")
    p.add_argument("--json", action="store_true", help="print incidents and causes as JSON")
    p.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr (one per incident as it is triaged)"
    )


def register(subparsers: Any) -> None:
    """Register `tenx incidents`, `tenx replay` and `tenx triage` on the CLI's subparsers."""
    about = "list the incidents of runs: every anomaly in events.jsonl, kept in RUN_DIR/incidents.db"
    subcommand(subparsers, "incidents", about, cmd_incidents, _incidents_arguments)
    about = (
        "replay one step of a run exactly: reproduces, does not reproduce (transient), or differs (a race)"
    )
    subcommand(subparsers, "replay", about, cmd_replay, _replay_arguments)
    about = "find each incident's root cause (replay, numerics bisection, checksums) and group them"
    subcommand(subparsers, "triage", about, cmd_triage, _triage_arguments)
