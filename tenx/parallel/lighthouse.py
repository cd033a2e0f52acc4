"""`tenx lighthouse`: torchft's lighthouse, the rendezvous that forms quorums of live replica groups.

Every replica group's manager heartbeats to the lighthouse and asks it for a quorum at each sync point;
the lighthouse answers with the groups alive at that moment (a group silent for `heartbeat_timeout_ms` is
dead) once at least `min_groups` have asked. It holds no training state: restarting it costs the groups
one quorum round, not their progress.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from tenx.errors import TenxError


def parse_bind(bind: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[V6ADDR]:PORT`) -> (host, port); a clear error otherwise."""
    host, sep, port_text = bind.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise TenxError(
            f"lighthouse --bind {bind!r}: expected ADDR:PORT with a port in [0, 65536), "
            "e.g. 127.0.0.1:29510 (this host only) or 10.0.0.5:29510 (one interface of this host)"
        )
    if host.startswith("[") != host.endswith("]"):
        raise TenxError(f"lighthouse --bind {bind!r}: an IPv6 address goes in brackets, e.g. [::1]:29510")
    return host, int(port_text)


def start_lighthouse(
    bind: str,
    min_groups: int = 1,
    join_timeout_ms: int = 60_000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5_000,
) -> tuple[Any, str]:
    """Start a lighthouse in this process; returns (server, address to give the groups)."""
    from torchft._torchft import LighthouseServer

    host, _ = parse_bind(bind)
    for name, value in (
        ("--min-groups", min_groups),
        ("--join-timeout-ms", join_timeout_ms),
        ("--quorum-tick-ms", quorum_tick_ms),
        ("--heartbeat-timeout-ms", heartbeat_timeout_ms),
    ):
        if value < 1:
            raise TenxError(f"lighthouse {name}: must be >= 1, got {value}")
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=min_groups,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except Exception as e:  # noqa: BLE001 - the Rust server reports bind failures as plain exceptions
        raise TenxError(f"lighthouse --bind {bind!r}: cannot listen there: {e}") from e
    port = server.address().rpartition(":")[2]
    # A wildcard bind is reachable under the machine's name (torchft's own address); a specific one as is.
    advertised = server.address() if host in ("0.0.0.0", "[::]") else f"http://{host}:{port}"
    return server, advertised


def run_lighthouse(
    bind: str,
    min_groups: int = 1,
    join_timeout_ms: int = 60_000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5_000,
) -> None:
    """Run a lighthouse until SIGINT or SIGTERM, printing the address groups connect to."""
    server, address = start_lighthouse(
        bind, min_groups, join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms
    )
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"tenx lighthouse: serving on {bind}; groups connect with", flush=True)
        if parse_bind(bind)[0] in ("0.0.0.0", "[::]"):
            print(
                "tenx lighthouse: warning: listening on every interface, without authentication; anyone "
                "who reaches this port can join or disturb quorums: bind one address on a network you "
                "trust (docs/security.md)",
                flush=True,
            )
        print(
            f"  --set parallel.replicas.lighthouse={address}   (or env TORCHFT_LIGHTHOUSE={address})",
            flush=True,
        )
        print(
            f"  min_groups={min_groups} join_timeout_ms={join_timeout_ms} quorum_tick_ms={quorum_tick_ms} "
            f"heartbeat_timeout_ms={heartbeat_timeout_ms}",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("tenx lighthouse: stopped", flush=True)


def cmd_lighthouse(args: argparse.Namespace) -> None:
    """The `tenx lighthouse` command."""
    run_lighthouse(
        args.bind,
        min_groups=args.min_groups,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )


def add_lighthouse_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `tenx lighthouse` on the CLI's subparsers."""
    lp = subparsers.add_parser(
        "lighthouse", help="run torchft's lighthouse: the rendezvous of replica groups (parallel.replicas)"
    )
    lp.add_argument(
        "--bind",
        required=True,
        metavar="ADDR:PORT",
        help="where to listen: 127.0.0.1:PORT for one machine, ADDR:PORT with this machine's address on "
        "the network the groups share otherwise (0.0.0.0:PORT listens on every interface; docs/security.md)",
    )
    lp.add_argument("--min-groups", type=int, default=1, help="fewest groups that form a quorum (default 1)")
    lp.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60_000,
        help="how long a quorum waits for known groups that have not asked yet (default 60000)",
    )
    lp.add_argument(
        "--quorum-tick-ms", type=int, default=100, help="how often the quorum is re-evaluated (default 100)"
    )
    lp.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5_000,
        help="a group silent this long is dead and left out of quorums; also roughly how long survivors "
        "stall when a peer dies (default 5000)",
    )
    lp.set_defaults(func=cmd_lighthouse)
    return lp
