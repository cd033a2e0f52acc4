"""Hostile run directories for `tenx status`, `incidents` and `report` (issue 29): malformed event times and
metrics lines are passed over and counted, a directory in a file's place is one error line naming it, and a
reader that closes stdout early (`| head -1`) ends the command quietly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tenx.cli import main
from tenx.monitor.events import read_events, read_events_counted
from tenx.monitor.metrics_file import read_metrics_counted
from tenx.rundir import RunDir
from tenx.triage.incident_store import IncidentStore

GOOD = {"time": 1000.0, "kind": "crash", "step": 3}


def _events(tmp_path, *lines: str):
    RunDir(tmp_path).events.write_text("".join(line + "\n" for line in lines))


@pytest.mark.parametrize("bad_time", ["NaN", "1e400", "-Infinity", '"x"', "null", "[]", "true"])
def test_status_passes_over_an_event_whose_time_is_not_a_finite_number(tmp_path, capsys, bad_time):
    _events(tmp_path, json.dumps(GOOD), f'{{"time": {bad_time}, "kind": "hang", "step": 4}}')
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "events      crash 1\n" in out and "hang" not in out
    assert f"1 event of {RunDir(tmp_path).events} passed over" in out


def test_events_with_a_wrong_kind_or_step_type_are_counted_and_a_non_object_line_is_skipped(tmp_path):
    _events(
        tmp_path,
        json.dumps(GOOD),
        "[]",
        '"just a string"',
        json.dumps({"time": 1.0, "kind": 7}),
        json.dumps({"time": 1.0, "kind": "fault", "step": "4"}),
        json.dumps({"time": 1.0, "kind": "fault", "step": True}),
        json.dumps({"time": 2.0, "kind": "restart", "step": None}),
    )
    events, malformed = read_events_counted(tmp_path)
    assert [e["kind"] for e in events] == ["crash", "restart"] and malformed == 3
    assert read_events(tmp_path) == events


def test_an_event_time_past_what_the_platform_dates_is_shown_raw(tmp_path, capsys):
    _events(tmp_path, json.dumps({"time": 1e300, "kind": "fault", "step": 1}))
    assert main(["status", str(tmp_path)]) == 0
    assert "  time 1e+300  fault step 1" in capsys.readouterr().out


def test_one_bad_time_does_not_fail_the_incident_ingest(tmp_path):
    _events(tmp_path, json.dumps(GOOD), '{"time": NaN, "kind": "hang", "step": 4}')
    with IncidentStore(tmp_path) as store:
        assert store.ingest() == 1
        assert store.ingest() == 0  # idempotent: the passed-over line makes nothing on a second pass


def test_status_passes_over_metrics_lines_that_are_not_step_records(tmp_path, capsys):
    lines = [
        "[]",
        '{"step": 1, "loss": 3.5}',
        '{"step": "2", "loss": 3.0}',
        "{not json",
        '{"step": 3, "loss": 2.5}',
    ]
    RunDir(tmp_path).metrics.write_text("\n".join(lines) + '\n{"step": 4, "lo')  # a torn last line
    records, skipped = read_metrics_counted(RunDir(tmp_path).metrics)
    assert [r["step"] for r in records] == [1, 3] and skipped == 3
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "metrics     step 3 | loss 2.5000" in out
    assert f"3 lines of {RunDir(tmp_path).metrics} passed over" in out


def test_a_prediction_deviation_that_is_not_a_number_is_not_shown(tmp_path, capsys):
    RunDir(tmp_path).metrics.write_text('{"step": 1, "loss": 3.5, "pred_dev": "x"}\n')
    assert main(["status", str(tmp_path)]) == 0
    assert "\nprediction  " not in capsys.readouterr().out


@pytest.mark.parametrize("name", ["events", "metrics", "ledger"])
@pytest.mark.parametrize("command", ["status", "incidents", "report"])
def test_a_directory_in_place_of_a_run_file_is_one_error_naming_it(tmp_path, capsys, name, command):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.config.write_text("[train]\nsteps = 10\n")
    if name != "events":
        _events(run.root, json.dumps(GOOD))
    getattr(run, name).mkdir()
    argv = [command, str(run.root)] + (["-o", str(tmp_path / "report.html")] if command == "report" else [])
    if command != "status" and name == "metrics":
        pytest.skip("incidents and report do not read metrics.jsonl")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tenx: error: ") and err.count("\n") == 1
    assert f"{getattr(run, name)} is a directory" in err


def test_status_of_a_file_says_it_is_not_a_run_directory(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    assert main(["status", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is a file, not a run directory" in err and "does not exist" not in err


def test_status_piped_into_head_ends_quietly_with_the_sigpipe_status(tmp_path):
    # far more than a pipe holds (64 KiB), so the writer is still writing when `head` closes the pipe
    _events(
        tmp_path,
        *(json.dumps({"time": 1.0 + i, "kind": "fault", "step": i, "note": "x" * 80}) for i in range(8000)),
    )
    status = [sys.executable, "-m", "tenx", "status", str(tmp_path), "--events", "all"]
    tenx = subprocess.Popen(status, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-1"], stdin=tenx.stdout, stdout=subprocess.PIPE)
    tenx.stdout.close()  # only `head` holds the read end now
    first, _ = head.communicate(timeout=300)
    err = tenx.stderr.read().decode()
    tenx.stderr.close()
    assert tenx.wait(timeout=300) == 141
    assert first.decode() == f"run         {tmp_path}\n"
    assert err == ""


@pytest.mark.parametrize("store_exists", [False, True])
def test_a_read_only_run_says_so_instead_of_unable_to_open_database_file(
    tmp_path, capsys, monkeypatch, store_exists
):
    """SQLite as on a read-only file system (opened mode=ro: root ignores file permissions): the error names
    the run directory as read-only and says what to do, and never calls the store damaged."""
    import sqlite3

    _events(tmp_path, json.dumps(GOOD))
    if store_exists:
        with IncidentStore(tmp_path) as store:
            store.ingest()
        assert main(["incidents", str(tmp_path)]) == 0  # nothing new to write: a read-only run is listed
        _events(tmp_path, json.dumps(GOOD), json.dumps({**GOOD, "time": 2000.0, "step": 9}))
    real = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda path, **kw: real(f"file:{path}?mode=ro", uri=True, **kw))
    assert main(["incidents", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is read-only" in err and "Copy the run directory somewhere writable" in err, err
    assert "not a tenx incident store" not in err and "unable to open database file\n" not in err
