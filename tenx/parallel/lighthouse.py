"""`tenx lighthouse`: torchft's lighthouse, the rendezvous that forms quorums of live replica groups.

Every replica group's manager heartbeats to the lighthouse and asks it for a quorum at each sync point;
the lighthouse answers with the groups alive at that moment (a group silent for `heartbeat_timeout_ms` is
dead) once at least `min_groups` have asked. It holds no training state: restarting it costs the groups
one quorum round, not their progress.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from tenx.config import check_bounds, field
from tenx.errors import TenxError
from tenx.utils.net import WILDCARD_HOSTS, parse_bind, url_host


@dataclass
class LighthouseConfig:
    """How the lighthouse forms quorums (the options of `tenx lighthouse`)."""

    SECTION: ClassVar[str] = "lighthouse"
    """Where its fields sit in the config tree (errors name `lighthouse.FIELD`)."""

    min_groups: int = field(1, ge=1, help="fewest groups that form a quorum")
    join_timeout_ms: int = field(
        60_000, ge=1, help="how long a quorum waits for known groups that have not asked yet"
    )
    quorum_tick_ms: int = field(100, ge=1, help="how often the quorum is re-evaluated")
    heartbeat_timeout_ms: int = field(
        5_000,
        ge=1,
        help="a group silent this long is dead and left out of quorums; also roughly how long survivors "
        "stall when a peer dies",
    )


def start_lighthouse(bind: str, **options: int) -> tuple[Any, str]:
    """Start a lighthouse in this process; returns (server, address to give the groups).

    `options` are LighthouseConfig's fields (min_groups=2, ...); the others keep their defaults.
    """
    from tenx.parallel.torchft_glue import quiet_torchft

    quiet_torchft()
    from torchft._torchft import LighthouseServer

    host, _ = parse_bind(bind, "lighthouse --bind", "127.0.0.1:29510")
    cfg = LighthouseConfig(**options)
    check_bounds(cfg)
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=cfg.min_groups,
            join_timeout_ms=cfg.join_timeout_ms,
            quorum_tick_ms=cfg.quorum_tick_ms,
            heartbeat_timeout_ms=cfg.heartbeat_timeout_ms,
        )
    except Exception as e:  # noqa: BLE001 - the Rust server reports bind failures as plain exceptions
        raise TenxError(f"lighthouse --bind {bind!r}: cannot listen there: {e}") from e
    port = server.address().rpartition(":")[2]
    # A wildcard bind is reachable under the machine's name (torchft's own address); a specific one as is.
    advertised = server.address() if host in WILDCARD_HOSTS else f"http://{url_host(host)}:{port}"
    return server, advertised


def run_lighthouse(bind: str, **options: int) -> None:
    """Run a lighthouse until SIGINT or SIGTERM, printing the address groups connect to (`options`: as
    start_lighthouse's)."""
    server, address = start_lighthouse(bind, **options)
    cfg = LighthouseConfig(**options)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"tenx lighthouse: serving on {bind}; groups connect with", flush=True)
        if parse_bind(bind, "lighthouse --bind")[0] in WILDCARD_HOSTS:
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
        print("  " + " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("tenx lighthouse: stopped", flush=True)
