"""`tenx lighthouse --bind ADDR:PORT`: run torchft's lighthouse, the rendezvous of replica groups.

Its flags besides `--bind` are generated from LighthouseConfig's fields (tenx/parallel/lighthouse.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from tenx.config import add_config_arguments
from tenx.utils.cli import subcommand

LIGHTHOUSE_FLAGS = ("min_groups", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms")
"""The LighthouseConfig fields `tenx lighthouse` takes as flags."""


def cmd_lighthouse(args: argparse.Namespace) -> None:
    """Serve the lighthouse until stopped."""
    from tenx.parallel.lighthouse import run_lighthouse

    run_lighthouse(args.bind, **{name: getattr(args, name) for name in LIGHTHOUSE_FLAGS})


def _lighthouse_arguments(lp: argparse.ArgumentParser) -> None:
    from tenx.parallel.lighthouse import LighthouseConfig

    lp.add_argument(
        "--bind",
        required=True,
        metavar="ADDR:PORT",
        help="where to listen: 127.0.0.1:PORT for one machine, ADDR:PORT with this machine's address on "
        "the network the groups share otherwise (0.0.0.0:PORT listens on every interface; docs/security.md)",
    )
    add_config_arguments(lp, LighthouseConfig, LIGHTHOUSE_FLAGS, show_defaults=True)


def register(subparsers: Any) -> None:
    """Register `tenx lighthouse` on the CLI's subparsers."""
    about = "run torchft's lighthouse: the rendezvous of replica groups (parallel.replicas)"
    subcommand(subparsers, "lighthouse", about, cmd_lighthouse, _lighthouse_arguments)
