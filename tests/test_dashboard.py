"""The dashboard (tenx.monitor.dashboard): a run's view, the read-only server, the offline report, and the
page in headless Chromium, whose every figure is compared with one computed here from the run's files;
and `tenx status`'s list of events.

The browser tests need Chromium and its WebDriver (Debian: `apt-get install chromium chromium-driver`;
.ci/run installs them) and skip, saying so, where either is missing. With
TENX_DASHBOARD_SCREENSHOTS=DIR they also save the screenshots of docs/monitoring.md into DIR:

    TENX_DASHBOARD_SCREENSHOTS=docs/images python -m pytest -q tests/test_dashboard.py -k browser
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tenx.cli import main
from tenx.errors import TenxError
from tenx.monitor.dashboard.data import RunView, unique_names
from tenx.monitor.dashboard.page import is_report
from tenx.monitor.dashboard.server import DashboardServer, unsafe_path
from tenx.monitor.events import EventLog
from tenx.monitor.goodput import Ledger, compute_goodput
from tenx.monitor.metrics_file import read_metrics
from tenx.monitor.prediction_file import Prediction, write_prediction
from tenx.rundir import RunDir
from tenx.train.run import train
from tenx.utils.io import atomic_write_text
from tenx.utils.net import parse_bind

STEPS = 30
FAULTS = ["spike@step=8", "nan@step=12", "slow@step=16,seconds=0.05", "bitflip@step=20"]
FAULT_STEPS = {"spike": 8, "nan": 12, "slow": 16, "bitflip": 20}
SOURCES = ["digits", "letters"]
"""The data sources of the runs' validation split (the `two_source_data` fixture)."""


def _records(run: Path) -> list[dict]:
    """metrics.jsonl read with nothing but json: what the page must show, found independently of tenx's
    readers (NaN, as Python's json writes it, stays a float NaN)."""
    return [json.loads(line) for line in RunDir(run).metrics.read_text().splitlines()]


def _shown(value):
    """A figure as the page's JSON carries it: a non-finite number is null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _predict(records: list[dict]) -> Prediction:
    """A prediction close to the run: the median of its loss over 5 steps, with a band of ±8%."""
    steps, losses = [], []
    for r in records:
        window = sorted(
            x["loss"] for x in records if abs(x["step"] - r["step"]) <= 2 and math.isfinite(x["loss"])
        )
        steps.append(r["step"])
        losses.append(window[len(window) // 2])
    return Prediction(
        step=steps,
        tokens=[records[0]["tokens"] * s for s in steps],
        loss=losses,
        lower=[x * 0.92 for x in losses],
        upper=[x * 1.08 for x in losses],
        window=5,
        source={"kind": "test"},
        target={"steps": STEPS},
    )


def _tiny_run(tiny_config, data: Path, run: Path, *overrides: str) -> Path:
    """A finished 30-step tiny run with a prediction.json; every statistic in its metrics is one the run
    logged itself (nothing is made up for the page to show)."""
    settings = ("train.steps=30", "train.eval_every=10", "checkpoint.every=10", "monitor.stats_every=5")
    train(tiny_config(data, *settings, *overrides), run)
    records = read_metrics(RunDir(run).metrics)
    logged = [r["step"] for r in records if any(k.startswith("stats/grad_norm/") for k in r)]
    assert logged == [5, 10, 15, 20, 25, 30], f"the run logged statistics at steps {logged}"
    write_prediction(RunDir(run).prediction, _predict(records))
    return run


@pytest.fixture(scope="module")
def finished_run(tiny_config, two_source_data, tmp_path_factory) -> Path:
    """A finished tiny run with spike, nan, slow and bitflip faults injected."""
    run = tmp_path_factory.mktemp("dashboard") / "faulty"
    return _tiny_run(tiny_config, two_source_data, run, f"faults.inject={json.dumps(FAULTS)}")


@pytest.fixture(scope="module")
def other_run(tiny_config, two_source_data, tmp_path_factory) -> Path:
    """A finished tiny run without faults, at a lower learning rate: replayed as a run still training."""
    run = tmp_path_factory.mktemp("dashboard") / "done"
    return _tiny_run(tiny_config, two_source_data, run, "optim.lr=3e-3")


# ----- the view ---------------------------------------------------------------------------------------
def test_the_view_of_a_finished_run_has_every_step_event_and_statistic(finished_run):
    view = RunView(finished_run).read()
    json.dumps(view, allow_nan=False)  # strict JSON: the nan step's loss is null
    assert view["exists"] and view["finished"] and view["records"] == STEPS
    assert view["steps"] == list(range(1, STEPS + 1)) and len(view["series"]["loss"]) == STEPS
    assert view["series"]["loss"][FAULT_STEPS["nan"] - 1] is None
    loss = view["series"]["loss"]
    assert loss[FAULT_STEPS["spike"] - 1] > 2 * loss[FAULT_STEPS["spike"] - 2]  # logits x100: a spike
    assert all(v is not None and 0 < v < 10 for s, v in enumerate(loss, 1) if s not in (8, 12))
    assert set(view["series"]) >= {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s"}
    assert view["val"]["step"] == [10, 20, 30] and all(0 < v < 10 for v in view["val"]["loss"])
    faults = {e["fields"]["fault_kind"]: e["step"] for e in view["events"] if e["kind"] == "fault"}
    assert faults == FAULT_STEPS
    skipped = [e for e in view["events"] if e["kind"] == "skipped-step"]
    assert [e["step"] for e in skipped] == [12] and skipped[0]["fields"]["reason"] == "nonfinite-loss"
    band = view["prediction"]
    assert band["source"] == RunDir(finished_run).prediction.name and band["step"] == view["steps"]
    assert all(lo < x < hi for lo, x, hi in zip(band["lower"], band["loss"], band["upper"]))
    grad = view["heatmaps"]["grad_norm"]
    assert grad["layers"][:3] == ["embed", "0", "1"] and set(grad["layers"][3:]) <= {"norm", "head"}
    assert grad["step"][:2] == [5, 10] and len(grad["z"]) == len(grad["layers"])
    assert all(len(row) == len(grad["step"]) for row in grad["z"])
    assert "step_time_s" in view["lines"] and "rank0" in view["lines"]["step_time_s"]
    records = _records(finished_run)
    for layer, row in zip(grad["layers"], grad["z"], strict=True):  # the heatmap holds what the run logged
        assert row == [_shown(records[s - 1][f"stats/grad_norm/{layer}"]) for s in grad["step"]]
    by_source = view["lines"]["loss_source"]  # the validation split holds two sources: two series
    assert sorted(by_source) == SOURCES
    for source in SOURCES:
        assert by_source[source]["step"] == [5, 10, 15, 20, 25, 30]
        expected = [records[s - 1][f"stats/loss_source/{source}"] for s in by_source[source]["step"]]
        assert by_source[source]["value"] == expected and all(0 < v < 10 for v in expected)
    goodput = view["goodput"]
    assert (
        goodput["finished"] and goodput["steps"] == STEPS and 0 < goodput["productive_s"] <= goodput["wall_s"]
    )
    assert view["last"]["step"] == STEPS and view["last"]["val_loss"] == view["val"]["loss"][-1]
    assert {RunDir(finished_run).config.name, RunDir(finished_run).provenance.name} <= set(view["files"])
    assert view["total_steps"] == STEPS and not view["errors"]


def _line(step: int, **extra) -> str:
    return json.dumps({"step": step, "loss": 3.0 - 0.01 * step, "lr": 1e-3, **extra}) + "\n"


def test_a_run_being_written_is_read_line_by_line(tmp_path):
    run = RunDir(tmp_path / "run")
    view = RunView(run.root)
    first = view.read()
    assert not first["exists"] and first["records"] == 0 and "does not exist yet" in first["errors"][0]
    run.root.mkdir()
    empty = view.read()
    assert empty["exists"] and empty["records"] == 0 and empty["goodput"] is None and empty["events"] == []
    with open(run.metrics, "w") as f:
        f.write(_line(1) + _line(2) + _line(3) + '{"step": 4, "loss": 2.9')  # the writer is mid-line
        f.flush()
        assert view.read()["steps"] == [1, 2, 3]
        f.write(', "lr": 0.001}\n' + _line(5, loss=float("nan")))
        f.flush()
        now = view.read()
    assert (
        now["steps"] == [1, 2, 3, 4, 5]
        and now["series"]["loss"][3] == 2.9
        and now["series"]["loss"][4] is None
    )
    # a resume rewrites the file (a new one, longer than the old here): it is read from its start
    atomic_write_text(run.metrics, "".join(_line(s, note="x" * 150) for s in (1, 2)))
    assert run.metrics.stat().st_size > 5 * len(_line(5)) and view.read()["steps"] == [1, 2]
    with open(run.events, "w") as f:
        f.write(json.dumps({"time": 1.0, "kind": "fault", "step": 2, "fault": "x"}) + '\n{"time": 2, "ki')
    assert [e["kind"] for e in view.read()["events"]] == ["fault"]


def test_a_malformed_prediction_is_an_error_on_the_page_and_the_band_comes_from_the_metrics(tmp_path):
    run = RunDir(tmp_path)
    run.metrics.write_text(_line(1, pred_loss=3.0, pred_lower=2.8, pred_upper=3.2) + _line(2))
    run.prediction.write_text('{"format": "tenx.prediction", "version": 1, "curve": {"step": [1]}}')
    view = RunView(tmp_path).read()
    assert len(view["errors"]) == 1 and "prediction not drawn" in view["errors"][0]
    assert "curve.tokens" in view["errors"][0]
    assert view["prediction"]["step"] == [1] and view["prediction"]["upper"] == [3.2]


def test_an_event_without_a_step_is_placed_by_its_time_on_the_ledger(tmp_path):
    with Ledger(tmp_path, pid=1) as ledger:
        ledger.start(0, process_start=99.0, at=100.0)
        for step in range(1, 6):
            ledger.step(step, 1.0, at=100.0 + step)
    RunDir(tmp_path).events.write_text(
        json.dumps({"time": 103.5, "kind": "hang", "step": None}) + "\n"
        + json.dumps({"time": 50.0, "kind": "launch", "step": None}) + "\n"
    )  # fmt: skip
    events = RunView(tmp_path).read()["events"]
    assert [(e["kind"], e["step"], e["estimated"]) for e in events] == [
        ("hang", 3, True),
        ("launch", 0, True),
    ]


def test_runs_are_named_by_the_shortest_tail_that_tells_them_apart(tmp_path):
    paths = [tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c"]
    assert unique_names(paths) == ["a/run", "b/run", "c"]
    assert unique_names([tmp_path / "x", tmp_path / "x"]) == ["x (1)", "x (2)"]


# ----- tenx status --------------------------------------------------------------------------------------
def test_tenx_status_lists_the_last_five_events_or_as_many_as_asked(tmp_path, capsys):
    events = EventLog(tmp_path)
    for i in range(8):
        events.emit("fault" if i % 2 else "restart", i, note=f"n{i}")

    def listed(*flags: str) -> tuple[list[str], str]:
        assert main(["status", str(tmp_path), *flags]) == 0
        out = capsys.readouterr().out
        return [line.split("note=")[1] for line in out.splitlines() if "note=n" in line], out

    shown, out = listed()
    assert shown == ["n3", "n4", "n5", "n6", "n7"]
    assert "events      fault 4, restart 4 (the last 5 of 8 below; --events all for every one)" in out
    assert listed("--events", "2")[0] == ["n6", "n7"]
    shown, out = listed("--events", "all")
    assert shown == [f"n{i}" for i in range(8)] and "events      fault 4, restart 4\n" in out
    assert listed("--events", "100")[0] == [f"n{i}" for i in range(8)]
    for bad in ("0", "-1", "some"):
        with pytest.raises(SystemExit):
            main(["status", str(tmp_path), "--events", bad])
        assert "expected a positive number of events or 'all'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--events N|all list the last N events of events.jsonl, or all of them" in help_text
    assert "(default: 5)" in help_text


# ----- the server ---------------------------------------------------------------------------------------
@pytest.fixture
def server(finished_run, tmp_path):
    """The dashboard of the finished run on a free loopback port, with a secret beside the run directory and
    a symlink inside it that points at the secret."""
    (tmp_path / "secret.txt").write_text("TOP-SECRET")
    link = finished_run / "leak.txt"
    if not link.is_symlink():
        link.symlink_to(tmp_path / "secret.txt")
    srv = DashboardServer([finished_run], ("127.0.0.1", 0), refresh_s=0.5)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    link.unlink()


def _request(srv, method: str, path: str, host: str | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    conn.putrequest(method, path, skip_host=host is not None, skip_accept_encoding=True)
    if host is not None:
        conn.putheader("Host", host)
    conn.putheader("Content-Length", "0")
    conn.endheaders()
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), body


def _raw(srv, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_the_server_serves_the_page_its_scripts_and_each_runs_view(server, finished_run):
    status, headers, body = _request(server, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Frame-Options"] == "DENY"
    assert b'src="static/plotly.min.js"' in body and b"http://" not in body and b"https://" not in body
    status, _, js = _request(server, "GET", "/static/plotly.min.js")
    assert status == 200 and js.startswith(b"/**\n* plotly.js") and len(js) > 1_000_000
    status, headers, body = _request(server, "GET", "/api/run/0")
    view = json.loads(body)
    assert status == 200 and headers["Cache-Control"] == "no-store" and view["records"] == STEPS
    status, _, body = _request(server, "HEAD", "/api/run/0")
    assert status == 200 and body == b""
    assert _request(server, "GET", "/api/run/1")[0] == 404
    status, _, body = _request(server, "GET", "/run/0/" + RunDir(finished_run).config.name)
    assert status == 200 and body == RunDir(finished_run).config.read_bytes()
    assert _request(server, "GET", "/favicon.ico")[0] == 204


@pytest.mark.parametrize(
    "path",
    [
        "/../secret.txt",
        "/run/0/../../secret.txt",
        "/run/0/%2e%2e/%2e%2e/secret.txt",
        "/run/0/%2E%2E%2F%2E%2E%2Fsecret.txt",
        "/static/..%2f..%2fsecret.txt",
        "/run/0/%252e%252e/secret.txt",
        "/run/0/./leak.txt",
        "/run/0//etc/passwd",
        "/run/0/..\\..\\secret.txt",
        "/run/0/leak.txt",  # a symlink out of the run directory
        "/run/0/checkpoints/step_00000010/meta.json",
        "/run/0/.hidden.json",
        "/run/0/ledger.jsonl",  # not a type the server shows
    ],
)
def test_paths_out_of_the_run_directories_are_refused(server, path):
    status, _, body = _request(server, "GET", path)
    assert status in (403, 404) and b"TOP-SECRET" not in body
    assert status == 403 or not path.startswith("/run/0/")


def test_unknown_routes_other_methods_foreign_hosts_and_absolute_targets_are_refused(server):
    assert _request(server, "GET", "/etc/passwd")[0] == 404
    assert _request(server, "GET", "/api/run/0/../../x")[0] == 403
    assert _request(server, "GET", "//etc/passwd")[0] in (403, 404)  # http.server may collapse the //
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        status, headers, _ = _request(server, method, "/api/run/0")
        assert status == 405 and headers["Allow"] == "GET, HEAD", method
    # DNS rebinding: a page of another site whose name now points at 127.0.0.1
    assert _request(server, "GET", "/api/run/0", host="attacker.example:8050")[0] == 403
    assert _request(server, "GET", "/api/run/0", host=f"localhost:{server.server_address[1]}")[0] == 200
    assert _raw(server, b"GET http://attacker.example/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").startswith(
        b"HTTP/1.1 400"
    )
    nul = _raw(server, b"GET /run/0/%00/secret.txt HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert nul.startswith(b"HTTP/1.1 403") and b"TOP-SECRET" not in nul
    assert unsafe_path("/run/0/a%2fb%2f..%2fc") and not unsafe_path("/run/0/extrapolation/prediction.png")


def test_bind_addresses_are_checked(tmp_path):
    assert parse_bind("127.0.0.1:0") == ("127.0.0.1", 0) and parse_bind("[::1]:8050") == ("::1", 8050)
    for bad in ("8050", "127.0.0.1:", ":8050", "127.0.0.1:70000", "localhost:http"):
        with pytest.raises(TenxError, match="HOST:PORT"):
            parse_bind(bad)
    (tmp_path / "file").write_text("")
    with pytest.raises(TenxError, match="is a file"):
        DashboardServer([tmp_path / "file"], ("127.0.0.1", 0))


def test_tenx_dashboard_prints_its_url_and_serves_until_stopped(finished_run):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tenx", "dashboard", str(finished_run), "--bind", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert match, line + proc.stderr.read()
        conn = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=30)
        conn.request("GET", "/api/run/0")
        assert json.loads(conn.getresponse().read())["records"] == STEPS
        conn.close()
    finally:
        proc.terminate()
        proc.wait(30)


# ----- the report -----------------------------------------------------------------------------------
def test_the_report_is_one_offline_file_and_never_replaces_a_file_it_did_not_write(
    finished_run, tmp_path, capsys
):
    out = tmp_path / "report.html"
    assert main(["report", str(finished_run), "-o", str(out)]) == 0
    html = out.read_text()
    assert "wrote" in capsys.readouterr().out and is_report(out)
    markup = re.sub(r"(<script[^>]*>).*?</script>", r"\1</script>", html, flags=re.S)
    assert markup.count("<script") == 3  # the runs' JSON, plotly.js and the page's script: all inline
    assert not re.search(r"""(src|href)=["'](?!data:)""", markup)  # nothing to load
    assert "* plotly.js v" in html and "default-src 'none'" in html
    config = json.loads(
        re.search(r'<script type="application/json" id="tenx-config">(.*?)</script>', html).group(1)
    )
    assert config["mode"] == "report" and config["runs"][0]["records"] == STEPS
    assert main(["report", str(finished_run), "-o", str(out)]) == 0  # an earlier report: replaced
    mine = tmp_path / "notes.html"
    mine.write_text("<p>my notes</p>")
    assert main(["report", str(finished_run), "-o", str(mine)]) == 2
    assert "not a tenx report" in capsys.readouterr().err and mine.read_text() == "<p>my notes</p>"
    assert main(["report", str(finished_run), "-o", str(mine), "--force"]) == 0 and is_report(mine)
    assert main(["report", str(tmp_path / "nope"), "-o", str(tmp_path / "r.html")]) == 2
    assert main(["report", str(finished_run), "-o", str(tmp_path)]) == 2
    assert not list(tmp_path.glob(".*.tmp")) and not (tmp_path / "r.html").exists()


# ----- the page in a browser ------------------------------------------------------------------------
def _browser():
    """Headless Chromium through selenium, or a skip that says what is missing."""
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')"
    )
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip(
            "Chromium or chromedriver is not installed (Debian: apt-get install chromium chromium-driver)"
        )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium fetch a driver
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


@pytest.fixture(scope="module")
def browser():
    driver = _browser()
    yield driver
    driver.quit()


def _wait(driver, condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out; browser log: {driver.get_log('browser')}")


def _traces(driver, chart: str, meta: str) -> list[dict]:
    """The traces of a chart that carry `meta`: their points as plotly holds them (what it draws)."""
    return driver.execute_script(
        "var d = document.getElementById(arguments[0]), meta = arguments[1]; if (!d || !d.data) return [];"
        "function list(a) { return Array.isArray(a) || ArrayBuffer.isView(a) ? Array.from(a) : []; }"
        "return d.data.filter(function (t) { return t.meta === meta; }).map(function (t) {"
        " return {x: list(t.x), y: list(t.y), z: list(t.z).map(list), customdata: list(t.customdata).map("
        " function (r) { return Array.isArray(r) ? r : [r]; }), fill: t.fill || null,"
        " type: t.type || 'scatter', name: t.name, text: Array.isArray(t.text) ? t.text : [],"
        " colorbar: t.colorbar || null}; });",
        chart,
        meta,
    )


def _ticks(driver, chart: str, axis: str) -> list[tuple[float, str]]:
    """The ticks plotly drew on an axis of a chart: (position, label); a log axis's position is log10."""
    return [
        (x, text)
        for x, text in driver.execute_script(
            "var a = document.getElementById(arguments[0])._fullLayout[arguments[1]];"
            "return a._vals.map(function (v) { return [v.x, v.text]; });",
            chart,
            axis,
        )
    ]


def _close(shown, expected, rel: float = 1e-6) -> bool:
    """Whether a series the page holds equals the run's (None where the run has a non-finite value)."""
    expected = [_shown(v) for v in expected]
    return len(shown) == len(expected) and all(
        (a is None and b is None) or (a is not None and b is not None and a == pytest.approx(b, rel=rel))
        for a, b in zip(shown, expected)
    )


def _severe(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def _screenshot(driver, name: str) -> None:
    folder = os.environ.get("TENX_DASHBOARD_SCREENSHOTS")
    if folder:
        for _ in range(2):  # the page reflows at the new size: measure it again
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(1400, min(int(height) + 140, 6000))
            time.sleep(1.0)  # plotly redraws at the new size
        driver.save_screenshot(str(Path(folder) / f"dashboard-{name}.png"))
        driver.set_window_size(1400, 1000)


def _serve(run_dirs, refresh_s: float) -> DashboardServer:
    srv = DashboardServer(run_dirs, ("127.0.0.1", 0), refresh_s=refresh_s)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


def _table(driver) -> list[dict[str, str]]:
    """The rows of the page's run table, by column heading."""
    return driver.execute_script(
        "var heads = Array.from(document.querySelectorAll('#runs thead th')).map(e => e.textContent);"
        "return Array.from(document.querySelectorAll('#runs tbody tr')).map(function (row) {"
        " var out = {}; Array.from(row.children).forEach(function (td, i) { out[heads[i]] = td.textContent; });"
        " return out; });"
    )


def test_browser_shows_a_finished_run(browser, finished_run):
    """Every figure on the page equals the one computed here from the run's own files."""
    records = _records(finished_run)
    events = RunDir(finished_run).events.read_text().splitlines()
    srv = _serve([finished_run], refresh_s=5.0)
    try:
        browser.get(srv.url)
        _wait(browser, lambda: browser.execute_script("return document.body.getAttribute('data-rendered')"))
        (row,) = _table(browser)
        last = records[-1]
        validated = [r for r in records if "val_loss" in r]
        assert row["state"] == "finished" and row["step"] == f"{last['step']} / {STEPS}"
        assert (
            row["train loss"] == f"{last['loss']:.4f}"
            and row["val loss"] == f"{validated[-1]['val_loss']:.4f}"
        )
        assert int(row["tokens/s"].replace(",", "")) == round(last["tokens_per_s"])
        assert float(row["MFU"].rstrip("%")) == pytest.approx(100 * last["mfu"], abs=0.05, rel=0.01)
        assert row["events"] == str(len(events))
        assert row["goodput"] == f"{100 * compute_goodput(finished_run)['goodput']:.1f}%"
        (loss,) = _traces(browser, "chart-loss", "train-loss")
        assert loss["x"] == [r["step"] for r in records] and _close(loss["y"], [r["loss"] for r in records])
        (val,) = _traces(browser, "chart-loss", "val-loss")
        assert val["x"] == [r["step"] for r in validated] == [10, 20, 30]
        assert _close(val["y"], [r["val_loss"] for r in validated])
        (band,) = _traces(browser, "chart-loss", "band")
        assert band["fill"] == "tonexty" and len(band["x"]) == STEPS and "95% band" in band["name"]
        top, note = browser.execute_script(
            "var l = document.getElementById('chart-loss').layout; return [l.yaxis.range[1], l.annotations[0].text]"
        )
        spike = records[FAULT_STEPS["spike"] - 1]["loss"]
        assert top < 10 and f"above the chart, up to {spike:.1f}" in note  # the spike is left out, and said
        for chart, key in (
            ("chart-grad-norm", "grad_norm"),
            ("chart-lr", "lr"),
            ("chart-throughput", "tokens_per_s"),
        ):
            (series,) = _traces(browser, chart, key)
            assert _close(series["y"], [r[key] for r in records]), chart
        (heatmap,) = _traces(browser, "heatmap-grad_norm", "heatmap")
        stats_steps = [r["step"] for r in records if "stats/grad_norm/0" in r]
        assert heatmap["type"] == "heatmap" and heatmap["x"] == stats_steps == [5, 10, 15, 20, 25, 30]
        layers = browser.execute_script(
            "return Array.from(document.getElementById('heatmap-grad_norm').data[0].y)"
        )
        for layer, raw, colour in zip(layers, heatmap["customdata"], heatmap["z"], strict=True):
            logged = [records[s - 1][f"stats/grad_norm/{layer}"] for s in stats_steps]
            assert _close(raw, logged) and _close(colour, [math.log10(v) for v in logged]), layer
        by_source = _traces(browser, "stat-loss_source", "stat-line")
        assert sorted(t["name"].split()[-1] for t in by_source) == SOURCES  # one series per data source
        for trace in by_source:
            key = f"stats/loss_source/{trace['name'].split()[-1]}"
            assert trace["x"] == stats_steps and _close(
                trace["y"], [records[s - 1][key] for s in stats_steps]
            )
        (marks,) = _traces(browser, "chart-events", "events")
        assert len(marks["x"]) == len(events)
        shown = {
            (x, m.group(1))
            for x, text in zip(marks["x"], marks["text"])
            if (m := re.search(r"fault_kind: ([\w-]+)", text))
        }
        assert shown == {(step, kind) for kind, step in FAULT_STEPS.items()}  # each fault at its step
        assert browser.execute_script("return document.getElementById('errors').hidden")
        _screenshot(browser, "finished")
        assert not _severe(browser)
    finally:
        srv.shutdown()
        srv.server_close()


def test_browser_follows_a_run_still_training(browser, finished_run, other_run, tmp_path):
    run = RunDir(tmp_path / "lr3e-3")  # `other_run`, replayed as if it were training now
    run.root.mkdir()
    records = read_metrics(RunDir(other_run).metrics)
    shutil.copy(RunDir(other_run).prediction, run.prediction)
    shutil.copy(RunDir(other_run).provenance, run.provenance)
    ledger = [json.loads(line) for line in RunDir(other_run).ledger.read_text().splitlines()]
    run.ledger.write_text(
        "".join(json.dumps(r) + "\n" for r in ledger if r["kind"] != "end" and r.get("step", 0) <= 20)
    )
    lines = [json.dumps(r) + "\n" for r in records]
    run.metrics.write_text("".join(lines[:12]) + lines[12][:25])  # step 13 half-written
    writer_done = threading.Event()

    def write_more() -> None:  # the trainer goes on: finishes step 13, then writes 14 to 20
        with open(run.metrics, "a") as f:
            f.write(lines[12][25:])
            for line in lines[13:20]:
                time.sleep(0.2)
                f.write(line)
                f.flush()
        writer_done.set()

    srv = _serve([finished_run, run.root], refresh_s=0.5)
    try:
        browser.get(srv.url)
        _wait(
            browser,
            lambda: [len(t["x"]) for t in _traces(browser, "chart-loss", "train-loss")] == [STEPS, 12],
        )
        states = browser.execute_script(
            "return Array.from(document.querySelectorAll('#runs tbody tr td:nth-child(2)')).map(e => e.textContent)"
        )
        assert states == ["finished", "training"]
        thread = threading.Thread(target=write_more)
        thread.start()
        thread.join()
        assert writer_done.is_set()
        _wait(
            browser,
            lambda: [len(t["x"]) for t in _traces(browser, "chart-loss", "train-loss")] == [STEPS, 20],
        )
        assert len(_traces(browser, "chart-loss", "band")) == 2
        assert _traces(browser, "heatmap-grad_norm", "heatmap")
        _screenshot(browser, "training")
        assert not _severe(browser)
    finally:
        srv.shutdown()
        srv.server_close()


def _first_steps(run: Path, out: Path, steps: int) -> Path:
    """The run's first `steps` metrics records (and its run.json), as a run directory of its own."""
    out.mkdir()
    shutil.copy(RunDir(run).provenance, RunDir(out).provenance)
    lines = RunDir(run).metrics.read_text().splitlines(keepends=True)
    RunDir(out).metrics.write_text("".join(lines[:steps]))
    return out


@pytest.mark.parametrize("steps", [STEPS, 7])
def test_browser_step_ticks_are_whole_steps_and_log_labels_are_values(browser, finished_run, tmp_path, steps):
    """Step axes tick whole steps, a heatmap of one stats step included (7 steps: stats at step 5 only);
    a log axis labels each tick with its value, and a heatmap's log colours are labelled with values."""
    run = finished_run if steps == STEPS else _first_steps(finished_run, tmp_path / "early", steps)
    srv = _serve([run], refresh_s=5.0)
    try:
        browser.get(srv.url)
        _wait(browser, lambda: browser.execute_script("return document.body.getAttribute('data-rendered')"))
        charts = browser.execute_script(
            "return Array.from(document.querySelectorAll('.step-chart')).filter(d => d.data && d.data.length && !d.hidden)"
            ".map(d => d.id)"
        )
        assert "heatmap-grad_norm" in charts and "chart-loss" in charts

        def whole_steps() -> None:
            for chart in charts:
                ticks = _ticks(browser, chart, "xaxis")
                assert ticks and all(float(x).is_integer() for x, _ in ticks), (chart, ticks)
                assert all(text == str(int(x)) for x, text in ticks), (chart, ticks)

        whole_steps()
        if steps == STEPS:  # zoomed to a few steps, every chart follows and still ticks whole steps
            browser.execute_script(
                "Plotly.relayout(document.getElementById('chart-loss'), {'xaxis.range': [4.3, 9.6]})"
            )
            axes = "return arguments[0].map(id => document.getElementById(id).layout.xaxis).map(a => [a.range, a.dtick])"
            _wait(browser, lambda: browser.execute_script(axes, charts) == [[[4.3, 9.6], 1]] * len(charts))
            whole_steps()
            assert [x for x, _ in _ticks(browser, "heatmap-grad_norm", "xaxis")] == [5, 6, 7, 8, 9]
        labels = _ticks(browser, "chart-grad-norm", "yaxis")
        assert len(labels) >= 2
        for position, text in labels:  # the value itself, not an SI prefix or a lone leading digit
            assert float(text.replace(",", "")) == pytest.approx(10**position, rel=0.01), labels
        logs = []
        for heatmap in [c for c in charts if c.startswith("heatmap-")]:
            (trace,) = _traces(browser, heatmap, "heatmap")
            bar = trace["colorbar"]
            values = [v for row in trace["customdata"] for v in row if v is not None]
            if min(values) <= 0:  # drawn on a linear scale, labelled by plotly
                assert bar["title"]["text"] == "" and "tickvals" not in bar
                continue
            assert bar["title"]["text"] == "log scale" and (
                len(bar["tickvals"]) >= 2 or len(set(values)) == 1
            )
            for position, text in zip(bar["tickvals"], bar["ticktext"], strict=True):
                assert float(text.replace(",", "")) == pytest.approx(10**position, rel=0.005), (heatmap, bar)
            shown = [float(t.replace(",", "")) for t in bar["ticktext"]]
            assert min(values) * 0.995 <= min(shown) and max(shown) <= max(values) * 1.005  # 3 digits
            logs.append(heatmap)
        assert "heatmap-grad_norm" in logs
        assert not _severe(browser)
    finally:
        srv.shutdown()
        srv.server_close()


def test_browser_opens_the_report_offline(browser, finished_run, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(finished_run), "-o", str(out)]) == 0
    browser.get(out.as_uri())
    _wait(browser, lambda: browser.execute_script("return document.body.getAttribute('data-rendered')"))
    (loss,) = _traces(browser, "chart-loss", "train-loss")
    assert len(loss["x"]) == STEPS and _traces(browser, "chart-loss", "band")
    assert not _severe(browser)  # a Content-Security-Policy violation would be one
