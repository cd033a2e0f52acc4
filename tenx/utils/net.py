"""Addresses a `tenx` server listens on: `--bind HOST:PORT`, parsed one way for every server."""

from __future__ import annotations

from tenx.errors import TenxError

WILDCARD_HOSTS = ("0.0.0.0", "::")
"""Hosts that mean every interface of this machine."""


def parse_bind(text: str, flag: str = "--bind", example: str = "127.0.0.1:8050") -> tuple[str, int]:
    """`HOST:PORT` or `[IPV6]:PORT` as (host, port), the host without brackets as sockets take it; port 0
    asks the system for a free one. A clear TenxError naming `flag` otherwise."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") != host.endswith("]"):
        raise TenxError(
            f"{flag} {text!r}: an IPv6 address goes in brackets, e.g. [::1]:{example.split(':')[-1]}"
        )
    if host.startswith("["):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise TenxError(
            f"{flag} {text!r}: expected HOST:PORT with a port in [0, 65535], e.g. {example} (this host "
            "only; port 0: any free port)"
        )
    return host, int(port)


def url_host(host: str) -> str:
    """`host` as it goes in a URL: an IPv6 address in brackets (once)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
