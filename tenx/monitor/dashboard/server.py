"""`tenx dashboard`: a read-only HTTP server of the dashboard page and its runs' views.

Safe on a shared machine:

- it listens on 127.0.0.1 unless `--bind` names another address (then it warns: anyone who reaches the
  port reads the runs' metrics), and while on loopback it answers only requests whose Host header names
  loopback, so a web page in the user's browser cannot read it through DNS rebinding;
- it changes nothing: GET and HEAD only, any other method is 405; nothing from a request is written;
- it serves a fixed set of routes: the page, its two scripts (dashboard.js and plotly.js from the plotly
  package), a view per run (`api/run/I`) and the run's own viewable files (`run/I/PATH`: .png, .json,
  .toml and .txt files inside run directory I, never under checkpoints/, no hidden file). A path with a
  `..` or `.` segment, a backslash, a NUL, an empty segment or an escaped `%` is refused (403) before any
  route is matched, in its raw form and decoded; a file whose resolved path (symlinks followed) leaves its
  run directory is refused too. Anything else is 404.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import sys
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from tenx import rundir
from tenx.errors import TenxError
from tenx.monitor.dashboard.data import RunView, unique_names
from tenx.monitor.dashboard.page import LIVE_CSP, dashboard_js, plotly_js, render_page
from tenx.utils.net import parse_bind
from tenx.utils.text import counted

DEFAULT_BIND = "127.0.0.1:8050"
FILE_TYPES = {
    ".png": "image/png",
    ".json": "application/json",
    ".toml": "text/plain; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
}
"""What `run/I/PATH` serves, by suffix: plots, reports and configs (never checkpoints or tensors)."""
MAX_FILE_BYTES = 64 * 2**20
RUN_FILE = re.compile(r"^/run/(\d+)/(.+)$")
API_RUN = re.compile(r"^/api/run/(\d+)$")
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
COMMON_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Resource-Policy": "same-origin",
}


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unsafe_path(path: str) -> bool:
    """Whether a request path could reach outside the routes: a `.` or `..` segment, an empty segment, a
    backslash or a NUL, in the raw path or decoded once, or a percent sign left after decoding (an escape
    escaped twice, like %252e)."""
    decoded = unquote(path)
    if "%" in decoded:
        return True
    for form in (path, decoded):
        if "\\" in form or "\x00" in form:
            return True
        segments = form.split("/")[1:]
        if any(s in (".", "..") for s in segments) or any(s == "" for s in segments[:-1]):
            return True
    return False


class DashboardServer(ThreadingHTTPServer):
    """Serves the dashboard of `run_dirs`; `handle_request`/`serve_forever` as any socketserver."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, run_dirs: Sequence[str | Path], bind: tuple[str, int], refresh_s: float = 5.0) -> None:
        if not run_dirs:
            raise TenxError("give at least one run directory")
        for d in run_dirs:
            if Path(d).exists() and not Path(d).is_dir():
                raise TenxError(f"{d} is a file, not a run directory")
        if not refresh_s > 0:
            raise TenxError(f"--refresh must be > 0 seconds, got {refresh_s}")
        self.run_dirs = [Path(d) for d in run_dirs]
        self.names = unique_names(self.run_dirs)
        self.views = [RunView(d, name) for d, name in zip(self.run_dirs, self.names)]
        self.locks = [threading.Lock() for _ in self.views]
        config = {"mode": "live", "count": len(self.views), "names": self.names, "refresh_s": refresh_s}
        self.page = render_page(self.names, config, inline=False).encode("utf-8")
        self.scripts = {"/static/plotly.min.js": plotly_js(), "/static/dashboard.js": dashboard_js()}
        host, port = bind
        self.host = host
        self.loopback = is_loopback(host)
        if ":" in host:
            self.address_family = socket.AF_INET6
        try:
            super().__init__((host, port), DashboardHandler)
        except OSError as e:
            raise TenxError(
                f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --bind, "
                "e.g. 127.0.0.1:0 for any free port"
            ) from None

    @property
    def url(self) -> str:
        host, port = self.host, self.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        if shown in ("0.0.0.0", "[::]"):
            shown = socket.gethostname()
        return f"http://{shown}:{port}/"

    def view(self, index: int) -> bytes:
        """Run `index`'s view as JSON (reads are serialized per run: a view keeps reading state)."""
        with self.locks[index]:
            view = self.views[index].read()
        return json.dumps(view, allow_nan=False, separators=(",", ":")).encode("utf-8")

    def run_file(self, index: int, relative: str) -> Path | None:
        """The file `relative` inside run directory `index` if it may be served, else None."""
        parts = relative.split("/")
        if any(p.startswith(".") for p in parts) or parts[0] == rundir.CHECKPOINTS:
            return None
        if Path(relative).suffix.lower() not in FILE_TYPES:
            return None
        try:
            root = self.run_dirs[index].resolve(strict=True)
            target = (root / relative).resolve(strict=True)
        except (OSError, RuntimeError):
            return None
        if not target.is_relative_to(root) or not target.is_file():
            return None
        return target

    def route(self, raw_path: str) -> tuple[int, str, bytes, dict[str, str]]:
        """(status, content type, body, extra headers) of a GET of `raw_path`."""
        if not raw_path.startswith("/"):
            return _text(HTTPStatus.BAD_REQUEST, "only paths of this server are served")
        path = raw_path.partition("?")[0].partition("#")[0]  # not urlsplit: `//x/y` is no host here
        if unsafe_path(path):
            return _text(HTTPStatus.FORBIDDEN, "path refused")
        path = unquote(path)
        if path in ("/", "/index.html"):
            return HTTPStatus.OK, "text/html; charset=utf-8", self.page, {"Content-Security-Policy": LIVE_CSP}
        if path in self.scripts:
            return HTTPStatus.OK, "text/javascript; charset=utf-8", self.scripts[path], {}
        if path == "/favicon.ico":
            return HTTPStatus.NO_CONTENT, "text/plain", b"", {}
        match = API_RUN.match(path)
        if match:
            index = int(match.group(1))
            if index >= len(self.views):
                return _text(HTTPStatus.NOT_FOUND, f"no run {index}: this dashboard shows {len(self.views)}")
            return HTTPStatus.OK, "application/json", self.view(index), {"Cache-Control": "no-store"}
        match = RUN_FILE.match(path)
        if match and int(match.group(1)) < len(self.views):
            target = self.run_file(int(match.group(1)), match.group(2))
            if target is None:
                return _text(HTTPStatus.FORBIDDEN, "not a file of this run that the dashboard serves")
            if target.stat().st_size > MAX_FILE_BYTES:
                return _text(HTTPStatus.FORBIDDEN, "file too large to serve")
            try:
                body = target.read_bytes()
            except OSError:
                return _text(HTTPStatus.NOT_FOUND, "file not readable")
            return HTTPStatus.OK, FILE_TYPES[target.suffix.lower()], body, {"Cache-Control": "no-store"}
        return _text(HTTPStatus.NOT_FOUND, "no such page")

    def host_allowed(self, host_header: str | None) -> bool:
        """On loopback, only requests addressed to a loopback name (DNS-rebinding protection)."""
        if not self.loopback or host_header is None:
            return True
        host = host_header.strip()
        if host.startswith("["):
            host = host[1 : host.find("]")] if "]" in host else host
        else:
            host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return host.lower() in LOOPBACK_NAMES or is_loopback(host)


def _text(status: int, message: str) -> tuple[int, str, bytes, dict[str, str]]:
    return status, "text/plain; charset=utf-8", (message + "\n").encode("utf-8"), {}


class DashboardHandler(BaseHTTPRequestHandler):
    """GET and HEAD of the server's routes; every other method is refused with 405."""

    server: DashboardServer
    server_version = "tenx-dashboard"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _refuse(self) -> None:
        self.close_connection = True  # a request body, if any, is never read
        body = b"read-only: only GET and HEAD are served\n"
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", body, {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse

    def _answer(self, send_body: bool) -> None:
        if not self.server.host_allowed(self.headers.get("Host")):
            status, kind, body, headers = _text(HTTPStatus.FORBIDDEN, "unexpected Host header")
        else:
            try:
                status, kind, body, headers = self.server.route(self.path)
            except Exception as e:  # a view that cannot be built: say so, keep serving the others
                status, kind, body, headers = _text(HTTPStatus.INTERNAL_SERVER_ERROR, f"error: {e}")
        self._send(status, kind, body if send_body else b"", headers, length=len(body))

    def _send(
        self, status: int, kind: str, body: bytes, headers: dict[str, str], length: int | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        for name, value in {**COMMON_HEADERS, **headers}.items():
            self.send_header(name, value)
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Only refusals and errors are logged (the page polls every few seconds)."""
        if len(args) >= 2 and str(args[1])[:1] in ("4", "5"):
            sys.stderr.write(f"tenx dashboard: {self.address_string()} {format % args}\n")


def serve(run_dirs: Sequence[str | Path], bind: str = DEFAULT_BIND, refresh_s: float = 5.0) -> None:
    """Run the dashboard of `run_dirs` until interrupted, printing its URL first."""
    server = DashboardServer(run_dirs, parse_bind(bind), refresh_s)
    for d in server.run_dirs:
        if not d.exists():
            print(f"tenx dashboard: {d} does not exist yet; it is shown once the run starts", file=sys.stderr)
    if not server.loopback:
        print(
            f"tenx dashboard: warning: listening on {server.host}, not loopback: anyone who can "
            "reach this port can read these runs' metrics and files (read-only); docs/security.md",
            file=sys.stderr,
        )
    print(f"dashboard of {counted(len(server.views), 'run')}: {server.url}  (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        print("tenx dashboard: stopped", file=sys.stderr)
    finally:
        server.server_close()
