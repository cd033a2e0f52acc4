"""The dashboard's HTML page, served live or written as one self-contained report file.

The page is page.html with dashboard.js; plotly.js comes from the `plotly` pip package
(plotly/package_data/plotly.min.js, about 4.8 MB). Live, the page loads both scripts from the server and
fetches the runs' views; as a report, both scripts and the views are inlined, and a Content-Security-Policy
in the page forbids every network request, so it opens offline and reaches nowhere when it does not.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tenx.errors import TenxError
from tenx.monitor.dashboard.data import RunView, unique_names
from tenx.utils.io import atomic_write_text

HERE = Path(__file__).resolve().parent
REPORT_GENERATOR = "tenx report"
LIVE_GENERATOR = "tenx dashboard"
REPORT_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
    "font-src data:; base-uri 'none'; form-action 'none'"
)
LIVE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The Content-Security-Policy the server sends with the page: scripts and data from this server only."""


@functools.lru_cache(maxsize=1)
def plotly_js() -> bytes:
    """plotly.js, minified, as shipped inside the `plotly` package (no network)."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise TenxError(
            "the dashboard draws with plotly, which is not installed: pip install 'plotly>=5'"
        ) from None
    return get_plotlyjs().encode("utf-8")


def dashboard_js() -> bytes:
    """The page's own script."""
    return (HERE / "dashboard.js").read_bytes()


def script_json(obj: Any) -> str:
    """`obj` as JSON that is safe inside a <script> element (no `</script>`, no `<!--`)."""
    text = json.dumps(obj, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _html_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def render_page(names: Sequence[str], config: dict[str, Any], *, inline: bool) -> str:
    """The page: with `inline`, self-contained (scripts inlined, no network); else loading static/*.js."""
    template = (HERE / "page.html").read_text(encoding="utf-8")
    if inline:
        scripts = (
            f"<script>{plotly_js().decode('utf-8')}</script>\n"
            f"<script>{dashboard_js().decode('utf-8')}</script>"
        )
        csp = f'<meta http-equiv="Content-Security-Policy" content="{REPORT_CSP}">'
    else:
        scripts = '<script src="static/plotly.min.js"></script>\n<script src="static/dashboard.js"></script>'
        csp = ""
    title = "tenx: " + ", ".join(names) if names else "tenx"
    replacements = {
        "{{GENERATOR}}": REPORT_GENERATOR if inline else LIVE_GENERATOR,
        "{{CSP}}": csp,
        "{{TITLE}}": _html_text(title if len(title) <= 120 else title[:117] + "..."),
        "{{CONFIG}}": script_json(config),
    }
    head, marker, tail = template.partition("{{SCRIPTS}}")
    for key, value in replacements.items():  # the scripts go in last: their text is never searched
        head, tail = head.replace(key, value), tail.replace(key, value)
    return head + scripts + tail if marker else head


def is_report(path: Path) -> bool:
    """Whether `path` is a file `tenx report` wrote (its generator tag is in the first few kilobytes)."""
    try:
        with open(path, "rb") as f:
            start = f.read(4096)
    except OSError:
        return False
    return f'<meta name="generator" content="{REPORT_GENERATOR}">'.encode() in start


def write_report(run_dirs: Sequence[str | Path], out: str | Path, force: bool = False) -> Path:
    """Write the runs' dashboard as one self-contained HTML file, atomically; a file at `out` that is not
    an earlier report is replaced only with `force`."""
    out = Path(out)
    missing = [str(d) for d in run_dirs if not Path(d).is_dir()]
    if missing:
        raise TenxError(f"not a run directory: {', '.join(missing)}")
    if out.is_dir():
        raise TenxError(f"{out} is a directory; give the report's file name, e.g. -o {out / 'report.html'}")
    if out.exists() and not force and not is_report(out):
        raise TenxError(
            f"{out} exists and is not a tenx report; choose another -o or pass --force to replace it"
        )
    if not out.parent.is_dir():
        raise TenxError(f"{out.parent} does not exist; create it first or choose another -o")
    names = unique_names(run_dirs)
    views = [RunView(d, name).read() for d, name in zip(run_dirs, names)]
    config = {"mode": "report", "runs": views, "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    atomic_write_text(out, render_page(names, config, inline=True))
    return out
